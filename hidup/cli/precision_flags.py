"""``--reduce-dtype``: the dtype the weights' gradients are summed over ranks in (:mod:`hidup.precision`),
a flag of ``hidup search`` and ``hidup train``."""

from __future__ import annotations

import argparse

from hidup.precision import REDUCE_DTYPES

__all__ = ["add_reduce_dtype_arg", "REDUCE_CHOICES"]

# hidup train's choices: the plan's (auto), or one of the dtypes
REDUCE_CHOICES = ("auto", *REDUCE_DTYPES)

_HELP = (
    "the dtype each float32 weight's gradient is summed over ranks in (all-reduces, reduce-scatters): "
    "fp32, or bf16 (cast to bf16 before each sum and back after it: half the bytes on the wire, a bf16 "
    "rounding of each sum; FSDP2's reduce_dtype=bf16); bf16 needs --precision bf16 and applies while "
    "autocast is on"
)


def add_reduce_dtype_arg(p: argparse.ArgumentParser, train: bool = False) -> None:
    """``--reduce-dtype``: for ``hidup search`` one of :data:`hidup.precision.REDUCE_DTYPES` (default
    fp32); for ``hidup train`` (``train``) also ``auto``, the plan's (default)."""
    if train:
        p.add_argument(
            "--reduce-dtype",
            choices=REDUCE_CHOICES,
            default="auto",
            help=_HELP + ". auto (default): as the plan says (with no --plan, fp32)",
        )
    else:
        p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default="fp32", help=_HELP + " (default fp32)")
