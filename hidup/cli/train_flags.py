"""``hidup train``'s flags, and the :class:`hidup.runtime.train.TrainOptions` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from hidup.cli.launch_flags import add_launch_args, launch_options
from hidup.cli.model_flags import add_model_args, model_request
from hidup.cli.precision_flags import add_reduce_dtype_arg
from hidup.ir import OFFLOAD_CHOICES, ZERO_CHOICES
from hidup.profiler.profile import DTYPES
from hidup.runtime.options import DEFAULT_PROFILE
from hidup.runtime.train import TrainOptions

__all__ = ["add_train_args", "train_options"]


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The model flags, ``hidup train``'s own (group "training") and the launch flags."""
    add_model_args(p, world_default=None)
    g = p.add_argument_group("training")
    g.add_argument("--plan", type=Path, default=None, help="plan JSON from `hidup search` (default: search now)")
    g.add_argument("--profile", default=DEFAULT_PROFILE, help="profile used when searching on the spot")
    g.add_argument(
        "--duplication",
        choices=("auto", "plan", "on", "off"),
        default="auto",
        help="two half-batch copies per rank overlapping communication and compute: as the plan says, "
        "on, off, or auto (default): on GPUs with more than one rank, time a few steps of the plan "
        "with and without and keep the faster (the plan's choice unless the other wins by 2%%); "
        "elsewhere as the plan says",
    )
    g.add_argument("--no-duplication", action="store_true", help="the same as --duplication off")
    g.add_argument("--iterations", type=int, default=20, help="optimizer steps (default 20)")
    g.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (default 3)")
    g.add_argument("--last-k", type=int, default=10, help="report time over the last K steps (default 10)")
    g.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this value")
    g.add_argument(
        "--zero",
        choices=ZERO_CHOICES,
        default="auto",
        help="ZeRO for the weights the plan replicates: 1 keeps each rank's Adam state for 1/N of their "
        "rows only, 2 also reduce-scatters their gradients instead of all-reducing them; the updated rows "
        "are all-gathered after the optimizer (same results, less memory, one more all-gather). auto "
        "(default): as the plan says (with no --plan, as the search chooses), off: none",
    )
    g.add_argument(
        "--offload",
        choices=OFFLOAD_CHOICES,
        default="auto",
        help="keep Adam's state and a float32 copy of the weights in host memory, stepped by the CPU "
        "(torch's fused CPU Adam), the gradients copied there and the weights back each step (same results, "
        "less device memory, a slower step; not with --cuda-graphs on or --precision fp16). auto (default): "
        "as the plan says (with no --plan, as the search chooses), off, optimizer",
    )
    g.add_argument(
        "--precision", choices=DTYPES, default="fp32", help="fp32, tf32 matmuls, or bf16/fp16 autocast (default fp32)"
    )
    add_reduce_dtype_arg(g, train=True)
    g.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="capture each step's forward and backward as one CUDA graph (auto: on GPUs unless "
        "--precision fp16, whose loss scaler checks gradients on the host, and kept only "
        "when replaying beats eager steps in a short trial)",
    )
    g.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the rank program through torch.compile (inductor; collectives stay eager as opaque "
        "custom ops, duplication's stages are compiled one by one): on, off, or auto (default): on "
        "GPUs time a few steps both ways and keep the faster, on the CPU off. The compilation time "
        "is printed; torch's compile caches are used",
    )
    g.add_argument(
        "--data",
        choices=("synthetic", "stdlib"),
        default="synthetic",
        help="synthetic batches, or byte-level tokens of the Python standard library's source "
        "(language models; needs --vocab >= 256)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the weights, the data and dropout")
    g.add_argument(
        "--chrome-trace", type=Path, default=None, help="write a chrome trace of 3 steps per rank to this directory"
    )
    g.add_argument("--checkpoint-dir", type=Path, default=None, help="where checkpoints are written")
    g.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: only on signal)")
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=1,
        help="keep the last K checkpoints: the newest in <dir>/checkpoint, the older ones beside it as "
        "checkpoint.step-<N> (move one to checkpoint to resume from it); default 1",
    )
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh over the checkpoint already in --checkpoint-dir (without it, or --resume, a run "
        "that finds one there refuses to start)",
    )
    g.add_argument(
        "--stop-after", type=int, default=None, help="stop (as if interrupted) after this many steps of this invocation"
    )
    g.add_argument("--json", type=Path, default=None, help="write the run's results as JSON (rank 0)")
    add_launch_args(p)


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The :class:`TrainOptions` of parsed :func:`add_train_args` flags (``--no-duplication`` read as
    ``--duplication off``)."""
    return TrainOptions(
        model=model_request(args),
        plan=args.plan,
        profile=args.profile,
        duplication="off" if args.no_duplication else args.duplication,
        iterations=args.iterations,
        warmup=args.warmup,
        last_k=args.last_k,
        lr=args.lr,
        optimizer=args.optimizer,
        clip=args.clip,
        zero=args.zero,
        offload=args.offload,
        precision=args.precision,
        reduce_dtype=args.reduce_dtype,
        cuda_graphs=args.cuda_graphs,
        compile=args.compile,
        data=args.data,
        seed=args.seed,
        chrome_trace=args.chrome_trace,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        overwrite=args.overwrite,
        stop_after=args.stop_after,
        json=args.json,
        launch=launch_options(args),
    )
