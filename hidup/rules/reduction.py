"""Reductions over dims: sum/mean (linear) and max/min/amax/amin/logsumexp/var/std/norm/argmax/any/all.

``sum(x, dims)``: a kept dim may be sharded (gathered in and out); a reduced dim may be sharded too,
giving a ``reduce`` output because ``sum_all = sum_r sum_{chunk r}``.  ``mean`` over a sharded
reduced dim of global size ``n`` computes locally ``mean_local * (1/N) = sum_local / n``, so the
partial results again sum to the mean (:func:`scaled_mean`).  Both are linear: ``reduce -> reduce``.

Non-linear reductions (max, logsumexp, var, norm, ...) never shard a reduced dim; their kept dims
may be sharded.  FLOPs: ``numel(input)``.
"""

from __future__ import annotations

import math

import torch

from hidup.ir import Signature
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.elementwise import elementwise_signatures
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, callable_of, register

__all__ = ["scaled_mean", "reduced_dims"]


def scaled_mean(input, dim=None, keepdim=False, *, dtype=None, scale=1.0):  # noqa: A002 - torch.mean's name
    """``mean(input, dim) * scale``: the local part of a mean over a dim split across ranks."""
    if dim is None:
        out = torch.mean(input, dtype=dtype)
    else:
        out = torch.mean(input, dim, keepdim=keepdim, dtype=dtype)
    return out * scale


def reduced_dims(dim, nd: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(nd))
    if isinstance(dim, int):
        return [dim % nd] if nd else []
    return sorted({d % nd for d in dim})


def _bind_reduction(ctx: RuleContext):
    names = ["input", "dim", "keepdim", "dtype"]
    b = bind(ctx.args, ctx.kwargs, names, {"dim": None, "keepdim": False, "dtype": None}, where=str(ctx.target))
    if isinstance(b["dim"], torch.dtype):  # sum(x, torch.float32)
        b["dtype"], b["dim"] = b["dim"], None
    return b


def _reduction_sigs(ctx: RuleContext, dim, keepdim: bool, linear: bool) -> list[Signature]:
    x = ctx.inputs[0]
    nd = len(x.shape)
    red = reduced_dims(dim, nd)
    tin = [f"d{k}" for k in range(nd)]
    tout = []
    for k in range(nd):
        if k not in red:
            tout.append(tin[k])
        elif keepdim:
            tout.append(f"k{k}")
    fixed = {f"k{k}" for k in red}
    if not linear:
        fixed |= {tin[k] for k in red}
    touts = [tout for _ in ctx.outputs]
    for o, m in zip(touts, ctx.outputs):
        if len(o) != len(m.shape):
            raise Unsupported(f"{ctx.target}: output shape {m.shape} does not match reduced dims {red}")
    return shard_signatures(
        [tin],
        touts,
        [x],
        ctx.outputs,
        ctx.world,
        float(math.prod(x.shape)),
        fixed=fixed,
        linear=[(0,)] if linear else (),
        where=str(ctx.target),
    )


@register(torch.sum, "sum", torch.nansum, "nansum", name="sum")
def _sum(ctx: RuleContext) -> list[Signature]:
    b = _bind_reduction(ctx)
    lin = ctx.target in (torch.sum, "sum")
    return _reduction_sigs(ctx, b["dim"], b["keepdim"], lin)


def _mean_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    b = _bind_reduction(ctx)
    f = sig.inputs[0]
    nd = len(ctx.inputs[0].shape)
    if f.is_gather and f.dim in reduced_dims(b["dim"], nd):
        return LocalCall(
            scaled_mean, (ctx.args[0], b["dim"], b["keepdim"]), {"dtype": b["dtype"], "scale": 1.0 / ctx.world}
        )
    return LocalCall(callable_of(ctx.target), tuple(ctx.args), dict(ctx.kwargs))


@register(torch.mean, "mean", name="mean", localize=_mean_localize)
def _mean(ctx: RuleContext) -> list[Signature]:
    b = _bind_reduction(ctx)
    return _reduction_sigs(ctx, b["dim"], b["keepdim"], True)


@register(
    torch.amax,
    torch.amin,
    torch.logsumexp,
    torch.argmax,
    torch.argmin,
    torch.any,
    torch.all,
    torch.max,
    torch.min,
    torch.prod,
    "amax",
    "amin",
    "logsumexp",
    "argmax",
    "argmin",
    "any",
    "all",
    "max",
    "min",
    "prod",
    name="reduce_nonlinear",
)
def _nonlinear(ctx: RuleContext) -> list[Signature]:
    if len(ctx.inputs) == 2:  # torch.max(a, b): elementwise
        return elementwise_signatures(ctx)
    names = ["input", "dim", "keepdim"]
    b = bind(ctx.args, ctx.kwargs, names + ["dtype", "out"], {"dim": None, "keepdim": False}, where=str(ctx.target))
    return _reduction_sigs(ctx, b["dim"], b["keepdim"], False)


@register(torch.var, torch.std, "var", "std", torch.norm, "norm", name="reduce_moment")
def _moment(ctx: RuleContext) -> list[Signature]:
    if ctx.target in (torch.norm, "norm"):
        b = bind(
            ctx.args,
            ctx.kwargs,
            ["input", "p", "dim", "keepdim", "dtype"],
            {"p": "fro", "dim": None, "keepdim": False},
            where="norm",
        )
    else:
        b = bind(
            ctx.args,
            ctx.kwargs,
            ["input", "dim", "unbiased", "keepdim", "correction"],
            {"dim": None, "keepdim": False},
            where=str(ctx.target),
        )
        if isinstance(b["dim"], bool):  # var(x, unbiased)
            b["dim"] = None
    return _reduction_sigs(ctx, b["dim"], b["keepdim"], False)
