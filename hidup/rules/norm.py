"""Normalizations: layer_norm, rms_norm, softmax/log_softmax, normalize.

Each normalizes over some dims with a non-linear statistic (mean/variance, max/sum of exp), so
those dims are never sharded; every other dim is independent and may be sharded.  The affine
weight/bias of layer_norm/rms_norm are indexed by the normalized dims only, so they stay ``full``
under every signature; their gradients come out as per-rank partial sums over the local rows,
which is the ``full`` gradient convention.  None of these ops is linear: no ``reduce`` forms.

FLOPs: ``5 * numel`` (layer_norm, rms_norm, softmax, log_softmax, normalize).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, register, tensor_slots

__all__ = ["normalized_signatures"]


def normalized_signatures(
    ctx: RuleContext, norm_dims: list[int], affine_names: dict[int, str] | None = None
) -> list[Signature]:
    """``ctx.inputs[0]`` normalized over ``norm_dims`` (non-negative); other inputs are affine
    parameters indexed by the trailing normalized dims; outputs have the input's shape."""
    x = ctx.inputs[0]
    nd = len(x.shape)
    tin0 = [f"d{k}" for k in range(nd)]
    fixed = {tin0[k] for k in norm_dims}
    tins = [tin0]
    for m in ctx.inputs[1:]:
        tins.append(tin0[nd - len(m.shape) :])
    touts = [tin0[nd - len(m.shape) :] for m in ctx.outputs]
    return shard_signatures(
        tins,
        touts,
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        5.0 * math.prod(x.shape),
        fixed=fixed,
        where=str(getattr(ctx.target, "__name__", ctx.target)),
    )


@register(F.layer_norm, torch.layer_norm, name="layer_norm")
def _layer_norm(ctx: RuleContext) -> list[Signature]:
    names = ["input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"]
    b = bind(ctx.args, ctx.kwargs, names, {"weight": None, "bias": None}, where="layer_norm")
    if [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, names)][0] != "input":
        raise Unsupported("layer_norm: input is not the first tensor")
    k = len(b["normalized_shape"]) if isinstance(b["normalized_shape"], (list, tuple)) else 1
    nd = len(ctx.inputs[0].shape)
    return normalized_signatures(ctx, list(range(nd - k, nd)))


if hasattr(F, "rms_norm"):

    @register(F.rms_norm, name="rms_norm")
    def _rms_norm(ctx: RuleContext) -> list[Signature]:
        names = ["input", "normalized_shape", "weight", "eps"]
        b = bind(ctx.args, ctx.kwargs, names, {"weight": None}, where="rms_norm")
        k = len(b["normalized_shape"]) if isinstance(b["normalized_shape"], (list, tuple)) else 1
        nd = len(ctx.inputs[0].shape)
        return normalized_signatures(ctx, list(range(nd - k, nd)))


@register(F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax", name="softmax")
def _softmax(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "_stacklevel", "dtype"], {"dim": None}, where="softmax")
    if b["dim"] is None:
        raise Unsupported("softmax without an explicit dim")
    nd = len(ctx.inputs[0].shape)
    return normalized_signatures(ctx, [b["dim"] % nd] if nd else [])


@register(F.normalize, name="normalize")
def _normalize(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "p", "dim", "eps", "out"], {"dim": 1}, where="normalize")
    nd = len(ctx.inputs[0].shape)
    return normalized_signatures(ctx, [b["dim"] % nd] if nd else [])
