"""Subcommands of ``hidup`` that run ranks: ``train``, ``verify`` and ``profile``."""

from __future__ import annotations


def _train_parser(sub) -> None:
    from hidup.runtime.train import __doc__ as doc
    from hidup.runtime.train import add_train_args

    p = sub.add_parser("train", help="train a zoo model under a plan on this node's GPUs (or CPU ranks)",
                       description=doc.split("\n\n")[0])
    add_train_args(p)


def _cmd_train(args) -> int:
    from hidup.runtime.train import run

    return run(args)


def _verify_parser(sub) -> None:
    from hidup.runtime.verify import __doc__ as doc
    from hidup.runtime.verify import add_verify_args

    p = sub.add_parser("verify", help="compare a plan's loss and gradients with the single-device model",
                       description=doc.split("\n\n")[0])
    add_verify_args(p)


def _cmd_verify(args) -> int:
    from hidup.runtime.verify import run

    return run(args)


COMMANDS = {
    "train": (_train_parser, _cmd_train),
    "verify": (_verify_parser, _cmd_verify),
}



def _profile_parser(sub) -> None:
    from hidup.profiler.measure import add_profile_args

    p = sub.add_parser("profile", help="measure this machine's device FLOP rates and collective bandwidths",
                       description="Measure the device and the network and write a profile JSON that "
                       "`hidup search --profile` accepts.")
    add_profile_args(p)


def _cmd_profile(args) -> int:
    from hidup.profiler.measure import run_profile

    return run_profile(args)


COMMANDS["profile"] = (_profile_parser, _cmd_profile)
