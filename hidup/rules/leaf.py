"""Opaque custom ops sharded along the batch (``torch.library`` ops such as ``hidup::moe_gating``).

Work whose control flow depends on tensor values (MoE gating with capacity: top-k, per-expert
queues) cannot be split into ops with rules.  It is written as a ``torch.library`` custom op with a
fake (meta) implementation, so ``torch.export`` records it as one node, and declared here.  Its only
sharding is along the batch: if ``f(x)[b] = f(x[b])`` for every sample group ``b`` (the op treats
the batch entries independently), then rank r computing ``f`` on its slice of the batch gets the
r-th slice of the output, and the gradient of its slice of the input is the r-th slice of the
gradient.  Inputs or outputs declared without a batch dim stay ``full`` (a mask shared by every
sample).  Plus the all-``full`` signature.  FLOPs: declared, else the summed ``numel`` of the tensor
inputs.  Each rank runs the op unchanged on its pieces.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from hidup.ir import FULL, Signature, gather
from hidup.rules.base import Rule, RuleContext
from hidup.rules.registry import _RULES, Unsupported, all_full

__all__ = ["declare_batch_op", "batch_signatures"]

DimSpec = Any  # None | int | (in_dims, out_dims) | callable(ctx) -> (in_dims, out_dims)


def batch_signatures(
    ctx: RuleContext, in_dims: Sequence[int | None], out_dims: Sequence[int | None], flops: float
) -> list[Signature]:
    """All-full plus the batch-sharded signature when every declared batch dim divides by N."""
    sigs = [all_full(ctx, flops)]
    if len(in_dims) != len(ctx.inputs) or len(out_dims) != len(ctx.outputs):
        raise Unsupported(
            f"batch dims {list(in_dims)}/{list(out_dims)} do not match "
            f"{len(ctx.inputs)} tensor inputs / {len(ctx.outputs)} outputs"
        )
    ins, outs = [], []
    for dims_, metas, forms in ((in_dims, ctx.inputs, ins), (out_dims, ctx.outputs, outs)):
        for d, m in zip(dims_, metas):
            if d is None:
                forms.append(FULL)
                continue
            d = d % len(m.shape) if m.shape else -1
            if d < 0 or m.shape[d] % ctx.world:
                return sigs
            forms.append(gather(d))
    if not any(f.is_gather for f in ins + outs):
        return sigs
    sigs.append(Signature(tuple(ins), tuple(outs), float(flops) / ctx.world, "data"))
    return sigs


def _resolve_dims(spec: DimSpec, ctx: RuleContext) -> tuple[list, list]:
    if callable(spec):
        spec = spec(ctx)
    if spec is None:
        spec = 0
    if isinstance(spec, int):
        return [spec] * len(ctx.inputs), [spec] * len(ctx.outputs)
    in_dims, out_dims = spec
    return list(in_dims), list(out_dims)


def _overload(op: Any) -> torch._ops.OpOverload:
    """The overload an exported graph calls: ``op`` itself, a packet's ``.default``, or the overload
    of a ``torch.library.custom_op``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    overload = getattr(op, "_opoverload", None)
    if isinstance(overload, torch._ops.OpOverload):
        return overload
    raise TypeError(
        f"declare_batch_op expects a torch.library custom op (an OpOverload such as "
        f"torch.ops.mylib.myop.default), got {op!r}"
    )


def declare_batch_op(op: Any, dims: DimSpec = None, *, flops: float | Callable | None = None) -> Any:
    """Register the custom op ``op`` as an opaque op sharded along the batch.

    ``dims``: ``None`` -> dim 0 of every tensor input and output; an int -> that dim of all;
    ``(in_dims, out_dims)`` -> one entry (int or ``None`` = stays full) per tensor input/output;
    or ``callable(ctx) -> (in_dims, out_dims)``.  ``flops``: a number or ``callable(ctx)``.
    Returns ``op``, so it can be used as a decorator on a ``torch.library.custom_op``.
    """
    overload = _overload(op)

    def sigs(ctx: RuleContext) -> list[Signature]:
        in_dims, out_dims = _resolve_dims(dims, ctx)
        f = flops(ctx) if callable(flops) else flops
        if f is None:
            f = sum(math.prod(m.shape) for m in ctx.inputs)
        return batch_signatures(ctx, in_dims, out_dims, f)

    _RULES[overload] = Rule(str(overload.name()), sigs, None)
    return op
