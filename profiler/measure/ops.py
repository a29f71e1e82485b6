"""Per-op forward and backward times at the local (sharded) shapes a signature gives each rank.

For a ``call`` node ``n`` under signature ``s`` rank 0 runs ``hidup.rules.localize(ctx, s, 0)``
on inputs of the local shapes ``f_i.local_shape(shape_i, N)`` (``f_i = s.inputs[i]``).  We build
random inputs of those shapes (integer inputs are zeros: a valid index for embeddings, targets and
gathers; a rule with ``typical`` values puts them in, e.g. routing spread evenly over the experts),
then time

    t_f  = median time of the local forward
    t_fb = median time of forward + backward (``autograd.grad`` of every floating output against a
           random output gradient, with respect to every floating input that requires a gradient)
    t_b  = max(t_fb - t_f, 0)

and store ``(t_f, t_b)`` under ``op_key(n.target, local input shapes, op_dtype(dtype of n's first
output, precision))``, the key the cost model looks up.  ``precision`` sets how float32 ops run:
``fp32`` / ``tf32`` (TF32 matmuls) or ``bf16`` / ``fp16`` (autocast), as in training.

On a GPU (``graphed``, the default there) each of the two calls is captured ``reps`` times in a
row as one CUDA graph and the graph is replayed: the time per call then holds the kernels and the
gaps between them but no host dispatch, which is what a step captured as one CUDA graph pays; for
an eager step the cost model adds the dispatch cost (``op_overhead``) per op.  An op that cannot be
captured (a host synchronization) is timed eagerly.  On a CPU the wall time of eager calls is used.

Identical keys (repeated layers, signatures with equal local shapes) are measured once, and
``shard=(i, n)`` measures only the distinct keys whose CRC-32 is ``i`` modulo ``n`` so that ``n``
ranks split the work (:func:`hidup.profiler.measure.calibrate.measure_model_ops` gathers the parts).  The
owner of a key depends on the key alone, not on what a rank measured before, so ranks whose caches
differ (each holds its own share) still split every later model, precision and half-batch trace
exactly.  An op whose first forward takes more than ``max_op_s`` is skipped, and measuring stops
after ``total_s`` seconds; the cost model prices whatever is missing from the roofline.

:func:`model_op_times` times a model at its batch and, for duplication, at half the batch
(:func:`hidup.frontend.trace.trace_half_batch`: the shapes of one copy).  :mod:`hidup.profiler.measure.calibrate`
checks their sum against whole steps.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
import zlib
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
from torch.fx.node import map_aggregate

import hidup.rules as rules
from hidup.codegen.timing import Stopwatch, graph_time, time_call
from hidup.frontend.trace import trace_half_batch, trace_module
from hidup.ir import Graph, Signature
from hidup.optionset import OptionSet
from hidup.profiler.measure.device import tf32
from hidup.profiler.profile import DTYPES, op_dtype, op_key

__all__ = ["OpTimingOptions", "time_ops", "model_op_times", "node_signatures", "node_op_key"]


@dataclass(frozen=True)
class OpTimingOptions(OptionSet):
    """How :func:`time_ops` times ops (it takes them as keywords too): on ``device`` in ``precision``
    (module docstring); ``graphed`` replays each op inside a CUDA graph (None: on CUDA devices);
    ``budget_s`` seconds of timing per op, ``max_op_s`` the longest first forward that is timed,
    ``total_s`` the seconds after which measuring stops, ``warmup`` calls before timing, ``seed`` of
    the synthetic inputs; ``shard=(i, n)`` measures the distinct keys whose CRC-32 is ``i`` modulo
    ``n``; ``compiled`` times local calls that are Python functions as inductor compiles them."""

    device: torch.device | str = "cpu"
    precision: str = "fp32"
    graphed: bool | None = None
    budget_s: float = 0.05
    max_op_s: float = 0.5
    total_s: float = 60.0
    warmup: int = 1
    seed: int = 0
    shard: tuple[int, int] = (0, 1)
    compiled: bool = False
    WHAT = "time_ops"


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


def _bind(rules, ctx, sig, tensors: list[torch.Tensor], compiled: bool = False):
    """What rank 0 runs for the node under ``sig``, as a thunk on ``tensors`` (one per ``ctx.inputs``);
    ``compiled``: a local call that is a Python function goes through ``torch.compile`` (inductor)."""
    call = rules.localize(ctx.with_tensors(tensors), sig, 0)
    target, args, kwargs = rules.kernel_of(call.target), tuple(call.args), dict(call.kwargs)
    if compiled and inspect.isfunction(target):
        target = torch.compile(target, dynamic=False)
    if isinstance(target, str):  # a method name: call it on the first argument
        return lambda: getattr(args[0], target)(*args[1:], **kwargs)
    return lambda: target(*args, **kwargs)


def _flat_tensors(value) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def _precision(precision: str, device: torch.device):
    """The context float32 ops run in under ``precision`` (see the module docstring)."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {DTYPES}, got {precision!r}")
    stack = contextlib.ExitStack()
    stack.enter_context(tf32(precision == "tf32"))
    if precision in ("bf16", "fp16"):
        stack.enter_context(
            torch.autocast(
                device_type=device.type,
                cache_enabled=False,
                dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
            )
        )
    return stack


def local_input_shapes(graph: Graph, node, sig: Signature) -> list[tuple[int, ...]]:
    """The shapes of ``node``'s inputs on one rank under ``sig``; ``ValueError`` where a form does not
    divide its dim."""
    return [f.local_shape(graph.tensors[t].shape, graph.world_size) for t, f in zip(node.inputs, sig.inputs)]


def node_op_key(graph: Graph, node, sig: Signature, precision: str, shapes: list | None = None) -> str:
    """The :func:`op_key` under which ``node``'s time under ``sig`` at ``precision`` is stored: its target,
    its local input shapes (``shapes``, default :func:`local_input_shapes`) and the dtype it runs in."""
    dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
    shapes = local_input_shapes(graph, node, sig) if shapes is None else shapes
    return op_key(node.target, shapes, op_dtype(dtype, precision))


def time_ops(
    traced, plan: Any = None, options: OpTimingOptions | None = None, *, cache: dict | None = None, **changes
) -> dict[str, tuple[float, float]]:
    """Measured ``{op_key: (forward s, backward s)}`` for the call nodes of ``traced``
    (a :class:`hidup.frontend.trace.Traced`) under ``plan`` (see :func:`node_signatures`), timed as
    ``options`` (:class:`OpTimingOptions`) updated by the keyword ``changes`` say
    (``time_ops(traced, plan, precision="tf32", shard=(rank, ranks))``).

    ``cache`` (a dict) carries measurements across calls; keys already in it are not re-measured.
    ``graphed`` (default: on CUDA devices) times ops replayed inside a CUDA graph; ``shard=(i, n)``
    measures the distinct keys whose CRC-32 is ``i`` modulo ``n`` (see the module docstring);
    ``compiled`` times local calls that are Python functions (a rule's math, such as the routed
    experts') as inductor compiles them, as a compiled rank program runs them.
    """
    opts = OpTimingOptions.of(options, **changes)
    device = torch.device(opts.device)
    graphed = device.type == "cuda" if opts.graphed is None else opts.graphed
    if graphed and device.type != "cuda":
        raise ValueError(f"time_ops(graphed=True) needs a CUDA device, got {device}")
    index, parts = opts.shard
    if not 0 <= index < parts:
        raise ValueError(f"shard={opts.shard}: need 0 <= index < parts")
    opts = replace(opts, device=device, graphed=graphed)
    cache = {} if cache is None else cache
    skipped = _time_all(_to_time(traced, plan, opts.precision, set(cache), opts.shard), cache, opts)
    if skipped:
        warnings.warn(
            f"hidup.profiler.measure.ops: {len(skipped)} op(s) not timed, the cost model prices them from "
            f"the roofline: " + "; ".join(list(skipped.values())[:10]) + (" ..." if len(skipped) > 10 else ""),
            stacklevel=2,
        )
    return cache


def _to_time(traced, plan: Any, precision: str, seen: set, shard: tuple[int, int]) -> list[tuple]:
    """``(name, context, signature, local shapes, key)`` of each node of ``plan`` to time: one per
    distinct key not in ``seen``, of this shard."""
    graph: Graph = traced.graph
    index, parts = shard
    todo = []
    for name, sig in node_signatures(graph, plan):
        node = graph.node(name)
        ctx = traced.contexts.get(name)
        if ctx is None:
            continue  # no context recorded
        try:
            shapes = local_input_shapes(graph, node, sig)
        except ValueError:
            continue
        key = node_op_key(graph, node, sig, precision, shapes)
        if key not in seen:
            seen.add(key)
            if zlib.crc32(key.encode()) % parts == index:
                todo.append((name, ctx, sig, shapes, key))
    return todo


def _time_all(todo: list[tuple], cache: dict, opts: OpTimingOptions) -> dict[str, str]:
    """Time each op of ``todo`` into ``cache`` until ``opts.total_s`` runs out; the ops not timed, key ->
    why."""
    skipped: dict[str, str] = {}
    gen = torch.Generator().manual_seed(opts.seed)
    t_end = time.perf_counter() + opts.total_s
    with _precision(opts.precision, opts.device):
        for name, ctx, sig, shapes, key in todo:
            if time.perf_counter() > t_end:
                break
            try:
                measured = _time_one(ctx, sig, shapes, gen, opts)
            except Exception as e:  # noqa: BLE001 - an op that cannot run on synthetic inputs is priced from the roofline
                measured = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if isinstance(measured, tuple):
                cache[key] = measured
            else:
                skipped[key] = f"{name} ({measured})"
    return skipped


def _time_one(ctx, sig, shapes, gen, opts: OpTimingOptions):
    """``(forward s, backward s)``, or a string saying why the op was not timed (``opts.device`` and
    ``opts.graphed`` resolved)."""
    device = opts.device
    inputs = [_make_input(m, s, device, gen) for m, s in zip(ctx.inputs, shapes)]
    rule = rules.find_rule(ctx.target)
    if rule is not None and rule.typical is not None:
        inputs = rule.typical(ctx, inputs)
    fn = _bind(rules, ctx, sig, inputs, opts.compiled)
    if opts.compiled:  # the first call compiles: not what max_op_s bounds
        fn()
    with Stopwatch(device) as first:
        out = fn()
    if first.seconds > opts.max_op_s:
        return f"one forward took {first.seconds:.2f} s > max_op_s={opts.max_op_s} s"
    wrt = [t for t in inputs if t.requires_grad]
    outs = [o for o in _flat_tensors(out) if o.requires_grad and o.is_floating_point()]
    grads = (
        [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=o.dtype) for o in outs]
        if wrt
        else []
    )
    del out, outs

    def fwd_bwd():
        res = [o for o in _flat_tensors(fn()) if o.requires_grad and o.is_floating_point()]
        torch.autograd.grad(res, wrt, grads, allow_unused=True)

    def timed(f, budget):
        if opts.graphed:
            eager = time_call(f, device, warmup=opts.warmup, budget_s=budget / 4, sample_s=budget / 16)
            reps = max(1, min(64, int(2e-3 / max(eager, 1e-6))))
            t = graph_time(f, device, budget, reps)
            if t is not None:
                return t
        return time_call(f, device, warmup=opts.warmup, budget_s=budget, sample_s=budget / 4)

    fwd = timed(fn, opts.budget_s)
    if not grads:  # nothing to differentiate
        return fwd, 0.0
    both = timed(fwd_bwd, 2 * opts.budget_s)
    return fwd, max(both - fwd, 0.0)


def model_op_times(
    model: torch.nn.Module,
    example_inputs,
    world_size: int,
    plan: Any = None,
    *,
    half_batch: bool = True,
    cache: dict | None = None,
    **kwargs,
) -> dict[str, tuple[float, float]]:
    """:func:`time_ops` of ``model`` traced at its batch, then (``half_batch``) at half of it; a
    ``plan`` restricts both to its signatures (matched by node name and forms at half the batch)."""
    traced = trace_module(model, example_inputs, world_size)
    cache = {} if cache is None else cache
    ops = time_ops(traced, plan, cache=cache, **kwargs)
    if half_batch:
        half = trace_half_batch(model, example_inputs, world_size)
        if half is not None:
            half_plan = None
            if plan is not None:
                half_plan = []
                for name, sig in node_signatures(traced.graph, plan):
                    try:
                        node = half.graph.node(name)
                    except KeyError:
                        continue
                    match = [s for s in node.signatures if (s.inputs, s.outputs) == (sig.inputs, sig.outputs)]
                    if match:
                        half_plan.append((name, match[0]))
            ops = time_ops(half, half_plan, cache=ops, **kwargs)
    return ops
