"""Convolutions (conv1d/2d/3d), e.g. a ViT patch embedding.

``out[b, o, p] = sum_{c, k} x[b, c, p*stride + k*dilation - pad] * W[o, c, k] + bias[o]``:

* batch ``b``: ``x gather_0 -> out gather_0``, ``W``/``bias`` full                      (data)
* out channels ``o``: ``W gather_0, bias gather_0 -> out gather_1``, ``x`` full          (tensor)
* in channels ``c`` (a contraction; ``groups == 1`` only): ``x gather_1, W gather_1, bias
  reduce -> out reduce`` -- the bias enters once through the ``reduce`` form     (tensor)
* reduce propagation: ``x reduce`` (with ``bias reduce``) -> ``reduce``; conv is linear in ``x``.

Spatial dims are never sharded (a kernel window crosses the slice boundary).  With ``groups > 1``
only the batch is sharded.  FLOPs: ``2 * numel(out) * C_in/groups * prod(kernel)`` (+ ``numel(out)``
for the bias).
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, register, tensor_slots

__all__ = []

_NAMES = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]


@register(F.conv1d, F.conv2d, F.conv3d, name="conv")
def _conv(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, _NAMES, {"bias": None, "groups": 1}, where=str(ctx.target))
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, _NAMES)]
    meta = dict(zip(slots, ctx.inputs))
    x, w = meta["input"], meta["weight"]
    nsp = len(w.shape) - 2
    batched = len(x.shape) == nsp + 2
    if not batched and len(x.shape) != nsp + 1:
        raise Unsupported("conv: input rank does not match the weight")
    lead = ["b"] if batched else []
    tok = {
        "input": lead + ["c"] + [f"x{j}" for j in range(nsp)],
        "weight": ["o", "c"] + [f"k{j}" for j in range(nsp)],
        "bias": ["o"],
    }
    tout = [lead + ["o"] + [f"y{j}" for j in range(nsp)]]
    fixed = {f"x{j}" for j in range(nsp)} | {f"k{j}" for j in range(nsp)} | {f"y{j}" for j in range(nsp)}
    if b["groups"] != 1:
        fixed |= {"c", "o"}
        tok["weight"] = ["o", "cg"] + tok["weight"][2:]
        fixed.add("cg")
    tin = [tok[n] for n in slots]
    xi = slots.index("input")
    if "bias" in slots:
        bi = slots.index("bias")
        linear, additive = [(xi, bi)], [bi]
    else:
        linear, additive = [(xi,)], []
    out = ctx.outputs[0]
    flops = 2.0 * math.prod(out.shape) * math.prod(w.shape[1:])
    if "bias" in slots:
        flops += math.prod(out.shape)
    return shard_signatures(tin, tout, ctx.inputs, ctx.outputs, ctx.world, flops, fixed=fixed,
                            linear=linear, additive=additive, where=str(ctx.target))
