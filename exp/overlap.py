"""Do the prefetched weight gathers of an FSDP-style plan overlap compute, eagerly and compiled?

On ``world`` ranks (torchrun; NCCL on GPUs, gloo with ``--device cpu``) a small ``transformers`` Llama
(:func:`exp.rank_models.llama`) gets an FSDP-style plan (every weight stored split and all-gathered for
its use, :func:`hidup.search.api.forced` ``"fsdp"``, duplication off).  Each rank program then runs
forward and backward (no optimizer) in every combination of ``--modes`` (``eager``; ``compile``:
inductor, or ``--backend``; ``compile+graph``: compiled and captured as one CUDA graph,
:func:`hidup.graphed_step`, which checks that torch's functional collectives capture) and prefetch
off/on, and for each

* ``step_ms``: the median of ``--steps`` timed steps after ``--warmup`` (device-synchronized);
* from a ``torch.profiler`` trace of ``--trace-steps`` steps (CUDA only): the all-gather kernels' time
  (``allgather_ms``, kernels whose name has ``AllGather``), the part of it during which a compute kernel
  (any kernel that is not NCCL's) runs on the device (``overlapped_ms``), and their ratio (``overlap``);
  with prefetch on, compiled, the gathers should overlap about as much as eagerly (the side stream),
  and with prefetch off hardly at all;
* ``predicted``: hidup's price of the plan in that mode (``compiled`` for the compiled modes) with prefetch
  off/on, with ``--profile`` (the step's forward, backward and total, ms).

Rank 0 writes everything to ``--out`` (JSON).  Usage (two GPUs, repository root):

    torchrun --nproc_per_node 2 exp/overlap.py --out overlap.json
    torchrun --nproc_per_node 2 exp/overlap.py --device cpu --backend aot_eager --layers 2 --hidden 64 \\
        --heads 4 --kv-heads 2 --ffn 128 --vocab 256 --seq 32 --batch 2 --precision fp32 --out o.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import hidup
import hidup.profiler
from exp.rank_models import llama
from hidup.codegen import GraphedStep
from hidup.search.api import forced, price


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--modes", default="eager,compile,compile+graph", help="comma-separated: eager, compile, compile+graph"
    )
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compile mode")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--profile", default="h200x4-nvlink", help="the profile the plan is searched and priced with")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--trace-dir", help="also write each run's trace there (Chrome trace JSON, rank 0)")
    return ap.parse_args(argv)


def _sizes(a: argparse.Namespace) -> dict:
    return dict(
        layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn, vocab=a.vocab,
        seq=a.seq, batch=a.batch,
    )  # fmt: skip


def _autocast(a: argparse.Namespace):
    on = a.precision == "bf16"
    return torch.autocast(a.device, dtype=torch.bfloat16, enabled=on)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _step(module, inputs, a) -> None:
    if isinstance(module, GraphedStep):  # forward and backward replayed as one CUDA graph
        module(*inputs)
        return
    with _autocast(a):
        loss = module(*inputs)
    loss.backward()
    module.zero_grad(set_to_none=True)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_of(kernels: list[tuple[str, float, float]]) -> dict:
    """From device kernels ``(name, start us, end us)``: the all-gather kernels' time, the part of it
    during which some compute (non-NCCL) kernel runs, and their ratio."""
    gathers = [(s, e) for n, s, e in kernels if "AllGather" in n]
    compute = _union([(s, e) for n, s, e in kernels if "nccl" not in n.lower()])
    total = sum(e - s for s, e in gathers)
    covered = 0.0
    for s, e in gathers:
        covered += sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in compute if cs < e and ce > s)
    return {
        "allgather_kernels": len(gathers),
        "allgather_ms": total / 1e3,
        "overlapped_ms": covered / 1e3,
        "overlap": covered / total if total else None,
    }


def _trace(module, inputs, a, device, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.trace_steps):
            _step(module, inputs, a)
        _sync(device)
    if a.trace_dir and dist.get_rank() == 0:
        os.makedirs(a.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(a.trace_dir, f"{name}.json"))
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return overlap_of(kernels)


def _run(mode: str, prefetch: bool, plan, rank: int, world: int, device: torch.device, a) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    model, inputs = llama(world_size=world, device=device, **_sizes(a))
    compiled = a.backend if mode.startswith("compile") else False
    module = hidup.compile(model, plan, rank, world, inputs, compile=compiled, prefetch=prefetch, duplication=False)
    if mode.endswith("+graph"):
        dtype = torch.bfloat16 if a.precision == "bf16" else None
        module = hidup.graphed_step(module, inputs, autocast_dtype=dtype, enabled=device.type == "cuda")
    for _ in range(a.warmup):
        _step(module, inputs, a)
    times = []
    for _ in range(a.steps):
        _sync(device)
        start = time.perf_counter()
        _step(module, inputs, a)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    out = {"mode": mode, "prefetch": prefetch, "step_ms": statistics.median(times), "steps_ms": times}
    if device.type == "cuda" and a.trace_steps > 0:
        out.update(_trace(module, inputs, a, device, f"{mode}-prefetch-{'on' if prefetch else 'off'}"))
    del module, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    a = _args(argv)
    warnings.simplefilter("ignore")
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    profile = hidup.profiler.load(a.profile)
    meta, meta_inputs = llama(world_size=world, device="meta", **_sizes(a))
    graph = hidup.trace(meta, meta_inputs, world_size=world)
    plan = forced(graph, profile, "fsdp", duplication=False, precision=a.precision)
    results = {"config": {**_sizes(a), "world": world, "precision": a.precision, "backend": a.backend}, "runs": []}
    results["torch"] = torch.__version__
    results["predicted"] = {}
    for mode in a.modes.split(","):
        for prefetch in (False, True):
            compiled = mode.startswith("compile")
            priced = price(graph, profile, plan, a.precision, False, compiled, prefetch)[False]
            times = priced.times()
            results["predicted"][f"{mode}-prefetch-{'on' if prefetch else 'off'}"] = {
                k: times[k] * 1e3 for k in ("forward", "backward", "total")
            }
            results["runs"].append(_run(mode, prefetch, plan, rank, world, device, a))
            if rank == 0:
                print(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "steps_ms"}), flush=True)
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
