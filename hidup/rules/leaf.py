"""Opaque leaves: declared batch functions and leaf modules.

A *batch function* (a ``torch.fx.wrap``-ed function, e.g. MoE gating with capacity, whose work is
data dependent) and a *leaf module* (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``)
are traced as one node.  Their only sharding is along the batch: if
``f(x)[b] = f(x[b])`` for every sample group ``b`` (the op treats the batch entries
independently), then rank r computing ``f`` on its slice of the batch gets the r-th slice of the
output.  Inputs or outputs declared without a batch dim stay ``full`` (a mask shared by every
sample); module parameters are always ``full`` (their gradients come out as per-rank partial sums,
the ``full`` convention).  Plus the all-``full`` signature.  FLOPs: declared, else the summed
``numel`` of the tensor inputs; for the built-in attention leaves ``8*B*S*D^2 + 4*B*S^2*D``.

For ``call_module`` leaves ``ctx.inputs`` is the tensor args (map_aggregate order) followed by the
module's parameters in ``named_parameters()`` order.  Standard modules that fx keeps as leaves
(``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, activations, ...) reuse their functional rule,
restricted to the signatures that keep every parameter ``full`` (the module runs unchanged).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.ir import FULL, Signature, gather
from hidup.rules.base import Rule, RuleContext
from hidup.rules.registry import (Unsupported, _RULES, all_full, lookup, register_module, tensor_slots)

__all__ = ["declare_batch_function", "declare_leaf_module", "batch_signatures", "leaf_modules", "batch_functions"]

# declared opaque leaves (not the standard modules whose rules merely mirror their functional form)
_LEAF_CLASSES: list[type] = []
_BATCH_FUNCTIONS: list[Callable] = []


def leaf_modules() -> tuple[type, ...]:
    """Module classes the tracer must keep as ``call_module`` leaves."""
    return tuple(_LEAF_CLASSES)


def batch_functions() -> tuple[Callable, ...]:
    """Functions the tracer must keep as single opaque calls (``torch.fx`` autowrap)."""
    return tuple(_BATCH_FUNCTIONS)

DimSpec = Any  # None | int | (in_dims, out_dims) | callable(ctx) -> (in_dims, out_dims)


def batch_signatures(ctx: RuleContext, in_dims: Sequence[int | None], out_dims: Sequence[int | None],
                     flops: float, n_params: int = 0) -> list[Signature]:
    """All-full plus the batch-sharded signature when every declared batch dim divides by N."""
    sigs = [all_full(ctx, flops)]
    n_act = len(ctx.inputs) - n_params
    if len(in_dims) != n_act or len(out_dims) != len(ctx.outputs):
        raise Unsupported(f"batch dims {list(in_dims)}/{list(out_dims)} do not match "
                          f"{n_act} tensor inputs / {len(ctx.outputs)} outputs")
    ins, outs = [], []
    for dims_, metas, forms in ((in_dims, ctx.inputs[:n_act], ins), (out_dims, ctx.outputs, outs)):
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
    ins += [FULL] * n_params
    sigs.append(Signature(tuple(ins), tuple(outs), float(flops) / ctx.world, "data"))
    return sigs


def _resolve_dims(spec: DimSpec, ctx: RuleContext, n_in: int, n_out: int, *extra) -> tuple[list, list]:
    if callable(spec):
        spec = spec(*extra, ctx)
    if spec is None:
        spec = 0
    if isinstance(spec, int):
        return [spec] * n_in, [spec] * n_out
    in_dims, out_dims = spec
    return list(in_dims), list(out_dims)


def declare_batch_function(fn: Callable, dims: DimSpec = None, *, flops: float | Callable | None = None) -> Callable:
    """Register ``fn`` (a ``torch.fx.wrap``-ed function) as an opaque op sharded along the batch.

    ``dims``: ``None`` -> dim 0 of every tensor input and output; an int -> that dim of all;
    ``(in_dims, out_dims)`` -> one entry (int or ``None`` = stays full) per tensor input/output;
    or ``callable(ctx) -> (in_dims, out_dims)``.  ``flops``: a number or ``callable(ctx)``.
    Returns ``fn``, so it can be used as a decorator.
    """
    def sigs(ctx: RuleContext) -> list[Signature]:
        in_dims, out_dims = _resolve_dims(dims, ctx, len(ctx.inputs), len(ctx.outputs))
        f = flops(ctx) if callable(flops) else flops
        if f is None:
            f = sum(math.prod(m.shape) for m in ctx.inputs)
        return batch_signatures(ctx, in_dims, out_dims, f)

    _RULES[fn] = Rule(getattr(fn, "__name__", "batch_function"), sigs, None)
    if fn not in _BATCH_FUNCTIONS:
        _BATCH_FUNCTIONS.append(fn)
    return fn


def declare_leaf_module(cls: type, batch_dim_fn: DimSpec, *, flops: float | Callable | None = None) -> None:
    """Register a ``call_module`` leaf class sharded along the batch.

    ``batch_dim_fn(module, ctx) -> (in_dims, out_dims)`` names the batch dim (or ``None``) of each
    tensor arg and output (not the parameters, which stay ``full``); an int means that dim for all.
    The module runs unchanged on every rank.
    """
    def sigs(ctx: RuleContext) -> list[Signature]:
        n_params = len(list(ctx.module.named_parameters()))
        n_act = len(ctx.inputs) - n_params
        in_dims, out_dims = _resolve_dims(batch_dim_fn, ctx, n_act, len(ctx.outputs), ctx.module)
        f = flops(ctx) if callable(flops) else flops
        if f is None:
            f = sum(math.prod(m.shape) for m in ctx.inputs[:n_act])
        return batch_signatures(ctx, in_dims, out_dims, f, n_params)

    register_module(cls, Rule(cls.__name__, sigs, None))
    if cls not in _LEAF_CLASSES:
        _LEAF_CLASSES.append(cls)


# ---------------------------------------------------------------------------------------------
# built-in leaves

_MHA = ["query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
        "is_causal"]


def _mha_dims(module: nn.MultiheadAttention, ctx: RuleContext):
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, _MHA)]
    meta = dict(zip(slots, ctx.inputs))
    q = meta["query"]
    if len(q.shape) != 3:
        raise Unsupported("unbatched MultiheadAttention")
    bd = 0 if module.batch_first else 1
    B = q.shape[bd]
    if B % ctx.world:
        return [None] * len(slots), [None] * len(ctx.outputs)
    dim_of = {"query": bd, "key": bd, "value": bd, "key_padding_mask": 0}
    if "attn_mask" in meta:
        dim_of["attn_mask"] = 0 if len(meta["attn_mask"].shape) == 3 else None
    outs = [bd] + [0] * (len(ctx.outputs) - 1)
    return [dim_of[n] for n in slots], outs


def _attn_flops(ctx: RuleContext) -> float:
    """Projections ``8*B*S*D^2`` (q, k, v, out) plus scores and weighted sum ``4*B*S*L*D``."""
    q, k = ctx.inputs[0], ctx.inputs[1] if len(ctx.inputs) > 1 else ctx.inputs[0]
    D = q.shape[-1]
    if len(q.shape) != 3:
        return 8.0 * q.shape[0] * D * D + 4.0 * q.shape[0] * k.shape[0] * D
    attn = getattr(ctx.module, "self_attn", ctx.module)
    seq = 1 if getattr(attn, "batch_first", False) else 0
    tokens = q.shape[0] * q.shape[1]
    return 8.0 * tokens * D * D + 4.0 * tokens * k.shape[seq] * D


declare_leaf_module(nn.MultiheadAttention, _mha_dims, flops=_attn_flops)

_TEL = ["src", "src_mask", "src_key_padding_mask", "is_causal"]


def _encoder_layer_dims(module: nn.TransformerEncoderLayer, ctx: RuleContext):
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, _TEL)]
    meta = dict(zip(slots, ctx.inputs))
    src = meta["src"]
    if len(src.shape) != 3:
        raise Unsupported("unbatched TransformerEncoderLayer")
    bd = 0 if module.self_attn.batch_first else 1
    if src.shape[bd] % ctx.world:
        return [None] * len(slots), [None]
    dim_of = {"src": bd, "src_key_padding_mask": 0}
    if "src_mask" in meta:
        dim_of["src_mask"] = 0 if len(meta["src_mask"].shape) == 3 else None
    return [dim_of[n] for n in slots], [bd]


def _encoder_flops(ctx: RuleContext) -> float:
    """Self-attention plus the two feed-forward matmuls ``4*B*S*D*F``."""
    x = ctx.inputs[0]
    ff = ctx.module.linear1.out_features if ctx.module is not None else 4 * x.shape[-1]
    tokens = math.prod(x.shape[:-1])
    self_ctx = RuleContext(ctx.target, ctx.args, ctx.kwargs, [x, x], ctx.outputs, ctx.world, ctx.module)
    return _attn_flops(self_ctx) + 4.0 * tokens * x.shape[-1] * ff


declare_leaf_module(nn.TransformerEncoderLayer, _encoder_layer_dims, flops=_encoder_flops)


def _delegate(cls: type, functional: Any, make_args: Callable[[Any, RuleContext], tuple[tuple, dict]]) -> None:
    """A standard module leaf: its functional rule, keeping parameters ``full``."""
    def sigs(ctx: RuleContext) -> list[Signature]:
        rule = lookup(functional)
        args, kwargs = make_args(ctx.module, ctx)
        fctx = RuleContext(functional, args, kwargs, ctx.inputs, ctx.outputs, ctx.world, None, ctx.node_name)
        n_params = len(list(ctx.module.named_parameters()))
        out = []
        for s in rule.signatures(fctx):
            if s.impl or any(f != FULL for f in s.inputs[len(s.inputs) - n_params:]):
                continue
            out.append(s)
        return out

    register_module(cls, Rule(cls.__name__, sigs, None))


def _params(module, ctx):
    n = len(list(module.named_parameters()))
    return list(ctx.inputs[len(ctx.inputs) - n:])


def _linear_args(m, ctx):
    return (ctx.inputs[0], *_params(m, ctx)), {}


def _layer_norm_args(m, ctx):
    ps = dict(zip([n for n, _ in m.named_parameters()], _params(m, ctx)))
    return (ctx.inputs[0], tuple(m.normalized_shape), ps.get("weight"), ps.get("bias")), {}


def _embedding_args(m, ctx):
    return (ctx.inputs[0], *_params(m, ctx), m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq,
            m.sparse), {}


def _conv_args(m, ctx):
    ps = dict(zip([n for n, _ in m.named_parameters()], _params(m, ctx)))
    return (ctx.inputs[0], ps["weight"], ps.get("bias"), m.stride, m.padding, m.dilation, m.groups), {}


def _unary_args(m, ctx):
    if len(ctx.inputs) != 1:
        raise Unsupported(f"{type(m).__name__} with {len(ctx.inputs)} tensor inputs")
    return (ctx.inputs[0],), {}


def _softmax_args(m, ctx):
    return (ctx.inputs[0], m.dim), {}


def _flatten_args(m, ctx):
    return (ctx.inputs[0], m.start_dim, m.end_dim), {}


_delegate(nn.Linear, F.linear, _linear_args)
_delegate(nn.LayerNorm, F.layer_norm, _layer_norm_args)
_delegate(nn.Embedding, F.embedding, _embedding_args)
_delegate(nn.Softmax, F.softmax, _softmax_args)
_delegate(nn.LogSoftmax, F.log_softmax, _softmax_args)
_delegate(nn.Flatten, torch.flatten, _flatten_args)
for _cls, _fn in ((nn.Conv1d, F.conv1d), (nn.Conv2d, F.conv2d), (nn.Conv3d, F.conv3d)):
    _delegate(_cls, _fn, _conv_args)
for _cls in (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Mish, nn.LeakyReLU,
             nn.ELU, nn.Softplus, nn.Hardswish, nn.ReLU6):
    _delegate(_cls, torch.tanh, _unary_args)  # any elementwise rule: one input, same-shaped output

