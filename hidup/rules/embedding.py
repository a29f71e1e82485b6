"""Embedding lookup ``out[..., :] = W[ids[...], :]`` in the notation ``"..., vd -> ...d"``.

* any dim of ``ids`` (batch, sequence): ``ids gather_i, W full -> out gather_i``  (data)
* the embedding dim ``d``: ``ids full, W gather_1 -> out gather_last``             (tensor)
* the vocabulary ``v`` (formally a contracted letter: ``out = sum_v onehot(ids)_v W_v``):
  ``ids full, W gather_0 -> out reduce`` (tensor), run by :func:`vocab_parallel_embedding`: rank r
  owns rows ``[r*V/N, (r+1)*V/N)`` and contributes the rows of the ids that fall in its range and
  zeros for the others, so the partial outputs sum to the lookup.  Backward: the output gradient
  is exact on every rank and each rank scatters it into its own rows only.

``max_norm`` renormalizes rows in place from the whole row: all-``full`` only.
``scale_grad_by_freq`` counts ids over the whole batch: no batch sharding.
FLOPs: ``numel(out)`` (a gather, memory bound).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.notation import dims
from hidup.rules.registry import Unsupported, all_full, bind, callable_of, register, tensor_slots

__all__ = ["vocab_parallel_embedding"]

_NAMES = ["input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"]


def vocab_parallel_embedding(
    input: torch.Tensor,  # noqa: A002 - F.embedding's name
    weight: torch.Tensor,
    start: int,
    padding_idx=None,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """Rows ``[start, start + weight.shape[0])`` of a vocabulary-sharded embedding.

    Ids outside the local range give zero rows, so the sum over ranks is the full lookup.
    ``padding_idx`` is a global (non-negative) row id.
    """
    n = weight.shape[0]
    local = input - start
    inside = (local >= 0) & (local < n)
    local = torch.where(inside, local, torch.zeros_like(local))
    pad = None
    if padding_idx is not None and start <= padding_idx < start + n:
        pad = padding_idx - start
    out = F.embedding(local, weight, pad, None, 2.0, scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)


def _bound(ctx: RuleContext) -> dict:
    return bind(
        ctx.args,
        ctx.kwargs,
        _NAMES,
        {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False},
        where="embedding",
    )


def _localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    if sig.impl != "vocab_parallel":
        return LocalCall(callable_of(ctx.target), tuple(ctx.args), dict(ctx.kwargs))
    b = bind(
        ctx.args,
        ctx.kwargs,
        _NAMES,
        {"padding_idx": None, "scale_grad_by_freq": False, "sparse": False},
        where="embedding",
    )
    vocab = ctx.inputs[1].shape[0]
    pad = b["padding_idx"]
    if pad is not None and pad < 0:
        pad += vocab
    start = rank * (vocab // ctx.world)
    return LocalCall(
        vocab_parallel_embedding,
        (b["input"], b["weight"], start),
        {"padding_idx": pad, "scale_grad_by_freq": b["scale_grad_by_freq"], "sparse": b["sparse"]},
    )


@register(F.embedding, name="embedding", localize=_localize)
def _embedding(ctx: RuleContext) -> list[Signature]:
    b = _bound(ctx)
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, _NAMES)]
    if slots != ["input", "weight"] or len(ctx.inputs[1].shape) != 2:
        raise Unsupported("embedding: expected (ids, 2-D weight)")
    flops = float(math.prod(ctx.outputs[0].shape))
    if b["max_norm"] is not None:
        return [all_full(ctx, flops)]
    sigs = dims("..., vd -> ...d").signatures(ctx.inputs, ctx.outputs, ctx.world, flops)
    out = []
    for s in sigs:
        if s.inputs[1].is_gather and s.inputs[1].dim == 0:
            s = replace(s, impl="vocab_parallel")
        elif b["scale_grad_by_freq"] and s.inputs[0].is_gather:
            continue
        out.append(s)
    return out
