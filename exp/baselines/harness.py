"""Baseline harness: one train loop for DDP, FSDP2, expert parallelism and the single-device floor.

Every baseline trains the same zoo model (``hidup.models.build``, same seed, same synthetic batch,
reused every step), with Adam, for ``warmup`` untimed then ``iters`` timed iterations.  Rank ``r``
of ``N`` runs groups ``r B/N .. (r+1) B/N - 1`` of the global batch ``B = batch_per_gpu * N``.

Per iteration ``i`` each rank measures ``t_r(i)`` between device synchronizations around
``zero_grad -> forward -> backward -> gradient glue -> optimizer step``; the iteration time is
``t(i) = max_r t_r(i)`` and the reported time the median over timed iterations.  Throughput:

    tokens/s  = B * tokens_per_group / median_i t(i)        (single: batch_per_gpu groups)
    samples/s = B / median_i t(i)

The loss of step ``i`` is the global loss ``L(i) = sum_r L_r(i)`` (the zoo's loss is a sum over
groups), equal to the single-device loss of the whole batch.  Peak memory is the maximum over
ranks of ``torch.cuda.max_memory_allocated`` (``None`` on a CPU).

Command line (spawns the ranks on this host; or use torchrun / NODERANK+CPN)::

    python exp/baselines/harness.py --baseline ddp --model bert-sgmoe --world 2 --layers 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hidup.runtime.data import rank_share

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BASELINES = ("ddp", "fsdp", "expert", "single")
PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass
class RunSpec:
    """What to run; identical on every rank."""

    baseline: str
    model: str = "bert-sgmoe"
    world: int = 2
    overrides: dict = field(default_factory=dict)
    warmup: int = 3
    iters: int = 10
    lr: float = 1e-4
    seed: int = 0
    precision: str = "fp32"

    def __post_init__(self):
        if self.baseline not in BASELINES:
            raise ValueError(f"unknown baseline {self.baseline!r}; choose one of {', '.join(BASELINES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.world < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need world >= 1, iters >= 1, warmup >= 0; got world={self.world}, "
                             f"iters={self.iters}, warmup={self.warmup}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(precision: str, device: torch.device):
    """bf16 autocast for ``precision == "bf16"``; fp32 and tf32 run without autocast."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def autocast_dtype(precision: str):
    """The autocast dtype of ``precision`` (None: no autocast)."""
    return torch.bfloat16 if precision == "bf16" else None


def train_step(prepared, optimizer, inputs: tuple, precision: str, device: torch.device) -> torch.Tensor:
    """One optimizer step of a prepared baseline; returns the (local) loss, detached, as float32.

    A prepared run with a captured step (``prepared.graphed``, a :class:`hidup.codegen.GraphedStep`)
    replays it for the forward and backward (it overwrites the gradients itself)."""
    graphed = getattr(prepared, "graphed", None)
    if graphed is not None:
        loss = graphed(*inputs)
        if prepared.after_backward is not None:
            prepared.after_backward()
        optimizer.step()
        return loss.float()
    optimizer.zero_grad(set_to_none=True)
    with autocast(precision, device):
        loss = prepared.module(*inputs)
    (loss * prepared.loss_scale if prepared.loss_scale != 1.0 else loss).backward()
    if prepared.after_backward is not None:
        prepared.after_backward()
    optimizer.step()
    return loss.detach().float()


def train_loop(prepared, inputs: tuple, spec: RunSpec, device: torch.device):
    """Run ``warmup + iters`` Adam steps; return (losses per step (local), times per step, peak bytes)."""
    module = prepared.module
    optimizer = torch.optim.Adam(module.parameters(), lr=spec.lr)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = spec.precision == "tf32"
    losses, times = [], []
    try:
        for i in range(spec.warmup + spec.iters):
            if i == spec.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            loss = train_step(prepared, optimizer, inputs, spec.precision, device)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return torch.stack(losses), times, peak


def run_rank(rank: int, world: int, device: torch.device, spec: RunSpec) -> dict:
    """One rank's part of a baseline run (inside an initialized process group unless ``single``)."""
    import hidup.models

    module_name = spec.baseline
    baseline = importlib.import_module(module_name)
    model, inputs = hidup.models.build(spec.model, world_size=spec.world, seed=spec.seed, **spec.overrides)
    cfg = model.config
    if spec.baseline == "single":
        rank, world = 0, 1
        inputs = rank_share(inputs, 0, spec.world)
    else:
        if world != spec.world:
            raise ValueError(f"the process group has {world} ranks but the run asks for world={spec.world}")
        inputs = rank_share(inputs, rank, world)
    inputs = tuple(t.to(device) for t in inputs)
    torch.manual_seed(spec.seed + 17 + rank)  # dropout streams, if the config enables dropout
    prepared = baseline.prepare(model, rank, world, device)
    losses, times, peak = train_loop(prepared, inputs, spec, device)
    distributed = spec.baseline != "single" and dist.is_initialized() and world > 1
    times_t = torch.tensor(times, dtype=torch.float64, device=device)
    peak_t = torch.tensor([float(peak or 0)], dtype=torch.float64, device=device)
    losses = losses.to(device=device, dtype=torch.float64)
    if distributed:
        dist.all_reduce(times_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(losses)
    step_times = times_t.tolist()[spec.warmup:]
    median = statistics.median(step_times)
    groups = inputs[0].shape[0] * (world if spec.baseline != "single" else 1)
    tokens_per_group = cfg.tokens_per_group if cfg.family != "mlp" else 1
    return {
        "baseline": spec.baseline, "model": spec.model, "world": spec.world,
        "gpus_used": 1 if spec.baseline == "single" else world,
        "config": cfg.to_dict(), "precision": spec.precision, "lr": spec.lr, "seed": spec.seed,
        "device": str(device), "backend": dist.get_backend() if distributed else "none",
        "torch": torch.__version__, "warmup": spec.warmup, "iters": spec.iters,
        "iter_time_s": median, "iter_times_s": step_times,
        "samples_per_s": groups / median, "tokens_per_s": groups * tokens_per_group / median,
        "peak_memory_bytes": int(peak_t.item()) if peak is not None else None,
        "losses": losses.tolist(), **{f"info_{k}": v for k, v in prepared.info.items()},
    }


def _launched(ctx, spec: RunSpec) -> dict | None:
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.layout.cpn)))
    result = run_rank(ctx.rank, ctx.world_size, ctx.device, spec)
    return result if ctx.rank == 0 else None


def run(spec: RunSpec, **launch_kwargs) -> dict | None:
    """Start the ranks of ``spec`` and return global rank 0's result (``None`` on other hosts).

    Ranks come from :func:`hidup.runtime.launch.launch`: torchrun's environment or
    ``NODERANK``/``CPN``/``NNODES`` when set (their world must equal ``spec.world``), else
    ``spec.world`` processes on this host; ``single`` always runs in this process.
    ``launch_kwargs`` are :func:`hidup.runtime.launch.launch`'s (``cpn``, ``master_port``, ...).
    """
    from hidup.runtime.launch import launch, layout_from_env

    if spec.baseline == "single":
        results = launch(_launched, spec, env={})
    else:
        kw = {k: v for k, v in launch_kwargs.items() if v is not None}
        layout = layout_from_env(**{k: kw[k] for k in ("nnodes", "cpn", "node_rank", "master_addr", "master_port")
                                    if k in kw})
        if layout.source == "single":  # nothing set: all ranks on this host
            from torch.distributed.elastic.utils.distributed import get_free_port

            kw.setdefault("cpn", spec.world)
            kw.setdefault("master_port", get_free_port())
            layout = layout_from_env(**{k: kw[k] for k in ("nnodes", "cpn", "node_rank", "master_addr",
                                                          "master_port") if k in kw})
        if layout.world_size != spec.world:
            raise ValueError(f"the launch gives {layout.world_size} ranks ({layout.source}: NNODES x CPN or "
                             f"WORLD_SIZE) but --world is {spec.world}; make them agree")
        results = launch(_launched, spec, **kw)
    return next((r for r in results if r is not None), None)


def _parser() -> argparse.ArgumentParser:
    from hidup.cli import add_model_args

    p = argparse.ArgumentParser(description="Run one training baseline (DDP, FSDP2, expert "
                                "parallelism, or one GPU's share) and print its timing as JSON.")
    p.add_argument("--baseline", choices=BASELINES, required=True)
    add_model_args(p, world_default=2)
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the model's)")
    p.add_argument("--aux-weight", type=float, default=None, help="MoE balance-loss weight")
    p.add_argument("--out", type=Path, default=None, help="append the result as one JSON line to this file")
    from hidup.runtime.launch import add_launch_args

    add_launch_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from hidup.cli import apply_config_file, model_overrides, settle_model

    p = _parser()
    args = apply_config_file(p, list(sys.argv[1:] if argv is None else argv))
    settle_model(args)  # the default model and world when not given
    overrides = model_overrides(args)
    for key in ("dropout", "aux_weight"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    spec = RunSpec(args.baseline, args.model, args.world, overrides, args.warmup, args.iters, args.lr,
                   args.seed, args.precision)
    from hidup.runtime.launch import launch_kwargs

    result = run(spec, **launch_kwargs(args))
    if result is None:
        return 0
    line = json.dumps(result)
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    brief = {k: result[k] for k in ("baseline", "model", "world", "iter_time_s", "tokens_per_s",
                                    "peak_memory_bytes")}
    brief["loss_first"], brief["loss_last"] = result["losses"][0], result["losses"][-1]
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
