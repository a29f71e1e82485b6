"""Convolutions (conv1d/2d/3d, ``torch.convolution``), e.g. a ViT patch embedding.

``out[b, o, p] = sum_{c, k} x[b, c, p*stride + k*dilation - pad] * W[o, c, k] + bias[o]``
(a transposed convolution scatters instead of gathers along the spatial dims and stores its
weight as ``W[c, o, k]``; in both it is a sum over the in-channels ``c``, linear in ``x`` and in
``W``):

* batch ``b``: ``x gather_0 -> out gather_0``, ``W``/``bias`` full                      (data)
* out channels ``o``: ``W gather_0, bias gather_0 -> out gather_1``, ``x`` full          (tensor)
  (``W gather_1`` for a transposed convolution)
* in channels ``c`` (a contraction; ``groups == 1`` only): ``x gather_1, W gather_1, bias
  reduce -> out reduce`` -- the bias enters once through the ``reduce`` form     (tensor)
  (``W gather_0`` for a transposed convolution)
* reduce propagation: ``x reduce`` (with ``bias reduce``) -> ``reduce``; conv is linear in ``x``.

Spatial dims are never sharded (a kernel window crosses the slice boundary).  With ``groups > 1``
only the batch is sharded.  FLOPs: ``2 * numel(out) * C_in/groups * prod(kernel)`` for a
convolution, ``2 * numel(x) * C_out/groups * prod(kernel)`` for a transposed one (+ ``numel(out)``
for the bias).

``torch.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
groups)`` is the torch function of ``aten.convolution`` (:mod:`hidup.rules.aten`; ``aten.conv2d``
and its siblings map onto ``F.conv2d``); ``transposed`` picks the weight layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, register, tensor_slots

__all__ = []

_NAMES = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
_CONVOLUTION_NAMES = [
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "dilation",
    "transposed",
    "output_padding",
    "groups",
]


def _conv_sigs(ctx: RuleContext, names: list[str], transposed: bool, groups: int) -> list[Signature]:
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, names)]
    meta = dict(zip(slots, ctx.inputs))
    if "input" not in meta or "weight" not in meta:
        raise Unsupported(f"{ctx.target}: input or weight is not a tensor")
    x, w = meta["input"], meta["weight"]
    nsp = len(w.shape) - 2
    batched = len(x.shape) == nsp + 2
    if not batched and len(x.shape) != nsp + 1:
        raise Unsupported("conv: input rank does not match the weight")
    lead = ["b"] if batched else []
    kernel = [f"k{j}" for j in range(nsp)]
    tok = {
        "input": lead + ["c"] + [f"x{j}" for j in range(nsp)],
        "weight": (["c", "o"] if transposed else ["o", "c"]) + kernel,
        "bias": ["o"],
    }
    tout = [lead + ["o"] + [f"y{j}" for j in range(nsp)]]
    fixed = {f"x{j}" for j in range(nsp)} | set(kernel) | {f"y{j}" for j in range(nsp)}
    if groups != 1:
        # the grouped weight dim holds C/groups channels of each group: neither channel dim splits
        fixed |= {"c", "o", "cg"}
        tok["weight"] = (["c", "cg"] if transposed else ["o", "cg"]) + kernel
    tin = [tok[n] for n in slots]
    xi = slots.index("input")
    if "bias" in slots:
        bi = slots.index("bias")
        linear, additive = [(xi, bi)], [bi]
    else:
        linear, additive = [(xi,)], []
    out = ctx.outputs[0]
    if transposed:  # every input element is multiplied by a C_out/groups x kernel slice of W
        flops = 2.0 * math.prod(x.shape) * math.prod(w.shape[1:])
    else:
        flops = 2.0 * math.prod(out.shape) * math.prod(w.shape[1:])
    if "bias" in slots:
        flops += math.prod(out.shape)
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


@register(F.conv1d, F.conv2d, F.conv3d, name="conv")
def _conv(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, _NAMES, {"bias": None, "groups": 1}, where=str(ctx.target))
    return _conv_sigs(ctx, _NAMES, False, b["groups"])


@register(torch.convolution, name="convolution")
def _convolution(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, _CONVOLUTION_NAMES, where=str(ctx.target))
    missing = [n for n in _CONVOLUTION_NAMES if n not in b]
    if missing:
        raise Unsupported(f"{ctx.target}: arguments {missing} missing")
    return _conv_sigs(ctx, _CONVOLUTION_NAMES, bool(b["transposed"]), b["groups"])
