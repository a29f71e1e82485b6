"""The opaque ops of rank plans timed on a GPU and kept in a copy of the profile.

An opaque op is a ``torch.library`` custom op outside ATen (``hidup::moe_gating``, a model's own
routing): :mod:`hidup.rules.leaf` shards it along the batch, and inductor cannot look into it, so a
compiled rank program runs it as its own eager kernels -- for the MoE gating a softmax, an argmax,
a cumsum, a dozen small reductions and elementwise ops forward, the gating again with its autograd
backward -- each a kernel of a few microseconds in the step's CUDA graph.  The cost model has no
rate for such an op (it prices it by its bytes, :meth:`hidup.search.cost.CostModel.device_compute`),
but it prices a node at its measured time wherever the profile has one
(:meth:`~hidup.search.cost.CostModel.measured`).  This script times every opaque op of each plan's
rank 0 at its local shapes, as ``hidup profile --ops-model`` times ops (:func:`hidup.profiler.measure.ops.time_ops`:
forward, and forward plus backward, each replayed in a CUDA graph, at each precision), and writes
``--profile`` with those times added to its ``ops`` (timed ``graph``) to ``--out``, so that the
cost model prices the plans' opaque ops at their measured times; it prints each op's measured
against its priced time.

    python exp/op_check.py exp/records/predict/rank-plans-9/*.json --profile h200-points.json \\
        --precisions tf32,bf16 --out h200-ops.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hidup.profiler
from exp.rank_predict import built, parsed_on_gpu, plan_file_arguments
from hidup.frontend.trace import trace_module
from hidup.plan import Plan
from hidup.profiler.measure.ops import node_op_key, time_ops
from hidup.search.api import plan_indices
from hidup.search.problem import Problem

ATEN_NAMESPACES = frozenset({"aten", "prims"})


def is_opaque(target) -> bool:
    """Whether an fx target is a ``torch.library`` custom op outside ATen (module docstring)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ATEN_NAMESPACES


def opaque_choices(path: str, device: str | None):
    """The plan's traced model (:class:`hidup.frontend.trace.Traced`, rank programs' shapes) and its
    ``[(node name, signature)]`` of opaque ops."""
    plan = Plan.load(path)
    source = plan.model_source or {}
    model, inputs = built(source["model"], source.get("args", {}), plan.world_size, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_module(model, inputs, plan.world_size)
    choices = [
        (name, sig)
        for name, sig in plan.choices.items()
        if name in traced.contexts and is_opaque(traced.contexts[name].target)
    ]
    return traced, plan, choices


def time_opaque_ops(
    paths: list[str],
    profile,
    precisions: list[str],
    device: str | None,
    timing_device: str = "cuda",
    compiled: bool = False,
) -> dict[str, tuple[float, float]]:
    """``{op_key: (forward s, backward s)}`` of the opaque ops of the plan files ``paths`` at each of
    ``precisions``, timed on ``timing_device`` (:func:`hidup.profiler.measure.ops.time_ops`); prints each
    against the cost model's price under ``profile``."""
    timed: dict[str, tuple[float, float]] = {}
    for path in paths:
        traced, plan, choices = opaque_choices(path, device)
        if not choices:
            print(f"{Path(path).stem}: no opaque op")
            continue
        graph = traced.graph
        for precision in precisions:
            time_ops(traced, choices, device=timing_device, precision=precision, cache=timed, compiled=compiled)
            problem = Problem(graph, profile.launched(True, True), precision)
            ks = plan_indices(problem, plan)
            index = {n.name: i for i, n in enumerate(problem.order)}
            for name, sig in choices:
                node = graph.node(name)
                key = node_op_key(graph, node, sig, precision)
                i = index[name]
                priced = problem.cost.device_compute(node, problem.sigs[i][ks[i]])
                got = timed.get(key)
                measured = "not timed" if got is None else f"measured {got[0] * 1e3:.3f} / {got[1] * 1e3:.3f} ms"
                print(
                    f"{Path(path).stem:24s} {precision:5s} {name:16s} {key}: priced "
                    f"{priced[0] * 1e3:.3f} / {priced[1] * 1e3:.3f} ms (forward / backward), {measured}",
                    flush=True,
                )
    return timed


def with_ops(profile, timed: dict[str, tuple[float, float]], note: str):
    """A copy of ``profile`` with the op times ``timed`` (timed in a CUDA graph) added to its ``ops``."""
    data = profile.to_dict()
    data["ops"] = {**data.get("ops", {}), **{k: {"forward": f, "backward": b} for k, (f, b) in sorted(timed.items())}}
    data["ops_timing"] = "graph"
    data["notes"] = (data.get("notes") or "") + note
    return hidup.profiler.Profile.from_dict(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    plan_file_arguments(p, "the GPU's profile (builtin name or JSON)")
    p.add_argument("--out", required=True, help="write --profile with the opaque ops' times here")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="time a local call that is Python math (the routed experts') compiled by inductor, as compiled "
        "rank programs run it (a profile for predicting compile modes)",
    )
    args = parsed_on_gpu(p, argv, "op_check")
    if args is None:
        return 2
    profile = hidup.profiler.load(args.profile)
    if profile.ops and profile.ops_timing != "graph":
        print(f"op_check: {args.profile} holds ops timed {profile.ops_timing}, not in a CUDA graph", file=sys.stderr)
        return 2
    timed = time_opaque_ops(args.plans, profile, args.precisions.split(","), args.device, compiled=args.compiled)
    out = with_ops(profile, timed, f" Opaque ops of {len(args.plans)} plans (exp/op_check.py).")
    Path(args.out).write_text(json.dumps(out.to_dict(), indent=1))
    print(f"wrote {args.out}: {len(timed)} op times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
