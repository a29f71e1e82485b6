"""Subcommands of ``hidup`` that run ranks: ``train``, ``verify`` and ``profile`` (their flags and runs,
as :data:`hidup.cli.app.COMMANDS` names them)."""

from __future__ import annotations

import argparse

from hidup.cli import profile_flags as profile_cli
from hidup.cli import train_flags as train_cli
from hidup.cli import verify_flags as verify_cli
from hidup.runtime import train, verify


def train_flags(p: argparse.ArgumentParser) -> None:
    p.description = train.__doc__.split("\n\n")[0]
    train_cli.add_train_args(p)


def run_train(args) -> int:
    return train.run(train_cli.train_options(args))


def verify_flags(p: argparse.ArgumentParser) -> None:
    p.description = verify.__doc__.split("\n\n")[0]
    verify_cli.add_verify_args(p)


def run_verify(args) -> int:
    return verify.run(verify_cli.verify_options(args))


def profile_flags(p: argparse.ArgumentParser) -> None:
    p.description = "Measure the device and the network and write a profile JSON that `hidup search --profile` accepts."
    profile_cli.add_profile_args(p)


def run_profile(args) -> int:
    return profile_cli.run_profile(args)
