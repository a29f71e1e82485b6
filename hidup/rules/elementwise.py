"""Elementwise ops (unary, binary, ternary; with broadcasting and Python scalars) and factories.

All tensor operands broadcast numpy-style to the output: spec ``"..., ... -> ..."``.  Sharding an
output dim splits every operand that has it with size > 1; a size-1 (or missing) dim broadcasts and
that operand stays ``full``.  Backward: a broadcast operand's gradient is the sum of the output
gradient over the broadcast dims, so on each rank it is the sum over the local slice -- a partial
contribution, exactly what the ``full`` gradient convention asks for.

Reduce propagation (``f(sum_r a_r) = sum_r f(a_r)``) holds only where the op is linear:
``add/sub`` of two tensors (both ``reduce``), ``mul`` (one operand ``reduce``, the other ``full``),
``div`` by a full tensor or a scalar, ``neg``, floating casts, ``masked_fill(x, m, 0)``,
``where(c, x, y)``, ``tril/triu``, ``cumsum``.  ``x + 1`` or ``relu(x)`` are not linear.

FLOPs: ``numel(output)`` per elementwise op (a few per element for transcendental functions would
not change any decision).  Dropout has its own rule (:mod:`hidup.rules.random`): its mask is drawn
as on one device.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from hidup.ir import FULL, REDUCE, Signature, gather
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import FLOAT_DTYPES, Unsupported, all_full, bind, callable_of, register, tensor_slots

__all__ = ["elementwise_signatures"]


def _numel(shape) -> int:
    return math.prod(shape)


def elementwise_signatures(
    ctx: RuleContext, linear=(), fixed_last: int = 0, fixed_dims=(), additive=()
) -> list[Signature]:
    """Signatures of a broadcasting elementwise op over ``ctx.inputs`` -> ``ctx.outputs``.

    ``additive`` operands (the terms of a sum) may join a reduce-propagating set even when they
    are parameters: a parameter becomes ``reduce`` for free (rank 0 keeps it, the others add 0).

    ``fixed_last`` trailing output dims (and any of ``fixed_dims``, negative indices) are never
    sharded (``tril``'s matrix dims, ``cumsum``'s dim).
    """
    if not ctx.outputs:
        raise Unsupported("elementwise op without a tensor output")
    width = max(len(m.shape) for m in list(ctx.inputs) + list(ctx.outputs))
    toks = [f"d{j}" for j in range(width)]
    fixed = set(toks[width - fixed_last :]) if fixed_last else set()
    fixed |= {toks[width + d] if d < 0 else toks[width - len(ctx.outputs[0].shape) + d] for d in fixed_dims}
    tin = [toks[width - len(m.shape) :] for m in ctx.inputs]
    tout = [toks[width - len(m.shape) :] for m in ctx.outputs]
    flops = sum(_numel(m.shape) for m in ctx.outputs)
    return shard_signatures(
        tin,
        tout,
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        flops,
        fixed=fixed,
        linear=linear,
        additive=additive,
        where=str(ctx.target),
    )


def _is_scalar_zero(v) -> bool:
    return isinstance(v, (int, float, bool)) and not isinstance(v, bool) and v == 0


# ---------------------------------------------------------------------------------------------
# unary ops: nonlinear and linear

_UNARY_NONLINEAR = [
    torch.tanh,
    torch.sigmoid,
    torch.exp,
    torch.log,
    torch.sqrt,
    torch.rsqrt,
    torch.abs,
    torch.sin,
    torch.cos,
    torch.erf,
    torch.square,
    torch.reciprocal,
    torch.log1p,
    torch.expm1,
    torch.relu,
    torch.sign,
    torch.isnan,
    torch.isinf,
    torch.logical_not,
    torch.clamp,
    torch.clip,
    torch.pow,
    torch.nan_to_num,
    torch.nn.functional.gelu,
    F.relu,
    F.silu,
    F.sigmoid,
    F.tanh,
    F.softplus,
    F.elu,
    F.leaky_relu,
    F.mish,
    F.hardtanh,
    F.hardswish,
    F.relu6,
    F.selu,
    F.logsigmoid,
    operator.pow,
    operator.invert,
    operator.not_,
    "tanh",
    "sigmoid",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "abs",
    "sin",
    "cos",
    "erf",
    "square",
    "reciprocal",
    "log1p",
    "expm1",
    "relu",
    "sign",
    "isnan",
    "isinf",
    "logical_not",
    "clamp",
    "clip",
    "pow",
    "nan_to_num",
    "bool",
    "long",
    "int",
    "__invert__",
]


@register(*_UNARY_NONLINEAR, name="elementwise")
def _unary(ctx: RuleContext) -> list[Signature]:
    return elementwise_signatures(ctx)


_UNARY_LINEAR = [
    operator.neg,
    torch.neg,
    "neg",
    operator.pos,
    torch.positive,
    "contiguous",
    "clone",
    torch.clone,
    "detach",
    torch.detach,
]


@register(*_UNARY_LINEAR, name="elementwise_linear")
def _unary_linear(ctx: RuleContext) -> list[Signature]:
    return elementwise_signatures(ctx, linear=[(0,)] if len(ctx.inputs) == 1 else ())


_FLOAT_CASTS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16"}


@register(*_FLOAT_CASTS, name="cast")
def _cast(ctx: RuleContext) -> list[Signature]:
    return elementwise_signatures(ctx, linear=[(0,)])


@register("to", "type", "type_as", name="to")
def _to(ctx: RuleContext) -> list[Signature]:
    """``x.to(dtype/device/other)``: elementwise; linear when the result is floating."""
    if len(ctx.inputs) == 2 and ctx.inputs[1].shape != ctx.inputs[0].shape:
        # ``type_as(other)`` / ``to(other)`` only read ``other``'s dtype: give it its own fixed dims
        tin = [[f"d{j}" for j in range(len(ctx.inputs[0].shape))], [f"o{j}" for j in range(len(ctx.inputs[1].shape))]]
        tout = [tin[0]]
        return shard_signatures(
            tin,
            tout,
            ctx.inputs,
            ctx.outputs,
            ctx.world,
            _numel(ctx.outputs[0].shape),
            fixed={f"o{j}" for j in range(len(ctx.inputs[1].shape))},
            linear=[(0,)] if ctx.outputs[0].dtype in FLOAT_DTYPES else (),
            where="to",
        )
    lin = ()
    if ctx.outputs[0].dtype in FLOAT_DTYPES and ctx.inputs[0].dtype in FLOAT_DTYPES:
        lin = [tuple(range(len(ctx.inputs)))]
    return elementwise_signatures(ctx, linear=lin)


# ---------------------------------------------------------------------------------------------
# binary ops


def _binary_roles(ctx: RuleContext) -> tuple[dict, dict]:
    b = bind(ctx.args, ctx.kwargs, ["input", "other", "alpha"], {"alpha": 1}, where=str(ctx.target))
    slots = tensor_slots(ctx.args, ctx.kwargs, ["input", "other", "alpha"])
    idx = {name: i for i, (name, _) in enumerate(slots)}
    return b, idx


@register(
    operator.add,
    operator.sub,
    torch.add,
    torch.sub,
    torch.subtract,
    "add",
    "sub",
    "__add__",
    "__sub__",
    operator.iadd,
    operator.isub,
    name="add",
)
def _add(ctx: RuleContext) -> list[Signature]:
    b, idx = _binary_roles(ctx)
    lin = ()
    if "input" in idx and "other" in idx:
        lin = [(idx["input"], idx["other"])]
    elif _is_scalar_zero(b.get("other")) or _is_scalar_zero(b.get("input")):
        lin = [(0,)]
    return elementwise_signatures(ctx, linear=lin, additive=tuple(range(len(ctx.inputs))))


@register(operator.mul, torch.mul, torch.multiply, "mul", "__mul__", "__rmul__", operator.imul, name="mul")
def _mul(ctx: RuleContext) -> list[Signature]:
    _binary_roles(ctx)  # rejects unexpected arguments
    lin = [(i,) for i in range(len(ctx.inputs))]
    return elementwise_signatures(ctx, linear=lin)


@register(
    operator.truediv,
    torch.div,
    torch.true_divide,
    torch.divide,
    "div",
    "true_divide",
    "__truediv__",
    operator.itruediv,
    name="div",
)
def _div(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "other", "rounding_mode"], {"rounding_mode": None}, where=str(ctx.target))
    slots = tensor_slots(ctx.args, ctx.kwargs, ["input", "other", "rounding_mode"])
    idx = {name: i for i, (name, _) in enumerate(slots)}
    lin = [(idx["input"],)] if "input" in idx and b["rounding_mode"] is None else ()
    return elementwise_signatures(ctx, linear=lin)


_BINARY_NONLINEAR = [
    torch.maximum,
    torch.minimum,
    torch.eq,
    torch.ne,
    torch.lt,
    torch.le,
    torch.gt,
    torch.ge,
    torch.logical_and,
    torch.logical_or,
    torch.atan2,
    torch.floor_divide,
    torch.remainder,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.floordiv,
    operator.mod,
    operator.and_,
    operator.or_,
    operator.xor,
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "__and__",
    "__or__",
    "floor_divide",
    "remainder",
]


@register(*_BINARY_NONLINEAR, name="elementwise_binary")
def _binary(ctx: RuleContext) -> list[Signature]:
    return elementwise_signatures(ctx)


@register(torch.masked_fill, "masked_fill", name="masked_fill")
def _masked_fill(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "mask", "value"], where="masked_fill")
    lin = [(0,)] if _is_scalar_zero(b.get("value")) else ()
    return elementwise_signatures(ctx, linear=lin)


@register(torch.where, "where", name="where")
def _where(ctx: RuleContext) -> list[Signature]:
    if ctx.target == "where":
        b = bind(ctx.args, ctx.kwargs, ["input", "condition", "other"], where="where")
        names = ["input", "condition", "other"]
    else:
        b = bind(ctx.args, ctx.kwargs, ["condition", "input", "other"], where="where")
        names = ["condition", "input", "other"]
    slots = tensor_slots(ctx.args, ctx.kwargs, names)
    idx = {n: i for i, (n, _) in enumerate(slots)}
    if "condition" not in idx:
        raise Unsupported("torch.where without a condition tensor")
    group = tuple(idx[n] for n in ("input", "other") if n in idx)
    ok = all(n in idx or _is_scalar_zero(b.get(n)) for n in ("input", "other"))
    return elementwise_signatures(ctx, linear=[group] if ok and group else ())


@register(torch.tril, torch.triu, "tril", "triu", name="tril")
def _tril(ctx: RuleContext) -> list[Signature]:
    return elementwise_signatures(ctx, linear=[(0,)], fixed_last=2)


@register(torch.cumsum, "cumsum", name="cumsum")
def _cumsum(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "dtype"], where="cumsum")
    nd = len(ctx.outputs[0].shape)
    d = b["dim"] % nd if nd else 0
    return elementwise_signatures(ctx, linear=[(0,)], fixed_dims=[d - nd] if nd else ())


# ---------------------------------------------------------------------------------------------
# factories


@register(
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.eye,
    torch.linspace,
    torch.tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    name="factory",
)
def _factory(ctx: RuleContext) -> list[Signature]:
    """Constant or random tensors built from Python values: all ranks build the whole tensor."""
    return [all_full(ctx, 0.0)]


def _like_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """``new_*``: the size argument becomes the local output shape; ``*_like`` runs unchanged."""
    if not isinstance(ctx.target, str) or ctx.target == "new_tensor":
        return LocalCall(callable_of(ctx.target), tuple(ctx.args), dict(ctx.kwargs))
    local = tuple(sig.outputs[0].local_shape(ctx.outputs[0].shape, ctx.world))
    args, kwargs = list(ctx.args), dict(ctx.kwargs)
    if "size" in kwargs:
        kwargs["size"] = local
        return LocalCall(callable_of(ctx.target), tuple(args), kwargs)
    if ctx.target == "new_full":  # new_full(size, fill_value)
        return LocalCall(callable_of(ctx.target), (args[0], local) + tuple(args[2:]), kwargs)
    return LocalCall(callable_of(ctx.target), (args[0], local), kwargs)  # new_zeros(*size) / (size)


@register(
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.empty_like,
    torch.rand_like,
    torch.randn_like,
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "new_tensor",
    name="like_factory",
    localize=_like_localize,
)
def _like(ctx: RuleContext) -> list[Signature]:
    """A tensor built from another's shape/dtype (not its values).

    ``*_like(x)``: the output follows ``x``'s ``full`` or ``gather`` form (the local call builds the
    local shape from the local ``x``); a ``reduce`` ``x`` gives a ``full`` output.  ``x.new_*``:
    the output may take any ``gather`` form (its shape argument becomes the local shape) or
    ``full``; ``x`` is read only for dtype and device, in any form.
    """
    out = ctx.outputs[0]
    x = ctx.inputs[0]
    sigs = [all_full(ctx, 0.0)]
    extra_in = tuple(FULL for _ in ctx.inputs[1:])
    if isinstance(ctx.target, str):  # new_*: shape given explicitly
        if ctx.target == "new_tensor":
            return sigs
        for d, s in enumerate(out.shape):
            if s > 1 and s % ctx.world == 0:
                sigs.append(Signature((FULL,) + extra_in, (gather(d),), 0.0, "data"))
        for d, s in enumerate(x.shape):
            if s > 1 and s % ctx.world == 0:
                sigs.append(Signature((gather(d),) + extra_in, (FULL,), 0.0, "data"))
        if x.dtype != "bool":
            sigs.append(Signature((REDUCE,) + extra_in, (FULL,), 0.0, "data"))
        return sigs
    for d, s in enumerate(x.shape):
        if s > 1 and s % ctx.world == 0:
            sigs.append(Signature((gather(d),) + extra_in, (gather(d),), 0.0, "data"))
    if x.dtype != "bool":
        sigs.append(Signature((REDUCE,) + extra_in, (FULL,), 0.0, "data"))
    return sigs
