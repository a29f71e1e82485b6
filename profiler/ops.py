"""Per-op forward and backward times at the local (sharded) shapes a signature gives each rank.

For a ``call`` node ``n`` under signature ``s`` rank 0 runs ``hidup.rules.localize(ctx, s, 0)``
on inputs of the local shapes ``f_i.local_shape(shape_i, N)`` (``f_i = s.inputs[i]``).  We build
random inputs of those shapes (integer inputs are zeros: a valid index for embeddings, targets and
gathers), then time

    t_f  = median time of the local forward
    t_fb = median time of forward + backward (``autograd.grad`` of every floating output against a
           random output gradient, with respect to every floating input that requires a gradient)
    t_b  = max(t_fb - t_f, 0)

and store ``(t_f, t_b)`` under ``op_key(n.target, local input shapes, dtype of n's first output)``,
the key the cost model looks up.  Identical keys (repeated layers, signatures with equal local
shapes) are measured once.  An op whose first forward takes more than ``max_op_s`` is skipped, and
measuring stops after ``total_s`` seconds; the cost model prices whatever is missing from FLOPs.
Leaf modules (``call_module`` nodes) are not timed: their weights live in the module.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Mapping

import torch
from torch.fx.node import map_aggregate

from hidup.ir import Graph, Signature

from .device import time_call

__all__ = ["time_ops", "profile_ops", "node_signatures"]


def node_signatures(graph: Graph, plan: Any = None) -> list[tuple[str, Signature]]:
    """(node name, signature) pairs to time.

    ``plan`` may be ``None`` (every signature of every call node: what a search may choose from),
    a mapping node name -> :class:`Signature`, a :class:`hidup.plan.Plan` (its ``.choices``), or an
    iterable of (name, signature) pairs.
    """
    if plan is None:
        return [(n.name, s) for n in graph.nodes if n.op == "call" for s in n.signatures]
    chosen = getattr(plan, "choices", plan)
    if isinstance(chosen, Mapping):
        pairs = list(chosen.items())
    else:
        pairs = list(chosen)
    out = []
    for name, sig in pairs:
        if isinstance(sig, dict):
            sig = Signature.from_dict(sig)
        if not isinstance(sig, Signature):
            raise TypeError(f"node {name!r}: expected a hidup.ir.Signature (or its dict), got {type(sig).__name__}")
        if graph.node(name).op == "call":
            out.append((name, sig))
    return out


def _make_input(meta, shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        if meta.requires_grad:
            t.requires_grad_(True)
        return t
    return torch.zeros(shape, dtype=dtype, device=device)


def _bind(call, ctx, tensors: list[torch.Tensor]):
    """Replace the TensorMeta placeholders of a LocalCall by ``tensors`` (map_aggregate order)."""
    from hidup.rules.base import TensorMeta

    it = iter(tensors)
    count = 0

    def sub(v):
        nonlocal count
        if isinstance(v, TensorMeta):
            count += 1
            return next(it)
        return v

    args = map_aggregate(tuple(call.args), sub)
    kwargs = map_aggregate(dict(call.kwargs), sub)
    if count != len(tensors):
        raise ValueError(f"node {ctx.node_name}: its local call has {count} tensor arguments but the node "
                         f"has {len(tensors)} tensor inputs")
    target = call.target
    if isinstance(target, str):  # a method name: call it on the first argument
        return lambda: getattr(args[0], target)(*args[1:], **kwargs)
    return lambda: target(*args, **kwargs)


def _flat_tensors(value) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def time_ops(traced, plan: Any = None, *, device: torch.device | str = "cpu", budget_s: float = 0.05,
             max_op_s: float = 0.5, total_s: float = 60.0, warmup: int = 1, cache: dict | None = None,
             seed: int = 0) -> dict[str, tuple[float, float]]:
    """Measured ``{op_key: (forward s, backward s)}`` for the call nodes of ``traced``
    (a :class:`hidup.trace.Traced`) under ``plan`` (see :func:`node_signatures`).

    ``cache`` (a dict) carries measurements across calls; keys already in it are not re-measured.
    """
    import hidup.rules as rules
    from hidup.profiler.profile import op_key

    device = torch.device(device)
    graph: Graph = traced.graph
    world = graph.world_size
    cache = {} if cache is None else cache
    skipped: dict[str, str] = {}
    gen = torch.Generator().manual_seed(seed)
    t_end = time.perf_counter() + total_s
    for name, sig in node_signatures(graph, plan):
        if time.perf_counter() > t_end:
            break
        node = graph.node(name)
        ctx = traced.contexts.get(name)
        if ctx is None or ctx.module is not None:
            continue  # no context recorded, or a leaf module
        try:
            shapes = [f.local_shape(graph.tensors[t].shape, world) for t, f in zip(node.inputs, sig.inputs)]
        except ValueError:
            continue
        dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
        key = op_key(node.target, shapes, dtype)
        if key in cache or key in skipped:
            continue
        try:
            measured = _time_one(rules, ctx, sig, shapes, device, gen, budget_s, max_op_s, warmup)
        except Exception as e:  # an op that cannot run on synthetic inputs is priced from FLOPs
            measured = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if isinstance(measured, tuple):
            cache[key] = measured
        else:
            skipped[key] = f"{name} ({measured})"
    if skipped:
        warnings.warn(f"hidup.profiler.ops: {len(skipped)} op(s) not timed, the cost model prices them from "
                      f"FLOPs: " + "; ".join(list(skipped.values())[:10]) + (" ..." if len(skipped) > 10 else ""),
                      stacklevel=2)
    return cache


def _time_one(rules, ctx, sig, shapes, device, gen, budget_s, max_op_s, warmup):
    """``(forward s, backward s)``, or a string saying why the op was not timed."""
    call = rules.localize(ctx, sig, 0)
    inputs = [_make_input(m, s, device, gen) for m, s in zip(ctx.inputs, shapes)]
    fn = _bind(call, ctx, inputs)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = time.perf_counter() - t0
    if first > max_op_s:
        return f"one forward took {first:.2f} s > max_op_s={max_op_s} s"
    fwd = time_call(fn, device, warmup=warmup, budget_s=budget_s, sample_s=budget_s / 4)
    wrt = [t for t in inputs if t.requires_grad]
    outs = [o for o in _flat_tensors(out) if o.requires_grad and o.is_floating_point()]
    if not wrt or not outs:
        return fwd, 0.0
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=o.dtype)
             for o in outs]

    def fwd_bwd():
        res = [o for o in _flat_tensors(fn()) if o.requires_grad and o.is_floating_point()]
        torch.autograd.grad(res, wrt, grads, allow_unused=True)

    both = time_call(fwd_bwd, device, warmup=warmup, budget_s=2 * budget_s, sample_s=budget_s / 2)
    return fwd, max(both - fwd, 0.0)


def profile_ops(profile, model: torch.nn.Module, example_inputs, world_size: int, plan: Any = None, *,
                device: torch.device | str = "cpu", **kwargs):
    """``profile`` plus the per-op times of ``model`` traced for ``world_size`` ranks (see
    :func:`time_ops`; ``example_inputs`` may live on ``meta``)."""
    from hidup.trace import trace_module

    traced = trace_module(model, example_inputs, world_size)
    ops = time_ops(traced, plan, device=device, cache=dict(profile.ops), **kwargs)
    return profile.with_ops(ops)
