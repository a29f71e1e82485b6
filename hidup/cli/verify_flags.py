"""``hidup verify``'s flags, and the :class:`hidup.runtime.verify.VerifyOptions` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from hidup.cli.launch_flags import positive_seconds
from hidup.cli.model_flags import add_model_args, model_request
from hidup.runtime.options import DEFAULT_PROFILE
from hidup.runtime.verify import VerifyOptions
from hidup.search import STYLES

__all__ = ["add_verify_args", "verify_options"]


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """The model flags (two ranks by default) and ``hidup verify``'s own."""
    add_model_args(p, world_default=2)
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="plan JSON (default: search one now); it records its model and world size",
    )
    p.add_argument(
        "--style",
        choices=("searched", *STYLES),
        default="searched",
        help="without --plan: a searched plan or a forced data/tensor/expert-parallel or FSDP-style one",
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile for the search")
    p.add_argument(
        "--duplication",
        choices=("plan", "on", "off"),
        default="plan",
        help="compile as the plan says (default, as `hidup train` on the CPU), or force duplication on "
        "or off; without --plan, off also searches without it",
    )
    p.add_argument("--no-duplication", action="store_true", help="the same as --duplication off")
    p.add_argument("--steps", type=int, default=0, help="also compare K optimizer steps (default 0)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest allowed relative difference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dist-timeout", type=positive_seconds, default=120.0, help="seconds before a hung collective fails"
    )


def verify_options(args: argparse.Namespace) -> VerifyOptions:
    """The :class:`VerifyOptions` of parsed :func:`add_verify_args` flags (``--no-duplication`` read
    as ``--duplication off``)."""
    return VerifyOptions(
        model=model_request(args),
        plan=args.plan,
        style=args.style,
        profile=args.profile,
        duplication="off" if args.no_duplication else args.duplication,
        steps=args.steps,
        tolerance=args.tolerance,
        seed=args.seed,
        dist_timeout=args.dist_timeout,
    )
