"""Scaled dot-product attention.

``sdpa(q[..., H, S, E], k[..., H, L, E], v[..., H, L, F], mask[..., S, L]) -> out[..., H, S, F]``:
each (batch, head) pair is independent, so any leading dim may be sharded -- the batch dims are
``data`` parallel, the head dim (third from last) ``tensor`` parallel (Megatron's attention
split).  The sequence dims ``S``/``L`` (softmax over ``L``, causal structure over ``S``) and the
head dims ``E``/``F`` (contracted inside a softmax) are never sharded.  The mask broadcasts like a
numpy operand: a mask with a size-1 (or missing) batch/head dim stays ``full``.  With grouped-query
attention (``enable_gqa`` and fewer key/value heads) only batch dims are sharded.

FLOPs: ``2 * B * H * S * L * (E + F)`` (the two matmuls; the softmax is lower order).

Dropout (``dropout_p > 0``): the rank runs :func:`hidup.rules.random.attention`, the attention written
out with the single device's dropout mask on its block of the weights ``[..., H, S, L]``; the blocks
are cut on the batch and head dims only, which are the output's, so the output form places the block.

Variant (:func:`hidup.rules.variant`): ``masked`` when a mask tensor is given (torch's attention then
runs a kernel that reads it, and ``transformers`` models pass their causal mask this way when
exported), ``causal`` for ``is_causal=True`` without one (the kernel skips the key blocks above the
diagonal), else ``dense``: the kernels differ in speed by more than a FLOP count shows, so the cost
model prices each from its own measured times (:mod:`hidup.profiler.attention`).
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules import random
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, default_localize, register, tensor_slots

__all__ = []

_NAMES = random.SDPA_NAMES + list(random.PROGRAM_KWARGS)


def _localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """The fused op; with dropout, the attention written out with the single device's mask."""
    b = bind(ctx.args, ctx.kwargs, _NAMES, {"dropout_p": 0.0}, where="scaled_dot_product_attention")
    if not b["dropout_p"]:
        return default_localize(ctx, sig, rank)
    q, k = ctx.inputs[0].shape, ctx.inputs[1].shape  # query and key are its first tensor arguments
    here = tuple(q[:-1]) + (k[-2],)
    shape = tuple(b.get("shape") or here)
    offset = random.advanced(b.get("offset") or (0,) * len(here), here, sig.outputs[0], rank, ctx.world)
    kwargs = {n: b[n] for n in random.SDPA_NAMES[3:] if n in b}
    kwargs.update({k_: b[k_] for k_ in random.PROGRAM_KWARGS[2:] if k_ in b}, shape=shape, offset=offset)
    return LocalCall(random.attention, (b["query"], b["key"], b["value"]), kwargs)


def _variant(ctx: RuleContext) -> str:
    bound = bind(ctx.args, ctx.kwargs, _NAMES, where="scaled_dot_product_attention")
    if any(n == "attn_mask" for n, _ in tensor_slots(ctx.args, ctx.kwargs, _NAMES)):
        return "masked"
    return "causal" if bound.get("is_causal") is True else "dense"


@register(
    F.scaled_dot_product_attention,
    random.attention,
    name="scaled_dot_product_attention",
    variant=_variant,
    localize=_localize,
)
def _sdpa(ctx: RuleContext) -> list[Signature]:
    bind(ctx.args, ctx.kwargs, _NAMES, where="scaled_dot_product_attention")
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, _NAMES)]
    meta = dict(zip(slots, ctx.inputs))
    q, k, v = meta["query"], meta["key"], meta["value"]
    nq = len(q.shape)
    if nq < 3 or len(k.shape) != nq or len(v.shape) != nq:
        raise Unsupported("scaled_dot_product_attention: q/k/v need the same rank, at least 3")
    lead = [f"b{j}" for j in range(nq - 3)]
    heads = "h"
    kv_heads = heads if k.shape[-3] == q.shape[-3] else "g"
    tok = {
        "query": lead + [heads, "s", "e"],
        "key": lead + [kv_heads, "l", "e"],
        "value": lead + [kv_heads, "l", "f"],
    }
    full_mask = lead + [heads, "s", "l"]
    if "attn_mask" in meta:
        tok["attn_mask"] = full_mask[nq - len(meta["attn_mask"].shape) :]
    tin = [tok[n] for n in slots]
    tout = [lead + [heads, "s", "f"]]
    fixed = {"s", "l", "e", "f", "g"}
    if kv_heads != heads:
        fixed.add(heads)
    B = math.prod(q.shape[:-2])
    flops = 2.0 * B * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return shard_signatures(
        tin,
        tout,
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        flops,
        fixed=fixed,
        kinds={heads: "tensor"},
        where="scaled_dot_product_attention",
    )
