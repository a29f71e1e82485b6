"""Signatures on a device mesh of several axes: products of one-axis rule signatures.

On a mesh ``(n_0, n_1, ...)`` (outer axis first, :mod:`hidup.ir`, "Meshes") an op runs in the way
DTensor runs it: axis 0's signature ``s_0`` localizes the op for ``n_0`` ranks, axis 1's signature
``s_1`` is one the rule offers for *that local op* on ``n_1`` ranks, and so on.  Each rank of the mesh
runs the op localized axis after axis, so a product is correct exactly when each factor is: the rule
of axis ``k`` is proven (by the simulated-SPMD property test) for any shapes, including those the axes
before ``k`` left.  The forms of the product are :class:`~hidup.ir.Layout` s, ``(s_0.f, s_1.f, ...)``
per tensor, its per-rank FLOPs those of the last factor, and ``Signature.axes`` keeps the factors so
that code generation localizes with the same chain (:func:`localize_mesh`).

A rule may reorder the tensor arguments of its local call (``aten.embedding(weight, indices)`` runs as
``F.embedding(indices, weight)``); the next axis's rule sees the local call's order, and the product
maps its forms back to the node's input order.  When a local call drops or repeats a tensor argument, or
no rule knows its target (a per-rank implementation such as the vocabulary-sharded embedding), the
axes after it may only replicate the op (their all-``full`` signature).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from hidup.fxvalues import map_value
from hidup.ir import FULL, Form, Layout, Signature, axis_forms, gather
from hidup.rules.base import LocalCall, RuleContext, TensorMeta

__all__ = [
    "AxisContext",
    "axis_context",
    "mesh_signatures",
    "leaf_layouts",
    "localize_mesh",
    "combined_kind",
    "is_all_full",
]

SignaturesFn = Callable[[RuleContext], "tuple[list[Signature] | None, str]"]
LocalizeFn = Callable[[RuleContext, Signature, int], LocalCall]


def _local_meta(meta: TensorMeta, form: Form, size: int) -> TensorMeta:
    return replace(meta, shape=form.local_shape(meta.shape, size))


@dataclass(frozen=True)
class AxisContext:
    """The op as one axis's signature localized it: ``ctx`` (for the next axis, ``world`` its size)
    and ``order[i]``, the node's input index of the local call's ``i``-th tensor argument (None when
    the local call drops or repeats one)."""

    ctx: RuleContext
    order: list[int] | None


def axis_context(ctx: RuleContext, sig: Signature, rank: int, next_world: int, localize: LocalizeFn) -> AxisContext:
    """Localize ``ctx`` under one-axis ``sig`` for ``rank`` of ``ctx.world`` and describe the local op
    for the next axis (``next_world`` ranks), its tensors :class:`TensorMeta` of the local shapes."""
    local_in = [_local_meta(m, f, ctx.world) for m, f in zip(ctx.inputs, sig.inputs)]
    local_out = [_local_meta(m, f, ctx.world) for m, f in zip(ctx.outputs, sig.outputs)]
    probes = [TensorMeta(m.shape, m.dtype, m.requires_grad, m.is_param) for m in local_in]
    call = localize(ctx.with_tensors(probes), sig, rank)
    seen: list[int] = []

    def slot(v):
        if isinstance(v, TensorMeta):
            hit = [i for i, p in enumerate(probes) if p is v]
            seen.append(hit[0] if hit else -1)
        return v

    map_value((tuple(call.args), dict(call.kwargs)), slot)
    order = seen if sorted(seen) == list(range(len(probes))) else None
    inputs = [local_in[i] for i in order] if order is not None else local_in
    nxt = RuleContext(
        target=_rule_target(call.target),
        args=tuple(call.args),
        kwargs=dict(call.kwargs),
        inputs=inputs,
        outputs=local_out,
        world=next_world,
        module=ctx.module,
        node_name=ctx.node_name,
    )
    return AxisContext(nxt, order)


def _rule_target(target: Any) -> Any:
    """The local call's target as the rules name it: an unbound ``torch.Tensor`` method (what a rule's
    local call runs for a method-name target, ``callable_of("sum")``) goes back to its name, since rules
    tell ``"sum"`` from ``torch.nansum`` by the target they were given."""
    name = getattr(target, "__name__", None)
    if isinstance(name, str) and getattr(torch.Tensor, name, None) is target:
        return name
    return target


def is_all_full(sig: Signature) -> bool:
    """Whether ``sig`` runs the whole op on every rank (every axis's form ``full``; a parameter's
    ``replicate`` input counts as whole), on one axis or a mesh."""
    return all(x.kind in ("full", "replicate") for f in sig.inputs for x in axis_forms(f)) and all(
        x.kind == "full" for f in sig.outputs for x in axis_forms(f)
    )


def combined_kind(kinds: list[str]) -> str:
    """Report label of a product: the factors' kinds that shard, joined by ``+`` (outer first)."""
    sharded = [k for k in kinds if k != "replicated"]
    out: list[str] = []
    for k in sharded:
        if k not in out:
            out.append(k)
    return "+".join(out) or "replicated"


def _replicated(ctx: RuleContext, flops: float) -> Signature:
    return Signature(tuple(FULL for _ in ctx.inputs), tuple(FULL for _ in ctx.outputs), flops, "replicated")


def mesh_signatures(
    ctx: RuleContext, mesh: tuple[int, ...], signatures: SignaturesFn, localize: LocalizeFn
) -> tuple[list[Signature] | None, str]:
    """Every product signature of the op described by ``ctx`` (global shapes) on ``mesh``; the
    all-``full`` one first.  ``signatures(ctx)`` gives one axis's signatures filtered to
    ``ctx.world`` (``(None, reason)``: no rule); ``localize`` is :func:`hidup.rules.localize`."""
    first, reason = signatures(replace(ctx, world=mesh[0]))
    if first is None:
        return None, reason
    best: dict[tuple, Signature] = {}

    def grow(ctx_k: RuleContext, k: int, chain: list[Signature], order: list[int] | None, sigs_k) -> None:
        for s in sigs_k:
            factors = chain + [s]
            mapped = s.inputs if order is None else _unorder(s.inputs, order)
            if k + 1 == len(mesh):
                _keep(best, factors, mapped_forms + [(mapped, s.outputs)])
                continue
            try:
                nxt = axis_context(ctx_k, s, 0, mesh[k + 1], localize)
            except Exception:  # noqa: BLE001 - a factor whose local op cannot be described replicates below
                nxt = None
            mapped_forms.append((mapped, s.outputs))
            order_next = _compose(order, nxt.order) if nxt is not None and nxt.order is not None else None
            if nxt is None or order_next is None:
                _keep(
                    best,
                    factors + [_replicated(ctx, s.flops)] * (len(mesh) - k - 1),
                    _pad(mapped_forms, ctx, len(mesh)),
                )
            else:
                sub, _ = signatures(nxt.ctx)
                grow(nxt.ctx, k + 1, factors, order_next, sub or [_replicated(nxt.ctx, s.flops)])
            mapped_forms.pop()

    mapped_forms: list[tuple[tuple[Form, ...], tuple[Form, ...]]] = []
    grow(replace(ctx, world=mesh[0]), 0, [], None, first)
    sigs = sorted(best.values(), key=lambda s: (not is_all_full(s), s.flops))
    return sigs, ""


def _unorder(forms: tuple[Form, ...], order: list[int]) -> tuple[Form, ...]:
    """Forms given in a local call's argument order, back in the node's input order."""
    out: list[Form] = [FULL] * len(order)
    for pos, node_index in enumerate(order):
        out[node_index] = forms[pos]
    return tuple(out)


def _compose(outer: list[int] | None, inner: list[int]) -> list[int] | None:
    """Node input index of each argument of a call localized twice (``inner`` indexes ``outer``'s order)."""
    return list(inner) if outer is None else [outer[i] for i in inner]


def _pad(mapped: list, ctx: RuleContext, axes: int) -> list:
    full = (tuple(FULL for _ in ctx.inputs), tuple(FULL for _ in ctx.outputs))
    return list(mapped) + [full] * (axes - len(mapped))


def _keep(best: dict, factors: list[Signature], per_axis: list) -> None:
    n_in, n_out = len(per_axis[0][0]), len(per_axis[0][1])
    inputs = tuple(Layout(tuple(per_axis[k][0][i] for k in range(len(per_axis)))) for i in range(n_in))
    outputs = tuple(Layout(tuple(per_axis[k][1][j] for k in range(len(per_axis)))) for j in range(n_out))
    sig = Signature(
        inputs,
        outputs,
        factors[-1].flops,
        combined_kind([f.kind for f in factors]),
        axes=tuple(factors),
    )
    key = (inputs, outputs)
    if key not in best or sig.flops < best[key].flops:
        best[key] = sig


def leaf_layouts(
    shape: tuple[int, ...], mesh: tuple[int, ...], first: Form, kind: str, whole_kind: str
) -> list[Signature]:
    """Signatures ``() -> (layout)`` of an input, parameter or buffer on ``mesh``: per axis ``first``
    (``full``, or ``replicate`` for a parameter) or a split of any dim the axis divides as the axes
    before it left it; ``kind`` labels layouts that split, ``whole_kind`` the one that does not."""
    out: list[Signature] = []

    def grow(k: int, local: tuple[int, ...], forms: list[Form], factors: list[Signature]) -> None:
        if k == len(mesh):
            split = any(f.is_gather for f in forms)
            out.append(Signature((), (Layout(tuple(forms)),), 0.0, kind if split else whole_kind, axes=tuple(factors)))
            return
        n = mesh[k]
        options = [first] + [gather(d) for d, size in enumerate(local) if n > 1 and size >= n and size % n == 0]
        for f in options:
            factor = Signature((), (f,), 0.0, kind if f.is_gather else whole_kind)
            grow(k + 1, f.local_shape(local, n), forms + [f], factors + [factor])

    grow(0, tuple(shape), [], [])
    return out


def localize_mesh(
    ctx: RuleContext,
    sig: Signature,
    coords: tuple[int, ...],
    mesh: tuple[int, ...],
    localize: LocalizeFn,
    tensors: list,
) -> LocalCall:
    """What the rank at mesh ``coords`` runs for the node under product ``sig``: the op localized by
    ``sig.axes[0]`` for ``coords[0]`` of ``mesh[0]``, then by ``sig.axes[1]``, ... (module docstring);
    ``tensors`` are the node's tensor inputs in its input order (fx nodes in code generation)."""
    if len(sig.axes) != len(mesh) or len(coords) != len(mesh):
        raise ValueError(f"node {ctx.node_name}: signature {sig} has {len(sig.axes)} axes for mesh {mesh}")
    ctx_k, order = replace(ctx, world=mesh[0]), None
    for k, factor in enumerate(sig.axes):
        args_k = list(tensors) if order is None else [tensors[i] for i in order]
        if k + 1 == len(mesh):
            return _on_axis(localize(ctx_k.with_tensors(args_k), factor, coords[k]), k)
        step = axis_context(ctx_k, factor, coords[k], mesh[k + 1], localize)
        if step.order is None:
            if all(is_all_full(a) for a in sig.axes[k + 1 :]):
                return _on_axis(localize(ctx_k.with_tensors(args_k), factor, coords[k]), k)
            raise ValueError(f"node {ctx.node_name}: the local op of axis {k} cannot be split further")
        order = _compose(order, step.order)
        ctx_k = replace(step.ctx, kwargs=_axis_named(step.ctx.kwargs, k))
    raise AssertionError("unreachable")


def _on_axis(call: LocalCall, axis: int) -> LocalCall:
    """``call`` with its group named (:func:`_axis_named`)."""
    return replace(call, kwargs=_axis_named(call.kwargs, axis))


def _axis_named(kwargs: dict, axis: int) -> dict:
    """A local call's keywords with its group named: a call that communicates inside (the routed
    experts' all-to-all dispatcher, :mod:`hidup.rules.dispatch`) has a ``mesh_axis`` keyword left None
    by its rule, and it is the axis whose signature produced it."""
    if kwargs.get("mesh_axis", 0) is not None:
        return kwargs
    return {**kwargs, "mesh_axis": axis}
