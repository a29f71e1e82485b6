"""Subcommands of ``hidup`` that run ranks: ``train``, ``verify`` and ``profile``."""

from __future__ import annotations

from hidup.cli import profile_flags, train_flags, verify_flags
from hidup.runtime import train, verify


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a zoo model under a plan on this node's GPUs (or CPU ranks)",
        description=train.__doc__.split("\n\n")[0],
    )
    train_flags.add_train_args(p)


def _cmd_train(args) -> int:
    return train.run(train_flags.train_options(args))


def _verify_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="compare a plan's loss and gradients with the single-device model",
        description=verify.__doc__.split("\n\n")[0],
    )
    verify_flags.add_verify_args(p)


def _cmd_verify(args) -> int:
    return verify.run(verify_flags.verify_options(args))


def _profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this machine's device FLOP rates and collective bandwidths",
        description="Measure the device and the network and write a profile JSON that "
        "`hidup search --profile` accepts.",
    )
    profile_flags.add_profile_args(p)


def _cmd_profile(args) -> int:
    return profile_flags.run_profile(args)


COMMANDS = {
    "train": (_train_parser, _cmd_train),
    "verify": (_verify_parser, _cmd_verify),
    "profile": (_profile_parser, _cmd_profile),
}
