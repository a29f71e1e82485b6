"""``hidup bench-rank``'s parser, and the :class:`hidup.runtime.bench_rank.BenchRankOptions` its
flags make."""

from __future__ import annotations

import argparse
from pathlib import Path

from hidup.cli.model_flags import add_model_args, model_request
from hidup.runtime import bench_rank
from hidup.runtime.bench_rank import MODES, PRECISIONS, BenchRankOptions
from hidup.runtime.options import DEFAULT_PROFILE

__all__ = ["add_flags", "bench_rank_options", "run"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """``hidup bench-rank``'s description and flags on its parser ``p``."""
    p.description = bench_rank.__doc__.split("\n\n")[0]
    add_model_args(p, world_default=None)
    g = p.add_argument_group("bench")
    g.add_argument("--plan", type=Path, default=None, help="plan JSON (default: search one now for --model/--world)")
    g.add_argument("--profile", default=DEFAULT_PROFILE, help="profile for a plan searched now")
    g.add_argument("--rank", type=int, default=0, help="which rank's program to run (default 0)")
    g.add_argument(
        "--duplication",
        choices=("plan", "on", "off"),
        default="plan",
        help="two half-batch copies as the plan says (default), or forced on/off",
    )
    g.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, of {', '.join(MODES)} (default: all on CUDA, eager,compile on the CPU)",
    )
    g.add_argument(
        "--precisions",
        default=None,
        help=f"comma-separated, of {', '.join(PRECISIONS)} (default: tf32,bf16 on CUDA, fp32 on the CPU)",
    )
    g.add_argument(
        "--share-modes",
        default=None,
        help="modes of the single-device share (default compile+graph on CUDA, compile on the CPU; 'none' skips it)",
    )
    g.add_argument(
        "--share-experts",
        default=None,
        help="comma-separated transformers experts implementations to time the share with, one row each, "
        "each NAME or NAME=MODE to time it in that mode alone (e.g. grouped_mm=compile,hidup_grouped; "
        "default: as the model was built)",
    )
    g.add_argument(
        "--torch-modes",
        default="none",
        help="modes of the rank's eager module under plain torch.compile, rows 'torch' (default none; "
        "e.g. compile+graph)",
    )
    g.add_argument(
        "--backend", default="inductor", help="torch.compile backend of the compile modes (default inductor)"
    )
    g.add_argument("--steps", type=int, default=20, help="steps per timed round (default 20)")
    g.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps before a mode is timed (default 3)")
    g.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    g.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default cuda when available)")
    g.add_argument(
        "--kernels",
        action="store_true",
        help="also record each run's device time per step by kernel kind (matmul, attention, generated, "
        "optimizer, copies, other) and of every kernel by name, from torch.profiler over steps run without "
        "a CUDA graph",
    )
    g.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def bench_rank_options(args: argparse.Namespace) -> BenchRankOptions:
    """The :class:`BenchRankOptions` of the parsed flags."""
    return BenchRankOptions(
        model=model_request(args),
        plan=args.plan,
        profile=args.profile,
        rank=args.rank,
        duplication=args.duplication,
        modes=args.modes,
        precisions=args.precisions,
        share_modes=args.share_modes,
        share_experts=args.share_experts,
        torch_modes=args.torch_modes,
        backend=args.backend,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        lr=args.lr,
        device=args.device,
        kernels=args.kernels,
        out=args.out,
    )


def run(args: argparse.Namespace) -> int:
    """``hidup bench-rank`` (:func:`hidup.runtime.bench_rank.run`)."""
    return bench_rank.run(bench_rank_options(args))
