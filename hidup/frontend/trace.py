"""Trace one training step of an ``nn.Module`` into hidup's IR (:class:`hidup.ir.Graph`).

Pipeline
--------
1. **Export.**  :func:`hidup.frontend.export.export_step` captures the step with ``torch.export`` (non-strict,
   training IR): a flat graph of ATen ops, Python control flow resolved for the example shapes,
   every module inlined down to its ATen ops (``nn.MultiheadAttention`` and
   ``nn.TransformerEncoderLayer`` included), and opaque work that depends on tensor values as
   ``torch.library`` custom ops (``hidup::moe_gating``) with a fake implementation and a declared
   rule.  Non-tensor example inputs are specialised.
2. **Shape propagation on meta tensors.**  The GraphModule is interpreted with every tensor on the
   ``meta`` device: parameters and inputs of a real model are replaced by ``torch.empty_like(t,
   device="meta")`` (no copy of the weights), and any real tensor an op creates is moved to
   ``meta`` (factories without an explicit device create meta tensors directly).  A model built on
   ``meta`` is exported on fake tensors and never allocates its weights.  Memory is
   therefore O(#nodes), independent of the parameter count.
3. **IR building**, one fx node at a time:

   * ``placeholder`` (tensor) -> ``input`` node with signatures ``() -> (full)`` and
     ``() -> (gather_d)`` for every dim d with ``shape[d] % N == 0`` (N = world size > 1): each rank
     loads its own slice, so the choice is free.
   * ``get_attr`` of an ``nn.Parameter`` -> ``param`` node with ``() -> (replicate)`` and
     ``() -> (gather_d)``; of a buffer -> ``() -> (full)`` and ``() -> (gather_d)``.  A parameter
     reached twice (tied weights) gets one node.
   * ``call_function`` whose value holds tensors -> ``call`` node whose
     signatures come from ``hidup.rules.signatures(ctx)``; ops without a rule get the single
     all-``full`` signature (``node.fallback``) with an estimated ``sum(numel(outputs))`` FLOPs, and
     one warning names them all.  A ``getitem``/``getattr`` on a tuple-valued node is an alias of
     the selected tensors and gets no IR node.  Values without tensors (``x.size(0)``, shape
     arithmetic) are folded into :attr:`Traced.constants`.
   * ``output`` -> ``output`` node that consumes the scalar loss: ``(reduce) -> ()`` or
     ``(full) -> ()``.

   ``node.flops`` is the FLOP count of the all-``full`` signature (the whole op on one device).
   Every signature whose ``gather_d`` does not divide its tensor's ``shape[d]`` by N is dropped.

Device-valued constants (``x.device``) are folded to ``meta``, the device of propagation.

Repeated blocks
---------------
Export costs O(L) in the number of layers (most of the trace of a deep model: 18 of 20 s for an
80-layer Llama-3-70B shape).  When the model holds an ``nn.ModuleList`` of ``L`` structurally
identical blocks (same class, parameter and buffer names, shapes, dtypes and ``requires_grad``, equal
attributes except a layer index; no hooks; a block may be a repeating group of members, a dense and
an MoE layer in turn), step 1 exports the step twice with the list cut to blocks
``[0, 1, L-1]`` and ``[0, 1, 2, L-1]`` and :mod:`hidup.frontend.stamp` writes the ``L``-block GraphModule from
the two: block 2's nodes repeated for blocks ``3 .. L-2``, reading the block before, with the
parameter paths (``layers.2.`` -> ``layers.k.``), fx names and counters the whole export gives
(extrapolated linearly in ``L`` from the two exports, after checking that block ``L-1`` repeats block
2 and that nothing else changes with ``L``).  Steps 2 and 3 then run on that graph as on any other,
except that a stamped op whose inputs have its template's metadata (shape, stride, dtype,
requires_grad, device; its other arguments equal) takes the template's meta value and signatures:
on meta tensors an op's result is a function of exactly those, and a rule's signatures of its
context.  The graph holds the model's own parameters, so search, code generation and the ranks use
it as they use a whole export.  After step 2 every stamped op must have its template's output
shapes, dtypes and ``requires_grad``.  Any failed check, or a short export that fails, exports the
whole step instead: the result is the same graph either way.  ``stamp_layers``: None (default)
stamps stacks of 8 or more blocks, True of 5 or more, False never.
"""

from __future__ import annotations

import builtins
import inspect
import itertools
import math
import operator
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch import nn

from hidup.copies import copy_axis
from hidup.errors import UserError
from hidup.frontend.export import ExportFailure, export_step, written_through_views
from hidup.frontend.saved import Recorder
from hidup.frontend.stamp import AUTO_MIN_BLOCKS, MIN_BLOCKS, export_stamped, repeated_stack
from hidup.fxvalues import dtype_name as _dtype_name
from hidup.fxvalues import map_value, value_leaves
from hidup.fxvalues import map_value as _map
from hidup.fxvalues import module_of as _module_of
from hidup.fxvalues import source_of as _source_of
from hidup.fxvalues import target_name as _target_name
from hidup.fxvalues import to_meta as _to_meta
from hidup.fxvalues import value_leaves as _leaves
from hidup.ir import FULL, REDUCE, REPLICATE, Graph, Layout, Node, Signature, Tensor, gather
from hidup.losses import explicit_normalizers
from hidup.rules import localize as rules_localize
from hidup.rules import variant
from hidup.rules.base import RuleContext, TensorMeta
from hidup.rules.mesh import is_all_full, leaf_layouts, mesh_signatures
from hidup.rules.random import refusal as random_refusal

__all__ = [
    "Traced",
    "TraceFailure",
    "FallbackWarning",
    "trace",
    "trace_module",
    "filtered_signatures",
    "trace_copy",
    "trace_half_batch",
    "halve_example",
    "forward_inputs",
    "map_value",
    "value_leaves",
]


class TraceFailure(UserError, RuntimeError):
    """The model could not be traced or its shapes could not be propagated."""


class FallbackWarning(UserWarning):
    """Some ops have no sharding rule and will run replicated on every rank."""


@dataclass
class Traced:
    """Result of :func:`trace_module`; see the module docstring for the meaning of each field."""

    gm: torch.fx.GraphModule
    graph: Graph
    contexts: dict[str, RuleContext] = field(default_factory=dict)
    tensor_ids: dict[str, list[int]] = field(default_factory=dict)
    constants: dict[str, object] = field(default_factory=dict)
    param_names: dict[str, str] = field(default_factory=dict)
    # tensors whose value changes after they are made (written in place through a view): code
    # generation converts them anew for each reader (hidup.frontend.export.written_through_views)
    written: set[int] = field(default_factory=set)


# ----------------------------------------------------------------------------------------------
# rules hook (guarded: tracing works, everything replicated, while no rules are registered)


def _rules_hook() -> tuple[Callable | None, str]:
    """(signatures function or None, why the rules are missing)."""
    try:
        import hidup.rules as rules
    except ImportError as e:
        return None, f"importing hidup.rules failed: {e}"
    signatures = getattr(rules, "signatures", None)
    return signatures, "" if signatures else "hidup.rules.signatures is not available"


# ----------------------------------------------------------------------------------------------
# small helpers


@dataclass(frozen=True)
class _Ref:
    """A tensor of the IR inside a traced value: its id and metadata."""

    tid: int
    meta: TensorMeta


def _caller_stacklevel() -> int:
    """warnings.warn stacklevel pointing at the first frame outside hidup's tracing entry points."""
    frame, level = inspect.currentframe(), 0  # level 1 is the caller of warnings.warn
    internal = (__file__, os.path.join(os.path.dirname(__file__), "_callable.py"))
    while frame is not None and frame.f_code.co_filename in internal:
        frame, level = frame.f_back, level + 1
    return level


def _fits(form, meta: TensorMeta, world: int) -> bool:
    return not form.is_gather or (form.dim < meta.ndim and meta.shape[form.dim] % world == 0)


def _gather_dims(shape: tuple[int, ...], world: int) -> list[int]:
    if world <= 1:
        return []
    return [d for d, size in enumerate(shape) if size >= world and size % world == 0]


def _whole_on_mesh(sig: Signature, axes: int) -> Signature:
    """The all-``full`` one-axis ``sig`` as a signature on a mesh of ``axes`` axes."""
    lay = Layout((FULL,) * axes)
    return Signature(
        tuple(lay for _ in sig.inputs), tuple(lay for _ in sig.outputs), sig.flops, sig.kind, axes=(sig,) * axes
    )


# ----------------------------------------------------------------------------------------------
# IR building


class _Builder:
    """Turns each fx node, with its propagated meta value, into IR nodes (see module docstring)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        world: int,
        signatures_fn: Callable | None,
        mesh: tuple[int, ...] = (),
        templates: dict[str, str] | None = None,
    ):
        self.gm, self.world, self.signatures_fn = gm, world, signatures_fn
        self.mesh = tuple(mesh) or (world,)
        self.mesh_cache: dict[tuple, tuple] = {}  # op key -> product signatures (_mesh_signatures)
        self.leaf_cache: dict[tuple, list] = {}  # (shape, is_param) -> a parameter's or buffer's layouts
        # stamped op -> the op it copies (hidup.frontend.stamp); a copy whose context equals its template's
        # takes the template's signatures instead of asking the rules again
        self.templates = templates or {}
        self.template_rules: dict[str, tuple] = {n: () for n in self.templates.values()}
        self.nodes: list[Node] = []
        self.tensors: dict[int, Tensor] = {}
        self.struct: dict[str, Any] = {}  # fx node name -> value with _Ref in place of tensors
        self.out = Traced(gm, None)  # type: ignore[arg-type]
        self.meta_cache: dict[int, torch.Tensor] = {}  # id(model tensor) -> meta tensor
        self.attr_refs: dict[int, _Ref] = {}  # id(parameter/buffer) -> its tensor in the IR
        self.used_names = {n.name for n in gm.graph.nodes}
        self.fallbacks: list[tuple[str, str, str, str]] = []  # name, target, source, reason
        self.whole = written_through_views(gm.graph)  # nodes that run whole: a write through a view

    # -- helpers
    def meta_of(self, t: torch.Tensor) -> torch.Tensor:
        """The meta stand-in of a model parameter/buffer (cached: the model keeps ``t`` alive)."""
        key = id(t)
        if key not in self.meta_cache:
            self.meta_cache[key] = _to_meta(t)
        return self.meta_cache[key]

    def new_ref(self, t: torch.Tensor, producer: str, is_param: bool = False) -> _Ref:
        meta = TensorMeta(tuple(int(s) for s in t.shape), _dtype_name(t.dtype), bool(t.requires_grad), is_param)
        tid = len(self.tensors)
        self.tensors[tid] = Tensor(tid, meta.shape, meta.dtype, producer, meta.requires_grad, is_param)
        return _Ref(tid, meta)

    def unique_name(self, base: str) -> str:
        name, k = base, 1
        while name in self.used_names:
            name, k = f"{base}_{k}", k + 1
        self.used_names.add(name)
        return name

    def attr_node(self, obj: torch.Tensor, name: str, dotted: str, fx_node: torch.fx.Node) -> _Ref:
        """The IR tensor of a parameter/buffer, creating its ``param`` node on first use."""
        if id(obj) in self.attr_refs:
            return self.attr_refs[id(obj)]
        is_param = isinstance(obj, nn.Parameter)
        ref = self.new_ref(self.meta_of(obj), name, is_param)
        if len(self.mesh) > 1:  # a function of the shape: the layers of a deep model repeat theirs
            key = (ref.meta.shape, is_param)
            if key not in self.leaf_cache:
                self.leaf_cache[key] = leaf_layouts(
                    ref.meta.shape,
                    self.mesh,
                    REPLICATE if is_param else FULL,
                    "param" if is_param else "data",
                    "param" if is_param else "replicated",
                )
            sigs = list(self.leaf_cache[key])
        else:
            first = Signature((), (REPLICATE,), 0.0, "param") if is_param else Signature((), (FULL,), 0.0, "replicated")
            sigs = [first] + [
                Signature((), (gather(d),), 0.0, "param" if is_param else "data")
                for d in _gather_dims(ref.meta.shape, self.world)
            ]
        self.nodes.append(
            Node(
                name,
                "param",
                "parameter" if is_param else "buffer",
                [],
                [ref.tid],
                sigs,
                module=dotted.rpartition(".")[0],
                source=_source_of(fx_node),
            )
        )
        self.out.param_names[name] = dotted
        self.attr_refs[id(obj)] = ref
        return ref

    # -- per fx node
    def add(self, n: torch.fx.Node, value: Any) -> None:
        getattr(self, f"_add_{n.op}")(n, value)

    def _constant(self, n: torch.fx.Node, value: Any) -> None:
        self.struct[n.name] = value
        self.out.constants[n.name] = value

    def _add_placeholder(self, n: torch.fx.Node, value: Any) -> None:
        if not _leaves(value, torch.Tensor):
            return self._constant(n, value)
        if not isinstance(value, torch.Tensor):
            raise TraceFailure(
                f"model input {n.target!r} is a {type(value).__name__} of tensors; hidup traces "
                "tensor or non-tensor inputs only. Fix: pass each tensor as its own forward argument."
            )
        ref = self.new_ref(value, n.name)
        if len(self.mesh) > 1:
            sigs = leaf_layouts(ref.meta.shape, self.mesh, FULL, "data", "replicated")
        else:
            sigs = [Signature((), (FULL,), 0.0, "replicated")] + [
                Signature((), (gather(d),), 0.0, "data") for d in _gather_dims(ref.meta.shape, self.world)
            ]
        self.nodes.append(Node(n.name, "input", "input", [], [ref.tid], sigs, source=_source_of(n)))
        self.struct[n.name] = ref
        self.out.tensor_ids[n.name] = [ref.tid]

    def _add_get_attr(self, n: torch.fx.Node, value: Any) -> None:
        obj = operator.attrgetter(str(n.target))(self.gm)
        if not isinstance(obj, torch.Tensor):
            return self._constant(n, value)
        ref = self.attr_node(obj, n.name, str(n.target), n)
        self.struct[n.name] = ref
        self.out.tensor_ids[n.name] = [ref.tid]

    def _add_output(self, n: torch.fx.Node, value: Any) -> None:
        loss = torch.fx.node.map_arg(n.args[0], lambda a: self.struct[a.name])
        if not isinstance(loss, _Ref) or loss.meta.shape != ():
            got = f"a tensor of shape {list(loss.meta.shape)}" if isinstance(loss, _Ref) else repr(loss)[:120]
            raise TraceFailure(
                f"the model must return a scalar loss (a 0-dim tensor), but its forward returned "
                f"{got}. Fix: compute the loss inside forward (e.g. wrap the model in a module that "
                "returns loss_fn(model(x), y))."
            )
        if len(self.mesh) > 1:  # the loss may be a partial sum over any set of axes
            sigs = [
                Signature((Layout(forms),), (), 0.0, "replicated")
                for forms in itertools.product((REDUCE, FULL), repeat=len(self.mesh))
            ]
        else:
            sigs = [Signature((REDUCE,), (), 0.0, "replicated"), Signature((FULL,), (), 0.0, "replicated")]
        self.nodes.append(Node(n.name, "output", "output", [loss.tid], [], sigs, source=_source_of(n)))

    def _add_call_function(self, n: torch.fx.Node, value: Any) -> None:
        if not _leaves(value, torch.Tensor):
            return self._constant(n, value)
        if (
            n.target in (operator.getitem, builtins.getattr)
            and isinstance(n.args[0], torch.fx.Node)
            and not isinstance(self.struct[n.args[0].name], _Ref)
        ):
            args = _map(tuple(n.args), lambda a: self.struct[a.name] if isinstance(a, torch.fx.Node) else a)
            picked = n.target(*args)  # the alias: select from the producer's structure
            self.struct[n.name] = picked
            self.out.tensor_ids[n.name] = [r.tid for r in _leaves(picked, _Ref)]
            return
        self._call(n, value)

    def _call(self, n: torch.fx.Node, value: Any) -> None:
        refused = random_refusal(n.target)
        if refused:
            raise TraceFailure(f"{n.name} (at {_source_of(n) or 'an unknown line'}): {refused}")
        sub = lambda a: self.struct[a.name] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        args, kwargs = _map(tuple(n.args), sub), _map(dict(n.kwargs), sub)
        in_refs = _leaves((args, kwargs), _Ref)
        to_meta = lambda v: v.meta if isinstance(v, _Ref) else v  # noqa: E731
        out_struct = _map(value, lambda v: self.new_ref(v, n.name) if isinstance(v, torch.Tensor) else v)
        out_refs = _leaves(out_struct, _Ref)
        ctx = RuleContext(
            target=n.target,
            args=_map(args, to_meta),
            kwargs=_map(kwargs, to_meta),
            inputs=[r.meta for r in in_refs],
            outputs=[r.meta for r in out_refs],
            world=self.world,
            node_name=n.name,
        )
        key = (n.target, ctx.args, ctx.kwargs, ctx.inputs, ctx.outputs)
        template = self.template_rules.get(self.templates.get(n.name, ""))
        if template and template[0] == key:
            sigs, reason = template[1], template[2]
        elif len(self.mesh) > 1:
            sigs, reason = self._mesh_signatures(ctx)
        else:
            sigs, reason = self._signatures(ctx)
        if n.name in self.template_rules:
            self.template_rules[n.name] = (key, sigs, reason)
        sigs = list(sigs) if sigs is not None else None
        if sigs is not None and n.name in self.whole:
            sigs = [s for s in sigs if is_all_full(s)] or None
            reason = reason or "it writes in place through a view"
        fallback = sigs is None
        if fallback:
            est = float(sum(math.prod(r.meta.shape) for r in out_refs))
            sigs = [Signature(tuple(FULL for _ in in_refs), tuple(FULL for _ in out_refs), est, "replicated")]
            if len(self.mesh) > 1:
                sigs = [_whole_on_mesh(sigs[0], len(self.mesh))]
            self.fallbacks.append((n.name, _target_name(n, self.gm), _source_of(n) or "?", reason))
        flops = next(s.flops for s in sigs if is_all_full(s))
        self.nodes.append(
            Node(
                n.name,
                "call",
                _target_name(n, self.gm),
                [r.tid for r in in_refs],
                [r.tid for r in out_refs],
                sigs,
                flops,
                _module_of(n),
                _source_of(n),
                fallback,
                variant(ctx),
            )
        )
        self.struct[n.name] = out_struct
        self.out.tensor_ids[n.name] = [r.tid for r in out_refs]
        self.out.contexts[n.name] = ctx
        if n.name in self.whole:
            self.out.written.update(r.tid for r in out_refs)

    def _mesh_signatures(self, ctx: RuleContext) -> tuple[list[Signature] | None, str]:
        """:func:`hidup.rules.mesh.mesh_signatures`, once per distinct op (target, arguments, shapes):
        the layers of a deep model repeat the same ops, and a product costs a rule call per factor."""
        key = (ctx.target, repr(ctx.args), repr(ctx.kwargs), tuple(ctx.inputs), tuple(ctx.outputs))
        hit = self.mesh_cache.get(key)
        if hit is None:
            hit = self.mesh_cache[key] = mesh_signatures(ctx, self.mesh, self._signatures, rules_localize)
        return hit

    def _signatures(self, ctx: RuleContext) -> tuple[list[Signature] | None, str]:
        return filtered_signatures(self.signatures_fn, ctx)


def filtered_signatures(signatures_fn: Callable | None, ctx: RuleContext) -> tuple[list[Signature] | None, str]:
    """The rule's signatures (``signatures_fn``: :func:`hidup.rules.signatures`) filtered to ``ctx.world``;
    (None, reason) means fall back to replicating the op."""
    if signatures_fn is None:
        return None, "no rule"
    try:
        sigs = signatures_fn(ctx)
    except Exception as e:  # noqa: BLE001 - a broken rule must not stop tracing: replicate and report it
        return None, f"its rule raised {type(e).__name__}: {e}"
    if sigs is None:
        return None, "no rule"
    n_in, n_out = len(ctx.inputs), len(ctx.outputs)
    bad = [s for s in sigs if len(s.inputs) != n_in or len(s.outputs) != n_out]
    if bad:
        return None, f"its rule returned {bad[0]} for {n_in} inputs / {n_out} outputs"
    sigs = [
        s
        for s in sigs
        if all(_fits(f, m, ctx.world) for f, m in zip(s.inputs, ctx.inputs))
        and all(_fits(f, m, ctx.world) for f, m in zip(s.outputs, ctx.outputs))
    ]
    if not sigs:
        return None, f"no signature of its rule fits world size {ctx.world}"
    if not any(is_all_full(s) for s in sigs):
        # Contract breach; the largest per-rank cost is a lower bound on the unsharded op.
        sigs.insert(
            0,
            Signature(
                tuple(FULL for _ in ctx.inputs),
                tuple(FULL for _ in ctx.outputs),
                max(s.flops for s in sigs),
                "replicated",
            ),
        )
    return list(sigs), ""


class _MetaProp(torch.fx.Interpreter):
    """Runs the GraphModule on meta tensors, handing every node's value to the builder.

    A stamped op (``templates``: its name -> the name of the op it copies, :mod:`hidup.frontend.stamp`) whose
    inputs have its template's metadata (shape, stride, dtype, requires_grad, device) and whose
    other arguments are equal takes the template's value: on meta tensors an op's result is a
    function of exactly those."""

    def __init__(
        self, gm: torch.fx.GraphModule, builder: _Builder, inputs: list, templates: dict[str, str] | None = None
    ):
        super().__init__(gm, garbage_collect_values=True)
        self.builder = builder
        self.inputs = iter(inputs)
        self.templates = templates or {}
        self.template_values: dict[str, tuple] = {n: () for n in self.templates.values()}

    def _input_key(self, n: torch.fx.Node):
        def meta(v):
            if isinstance(v, torch.Tensor):
                return (tuple(v.shape), v.stride(), v.dtype, v.requires_grad, v.device)
            return (type(v), v)

        return _map((n.args, n.kwargs), lambda a: _map(self.env[a], meta) if isinstance(a, torch.fx.Node) else meta(a))

    def placeholder(self, target, args, kwargs):
        return _map(next(self.inputs), lambda v: _to_meta(v) if isinstance(v, torch.Tensor) else v)

    def get_attr(self, target, args, kwargs):
        value = self.fetch_attr(target)
        return self.builder.meta_of(value) if isinstance(value, torch.Tensor) else value

    def run_node(self, n: torch.fx.Node) -> Any:
        stamped = n.name in self.templates or n.name in self.template_values
        key = self._input_key(n) if stamped and n.op == "call_function" else None
        template = self.template_values.get(self.templates.get(n.name, ""))
        if key is not None and template and template[0] == key:
            value = template[1]
        elif n.op not in ("output",):
            try:
                value = super().run_node(n)
            except TraceFailure:
                raise
            except Exception as e:
                raise TraceFailure(
                    f"shape propagation failed at node {n.name} ({_target_name(n, self.module)}) in module "
                    f"{_module_of(n) or '<root>'!r} at {_source_of(n) or '?'}: {type(e).__name__}: {e}. "
                    "hidup propagates shapes on meta tensors, so ops whose output shape depends on tensor values "
                    "(nonzero, masked_select, .item(), .tolist()) cannot run there. Fix: compute such values from "
                    "shapes/config instead, or move the code into a torch.library custom op with a fake (meta) "
                    "implementation and declare a rule for it (hidup.rules.declare_batch_op)."
                ) from e
            value = _map(value, lambda v: _to_meta(v) if isinstance(v, torch.Tensor) else v)
        else:
            value = None
        if key is not None and n.name in self.template_values:
            self.template_values[n.name] = (key, value)
        self.builder.add(n, value)
        return value


# ----------------------------------------------------------------------------------------------
# public API


def forward_inputs(model: nn.Module, example_inputs: Any) -> list:
    """The forward's argument values in parameter order (defaults filled in)."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        if isinstance(example_inputs, dict):
            raise TraceFailure(f"{type(model).__name__}.forward takes *args/**kwargs; pass example inputs as a tuple")
        return list(example_inputs)
    try:
        bound = sig.bind(**example_inputs) if isinstance(example_inputs, dict) else sig.bind(*example_inputs)
    except TypeError as e:
        raise TraceFailure(f"example inputs do not match {type(model).__name__}.forward{sig}: {e}") from e
    return [bound.arguments.get(p.name, p.default) for p in params]


def trace_module(
    model: nn.Module,
    example_inputs: Any,
    world_size: int = 1,
    *,
    mesh: tuple[int, ...] | None = None,
    stamp_layers: bool | None = None,
) -> Traced:
    """Trace ``model(*example_inputs)`` (a training step returning a scalar loss) for ``world_size`` ranks,
    or for a device ``mesh`` of several axes (outer first; ``world_size`` then defaults to its size).

    ``example_inputs`` is a tensor, a tuple of positional inputs or a dict of keyword inputs; tensors
    may live on any device including ``meta``.  The step is captured with ``torch.export``
    (:mod:`hidup.frontend.export`); see the module docstring.  ``stamp_layers``: export a stack of identical
    blocks short and stamp out the rest (:mod:`hidup.frontend.stamp`; the same graph): None (default) for
    stacks of 8 blocks or more, True for 5 or more, False never.  Returns a :class:`Traced`.
    """
    mesh = _checked_mesh(mesh, world_size)
    if not isinstance(model, nn.Module):
        raise TypeError(f"hidup.trace expects an nn.Module, got {type(model).__name__}")
    if not (stamp_layers is None or isinstance(stamp_layers, bool)):
        raise ValueError(f"stamp_layers must be None (automatic), True or False, got {stamp_layers!r}")
    signatures_fn, rules_missing = _rules_hook()
    values = forward_inputs(model, example_inputs)
    traced = _stamped_trace(model, values, mesh, signatures_fn, rules_missing, stamp_layers)
    if traced is not None:
        return traced
    gm = _exported(model, values)
    return _build(model, gm, values, mesh, signatures_fn, rules_missing)


def _stamped_trace(model, values, mesh, signatures_fn, rules_missing, stamp_layers) -> Traced | None:
    """The trace of a step whose repeated blocks were exported short and stamped (:mod:`hidup.frontend.stamp`),
    or None where that does not apply or its check fails (the whole step is then exported)."""
    if stamp_layers is False:
        return None
    stack = repeated_stack(model, MIN_BLOCKS if stamp_layers else AUTO_MIN_BLOCKS)
    if stack is None:
        return None
    stamped = export_stamped(lambda: _exported(model, values), model, stack)
    if stamped is None:
        return None
    with warnings.catch_warnings(record=True) as caught:  # shown once the stamped graph is accepted
        warnings.simplefilter("always")
        try:
            traced = _build(
                model, stamped.gm, values, mesh, signatures_fn, rules_missing, stamped.templates, stamped.blocks
            )
        except Exception:  # noqa: BLE001 - the whole export runs next and reports any failure its own way
            return None
    if not stamped.agrees(traced.tensor_ids, traced.graph.tensors):
        return None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return traced


def _checked_mesh(mesh, world_size) -> tuple[int, ...]:
    """The mesh to trace for: ``mesh`` (a tuple of positive sizes whose product is ``world_size``
    unless that is left at 1), else one axis of ``world_size``."""
    if mesh is None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return (world_size,)
    if not isinstance(mesh, (tuple, list)) or not mesh or not all(isinstance(n, int) and n >= 1 for n in mesh):
        raise ValueError(f"mesh must be a tuple of positive axis sizes, outer first (e.g. (2, 4)), got {mesh!r}")
    mesh = tuple(mesh)
    if world_size not in (1, math.prod(mesh)):
        raise ValueError(f"mesh {mesh} holds {math.prod(mesh)} ranks but world_size={world_size}; give one of them")
    return mesh


def _exported(model: nn.Module, values: list) -> torch.fx.GraphModule:
    names = _forward_names(model, values)
    try:
        return export_step(model, values, names)
    except ExportFailure as e:
        raise TraceFailure(str(e)) from e


def _forward_names(model: nn.Module, values: list) -> list[str]:
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return [f"input_{i}" for i in range(len(values))]
    return [p.name for p in params]


def _build(
    model: nn.Module,
    gm: torch.fx.GraphModule,
    values: list,
    mesh: tuple[int, ...],
    signatures_fn,
    rules_missing: str,
    templates: dict[str, str] | None = None,
    blocks: list[dict[str, str]] | None = None,
) -> Traced:
    explicit_normalizers(gm)
    world_size = math.prod(mesh)
    builder = _Builder(gm, world_size, signatures_fn, mesh if len(mesh) > 1 else (), templates)
    with torch.enable_grad(), torch.device("meta"):  # factories without a device make meta tensors too
        _MetaProp(gm, builder, values, templates).run(enable_io_processing=False)

    graph = Graph(
        builder.nodes,
        builder.tensors,
        world_size,
        type(model).__name__,
        [name for name, *_ in builder.fallbacks],
        mesh=mesh,
    )
    graph.validate()
    graph.copy_reason = copy_axis(graph).reason
    # what autograd saves per node, measured on demand per precision (hidup.frontend.saved), the stamped blocks'
    # record stamped out too
    graph.autograd_saved = Recorder(gm, values, builder.out.tensor_ids, graph, builder.out.contexts, blocks)
    if builder.fallbacks:
        warnings.warn(
            fallback_notice(builder.fallbacks, type(model).__name__, rules_missing),
            FallbackWarning,
            stacklevel=_caller_stacklevel(),
        )
    out = builder.out
    out.graph = graph
    return out


def fallback_notice(fallbacks: list[tuple[str, str, str, str]], model: str, rules_missing: str = "") -> str:
    """One line on the ops that run replicated for want of a rule: how many, of which kinds (most
    frequent first, at most five), where the first one is and why, and where to look further.
    ``fallbacks``: (node name, target, source, reason) per op."""
    kinds: dict[str, int] = {}
    for _, target, _, _ in fallbacks:
        kinds[target] = kinds.get(target, 0) + 1
    ranked = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    listing = ", ".join(f"{k} x{c}" if c > 1 else k for k, c in ranked[:5]) + (", ..." if len(ranked) > 5 else "")
    name, target, src, why = fallbacks[0]
    reason = "" if why == "no rule" else f": {why if len(why) <= 160 else why[:157] + '...'}"
    missing = f" ({rules_missing})" if rules_missing else ""
    return (
        f"hidup.trace: {len(fallbacks)} op(s) of {model} run replicated on every rank (no usable sharding "
        f"rule{missing}): {listing}; the first, {name} ({target}), at {src}{reason}. `hidup describe` lists "
        'them all; docs/design.md ("Rules") shows how to declare a rule'
    )


def halve_example(values: list, batch_dims: list) -> list:
    """Example inputs of one duplicated copy for tracing: the first half of each batch dim (only
    shapes matter; ``batch_dims[i]`` None, or a non-tensor value, passes it unchanged)."""
    return [
        v.narrow(d, 0, v.shape[d] // 2) if isinstance(v, torch.Tensor) and d is not None else v
        for v, d in zip(values, batch_dims)
    ]


def trace_copy(
    model: nn.Module,
    example_inputs: Any,
    world_size: int,
    *,
    batch_dims: list | None = None,
    mesh: tuple[int, ...] | None = None,
    stamp_layers: bool | None = None,
) -> Traced:
    """The program one duplicated copy runs (:mod:`hidup.codegen.duplicate`): ``model`` traced for
    ``world_size`` ranks at half the global batch (:func:`halve_example` of every forward input;
    ``batch_dims`` default 0).  ValueError when a batch dim is odd (the copies could not split it)."""
    values = forward_inputs(model, example_inputs)
    dims = batch_dims if batch_dims is not None else [0] * len(values)
    if len(dims) != len(values):
        raise ValueError(f"batch_dims has {len(dims)} entries for {len(values)} forward inputs")
    for v, d in zip(values, dims):
        if isinstance(v, torch.Tensor) and d is not None and v.shape[d] % 2:
            raise ValueError(
                f"duplication splits dim {d} of an input of shape {tuple(v.shape)} in two, which "
                f"does not divide {v.shape[d]}; use an even batch or turn duplication off"
            )
    return trace_module(model, tuple(halve_example(values, dims)), world_size, mesh=mesh, stamp_layers=stamp_layers)


def trace_half_batch(
    model: nn.Module,
    example_inputs: Any,
    world_size: int = 1,
    *,
    mesh: tuple[int, ...] | None = None,
    stamp_layers: bool | None = None,
) -> Traced | None:
    """The program one duplicated copy runs (:func:`trace_copy`), or None when the model cannot be
    traced at half the batch (an odd batch, shapes fixed by the model): the cost model then halves
    the full batch's times instead."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the full-batch trace already reported fallbacks
            return trace_copy(model, example_inputs, world_size, mesh=mesh, stamp_layers=stamp_layers)
    except Exception:  # noqa: BLE001 - documented fallback: half-batch times are estimated
        return None


def trace(
    model: nn.Module,
    example_inputs: Any,
    world_size: int = 1,
    *,
    half_batch: bool = False,
    mesh: tuple[int, ...] | None = None,
    stamp_layers: bool | None = None,
) -> Graph:
    """:func:`trace_module` returning only the IR graph; ``half_batch=True`` also traces the model at
    half the batch (:func:`trace_half_batch`) and keeps that graph as ``graph.half``, which lets the
    search price duplication's half-batch copies with ops measured at their own shapes.
    ``stamp_layers`` as for :func:`trace_module`."""
    graph = trace_module(model, example_inputs, world_size, mesh=mesh, stamp_layers=stamp_layers).graph
    if half_batch:
        half = trace_half_batch(model, example_inputs, world_size, mesh=mesh, stamp_layers=stamp_layers)
        graph.half = half.graph if half is not None else None
    return graph


from hidup._callable import make_callable  # noqa: E402

make_callable(__name__, "trace")
