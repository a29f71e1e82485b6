"""``hidup peak``'s parser, and the :class:`hidup.runtime.peak.PeakOptions` its flags make."""

from __future__ import annotations

import argparse
from pathlib import Path

from hidup.cli.model_flags import add_model_args, model_request
from hidup.runtime import peak
from hidup.runtime.peak import PeakOptions

__all__ = ["add_flags", "peak_options", "run"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """``hidup peak``'s description and flags on its parser ``p``."""
    p.description = (
        "Predict the peak memory of one rank's program of a saved plan: the program runs a few "
        "training steps on fake tensors (shapes, no memory) while torch's MemTracker follows every tensor. "
        "Printed beside the search's memory model."
    )
    add_model_args(p, world_default=None)
    g = p.add_argument_group("peak")
    g.add_argument("--plan", type=Path, required=True, help="plan JSON (from hidup search --out)")
    g.add_argument("--rank", type=int, default=0, help="which rank's program (default 0)")
    g.add_argument(
        "--precision",
        choices=("fp32", "tf32", "bf16"),
        default=None,
        help="default: the precision the plan was searched for",
    )
    g.add_argument(
        "--duplication", choices=("plan", "on", "off"), default="plan", help="two half-batch copies as the plan says"
    )
    g.add_argument("--steps", type=int, default=2, help="training steps run (default 2; the peak is over all)")
    g.add_argument("--memory", type=float, default=None, help="GB per GPU: exit 1 when the peak exceeds it")
    g.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")


def peak_options(args: argparse.Namespace) -> PeakOptions:
    """The :class:`PeakOptions` of the parsed flags."""
    return PeakOptions(
        plan=args.plan,
        model=model_request(args),
        rank=args.rank,
        precision=args.precision,
        duplication=args.duplication,
        steps=args.steps,
        memory=args.memory,
        out=args.out,
    )


def run(args: argparse.Namespace) -> int:
    """``hidup peak`` (:func:`hidup.runtime.peak.run`)."""
    return peak.run(peak_options(args))
