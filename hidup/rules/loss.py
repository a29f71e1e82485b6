"""Classification losses: cross_entropy and nll_loss.

``loss_i = l(input[i, :, ...], target[i, ...])`` is independent per sample (and per extra
spatial/sequence position); the class dim ``C`` is never sharded (log-softmax over it).

* ``reduction="none"``: sample dims sharded -> output ``gather`` on the same dim.
* ``reduction="sum"``: sample dims sharded -> output ``reduce`` (``sum_i = sum_r sum_{i in r}``).
* ``reduction="mean"``: all-``full`` only -- the divisor (the number of non-ignored targets, or
  the sum of their class weights) is a global, data-dependent quantity.

Class weights (``weight[C]``) stay ``full``.  FLOPs: ``5 * numel(input)`` for cross_entropy
(log-softmax + pick), ``numel(target)`` for nll_loss.
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, all_full, bind, register, tensor_slots

__all__ = []

_CE = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
_NLL = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"]


def _loss_sigs(ctx: RuleContext, names: list[str], flops: float) -> list[Signature]:
    b = bind(
        ctx.args,
        ctx.kwargs,
        names,
        {"weight": None, "size_average": None, "reduce": None, "reduction": "mean"},
        where=str(ctx.target),
    )
    if b["size_average"] is not None or b["reduce"] is not None:
        raise Unsupported("loss with the deprecated size_average/reduce arguments")
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, names)]
    meta = dict(zip(slots, ctx.inputs))
    x = meta["input"]
    if b["reduction"] == "mean" or len(x.shape) < 2:
        return [all_full(ctx, flops)]
    if b["reduction"] not in ("sum", "none"):
        raise Unsupported(f"unknown reduction {b['reduction']!r}")
    nd = len(x.shape)
    xt = ["n", "c"] + [f"d{k}" for k in range(nd - 2)]
    tt = xt if meta["target"].shape == x.shape else [xt[0]] + xt[2:]
    tok = {"input": xt, "target": tt, "weight": ["c"]}
    tin = [tok[n] for n in slots]
    tout = [[xt[0]] + xt[2:]] if b["reduction"] == "none" else [[]]
    return shard_signatures(tin, tout, ctx.inputs, ctx.outputs, ctx.world, flops, fixed={"c"}, where=str(ctx.target))


@register(F.cross_entropy, name="cross_entropy")
def _cross_entropy(ctx: RuleContext) -> list[Signature]:
    return _loss_sigs(ctx, _CE, 5.0 * math.prod(ctx.inputs[0].shape))


@register(F.nll_loss, name="nll_loss")
def _nll_loss(ctx: RuleContext) -> list[Signature]:
    return _loss_sigs(ctx, _NLL, float(math.prod(ctx.inputs[1].shape)))
