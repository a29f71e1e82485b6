"""The GEMMs of rank plans, each timed alone on a GPU against the rate the cost model prices it at.

For every matmul the cost model prices by its shape in a plan's rank program, its three GEMMs as the
cost model prices them (:meth:`hidup.search.cost.CostModel.gemms`) -- for a linear layer the forward
``Y = X W^T`` (``(m, n, k)``, layout ``nt``: the weight read transposed), the input's gradient
``dX = dY W`` (``(m, k, n)``, ``nn``) and the weight's gradient ``dW = dY^T X`` (``(n, k, m)``,
``tn``) -- are timed alone on the GPU, each twice:

* ``warm``: the same operands every call, so that operands which fit the L2 cache stay there (as
  ``hidup profile``'s GEMM grid times them);
* ``cold``: the operands taken in turn from enough copies to exceed the L2 cache several times, so
  that every call reads them from memory, as a GEMM inside a training step mostly does.

Each is compared with the profile's price, ``2 m n k / rate(dtype, m, n, k, layout)``; totals are
weighted by how often each GEMM runs in the step.  This tells whether the GEMMs of a compiled rank
program run below the grid because of their layout, because of a cold cache, or for another reason
(the program then runs its GEMMs slower than all three timings).

With ``--points PROFILE`` every GEMM is also timed as the profile's GEMM grid times its points (its
kernels replayed in a CUDA graph, :func:`hidup.profiler.measure.device.gemm_point_seconds`; the timings
above are eager, and a small GEMM's is then its launch), together with the padded shape of every
GEMM whose dims are not multiples of 16 bytes (the GEMM inductor may run instead,
:meth:`hidup.search.cost.CostModel.gemm_seconds`), and kept as the grid's measured points
(:mod:`hidup.profiler.gemm`, "Measured shapes") in a copy of ``--profile`` written to ``PROFILE``, so
that the cost model prices the plans' GEMMs at their measured times.

    python exp/gemm_check.py exp/records/predict/rank-plans/*-data.json --profile h100.json \\
        --precisions tf32,bf16 --out gemms.json [--points h100-points.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hidup.profiler
from exp.rank_predict import _graph, parsed_on_gpu, plan_file_arguments
from hidup.codegen.timing import time_call
from hidup.plan import Plan
from hidup.profiler.measure.device import gemm_point_seconds
from hidup.search.api import plan_indices
from hidup.search.cost import padded_gemm, profile_dtype
from hidup.search.problem import Problem

L2_SPAN = 4 * 64 * 2**20  # bytes of operand copies cycled through for a cold-cache timing: 4x a 64 MB L2
ROLES = ("forward", "input-grad", "weight-grad")


def plan_gemms(path: str, profile, precision: str, device: str | None) -> Counter:
    """``{(role, m, n, k, layout, rate dtype): calls per step}`` of the GEMMs of the plan's shape-priced
    matmuls, as the cost model prices them (:meth:`hidup.search.cost.CostModel.gemms`)."""
    plan = Plan.load(path)
    source = plan.model_source or {}
    graph = _graph(source["model"], source.get("args", {}), plan.world_size, device)
    problem = Problem(graph, profile.launched(True, True), precision)
    ks = plan_indices(problem, plan)
    cost, found = problem.cost, Counter()
    for i, (node, k) in enumerate(zip(problem.order, ks)):
        if node.op != "call":
            continue
        gemms = cost.gemms(node, cost._local_shapes(graph, node, problem.sigs[i][k]))
        dtype = profile_dtype(graph.tensors[node.outputs[0]].dtype, precision)
        for role, dims, layout, grad_of in gemms or ():
            if grad_of is None or graph.tensors[grad_of].requires_grad:
                found[(role, *dims, layout, dtype)] += 1
    return found


def timed(layout: str, m: int, n: int, k: int, dtype: str, cold: bool) -> float:
    """Seconds per call of the GEMM ``(m, n, k)`` in ``layout`` (module docstring), its operands stored
    as :func:`hidup.profiler.measure.device.gemm_grid` stores them."""
    storage = torch.float32 if dtype in ("fp32", "tf32") else torch.bfloat16
    if layout == "nt":
        shapes = ((m, k), (n, k))

        def op(a, b, out):
            return torch.mm(a, b.t(), out=out)
    elif layout == "nn":
        shapes = ((m, k), (k, n))

        def op(a, b, out):
            return torch.mm(a, b, out=out)
    else:
        shapes = ((k, m), (k, n))

        def op(a, b, out):
            return torch.mm(a.t(), b, out=out)

    size = (sum(r * c for r, c in shapes) + m * n) * storage.itemsize
    copies = max(1, -(-L2_SPAN // size)) if cold else 1
    operands = [[torch.randn(s, device="cuda").to(storage) for s in shapes] for _ in range(copies)]
    outs = [torch.empty(m, n, device="cuda", dtype=storage) for _ in range(copies)]
    turn = [0]

    def call():
        i = turn[0] = (turn[0] + 1) % copies
        op(*operands[i], outs[i])

    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    return time_call(call, "cuda", warmup=3, sample_s=0.005, budget_s=0.05)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    plan_file_arguments(p, "the GPU's profile, with a GEMM grid")
    p.add_argument("--out", default=None)
    p.add_argument("--points", default=None, help="write --profile with the cold timings as GEMM grid points here")
    args = parsed_on_gpu(p, argv, "gemm_check")
    if args is None:
        return 2
    profile = hidup.profiler.load(args.profile)
    results = []
    points: dict[str, dict[tuple, float]] = {}  # dtype -> (layout, m, n, k) -> FLOP/s, cold
    for path in args.plans:
        for precision in args.precisions.split(","):
            gemms = plan_gemms(path, profile, precision, args.device)
            totals = Counter()
            for (role, m, n, k, layout, dtype), calls in sorted(gemms.items()):
                grid = profile.gemm.get(dtype)
                priced = 2.0 * m * n * k / grid.rate(m, n, k, layout) if grid else float("nan")
                warm, cold = (timed(layout, m, n, k, dtype, c) for c in (False, True))
                row = dict(
                    plan=Path(path).stem, precision=precision, role=role, layout=layout, m=m, n=n, k=k, dtype=dtype
                )
                row.update(calls=calls, priced_ms=priced * 1e3, warm_ms=warm * 1e3, cold_ms=cold * 1e3)
                results.append(row)
                for dims in {(m, n, k), padded_gemm((m, n, k), dtype)}:
                    if args.points and (layout, *dims) not in points.setdefault(dtype, {}):
                        seconds = gemm_point_seconds("cuda", dtype, layout, *dims)
                        points[dtype][(layout, *dims)] = 2.0 * math.prod(dims) / seconds
                totals.update({"priced": calls * priced, "warm": calls * warm, "cold": calls * cold})
                totals.update({f"{role}-priced": calls * priced, f"{role}-cold": calls * cold})
                print(
                    f"{row['plan']:24s} {precision:5s} {role:12s} {layout} {m:6d} {n:6d} {k:6d} x{calls:<3d} "
                    f"priced {priced * 1e3:7.3f} warm {warm * 1e3:7.3f} cold {cold * 1e3:7.3f} ms",
                    flush=True,
                )
            line = " ".join(f"{key} {v * 1e3:.2f}" for key, v in sorted(totals.items()))
            print(f"== {Path(path).stem} {precision} total ms: {line}", flush=True)
            totals_ms = {key: v * 1e3 for key, v in totals.items()}
            results.append(dict(plan=Path(path).stem, precision=precision, totals_ms=totals_ms))
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": profile.name, "gemms": results}, indent=1))
    if args.points:
        data = profile.to_dict()
        for dtype, measured in points.items():
            if dtype in profile.gemm:
                grid = profile.gemm[dtype].with_points([(*key, rate) for key, rate in measured.items()])
                data["gemm"][dtype] = grid.to_dict()
        data["notes"] = (data.get("notes") or "") + f" GEMM points of {len(args.plans)} plans (exp/gemm_check.py)."
        Path(args.points).write_text(json.dumps(hidup.profiler.Profile.from_dict(data).to_dict(), indent=1))
        print(f"wrote {args.points}: {sum(len(v) for v in points.values())} GEMM points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
