"""ATen operators, as ``torch.export`` records them, mapped onto the rules of their torch functions.

An exported training step is a graph of ATen overloads (``aten.linear.default``,
``aten.cross_entropy_loss.default``, ``aten.view.default``, ...).  Almost every one of them is the
torch function a rule already describes, with its arguments in another order or encoding
(``aten.embedding(weight, indices)`` is ``F.embedding(indices, weight)``; ``aten.cross_entropy_loss``
takes ``reduction`` as an int).  Each entry here names that torch function and a *binder* that
rewrites the ATen call's arguments into the torch function's.  Nothing about sharding is restated:

* ``signatures``: every tensor argument is replaced by a numbered slot, the binder rewrites the
  arguments, and the order in which the torch function's arguments hold the slots is a permutation
  ``p`` of the ATen inputs (``torch input j`` is ``aten input p[j]``).  The torch rule's signatures
  are computed on the rewritten call and their input forms permuted back.
* ``localize``: the same binder applied to the local call (fx nodes or tensors in place of the
  slots); the torch rule localizes it, so the rank runs the torch function (or the rule's own
  per-rank implementation) on its pieces.

Because the torch rule sees exactly the call the torch function makes, the simulated-SPMD
property tests of the torch rules cover these ops; ``tests/test_rules_aten.py`` checks each binder
against the ATen op itself (same values forward and backward) and the permuted signatures by
simulated SPMD on the ATen op.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hidup.fxvalues import map_value, value_leaves
from hidup.ir import Signature
from hidup.rules.base import LocalCall, Rule, RuleContext, TensorMeta
from hidup.rules.registry import _RULES, Unsupported, default_localize, is_tensor_value, lookup

__all__ = ["ATEN_RULES", "torch_equivalent"]

aten = torch.ops.aten

_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


@dataclass(frozen=True)
class _Slot:
    """Placeholder for the i-th tensor argument of an ATen call while its arguments are rebound."""

    index: int


Binder = Callable[[tuple, dict], tuple[tuple, dict]]


def _same(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(args), dict(kwargs)


def _keep(n: int, *names: str) -> Binder:
    """Keep the first ``n`` positional arguments and the keyword arguments in ``names``."""

    def bind(args, kwargs):
        return tuple(args[:n]), {k: v for k, v in kwargs.items() if k in names}

    return bind


def _embedding(args, kwargs):
    weight, indices = args[0], args[1]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    scale = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    return (indices, weight), {
        "padding_idx": None if padding_idx == -1 else padding_idx,
        "scale_grad_by_freq": scale,
        "sparse": sparse,
    }


def _loss(names: list[str]) -> Binder:
    def bind(args, kwargs):
        b = dict(zip(names, args)) | dict(kwargs)
        out = {
            "weight": b.get("weight"),
            "reduction": _REDUCTION[b.get("reduction", 1)],
            "ignore_index": b.get("ignore_index", -100),
        }
        if "label_smoothing" in b:
            out["label_smoothing"] = b["label_smoothing"]
        return (b["self"], b["target"]), out

    return bind


def _layer_norm(args, kwargs):
    return tuple(args[:5]), {k: v for k, v in kwargs.items() if k in ("weight", "bias", "eps")}


def _slice(args, kwargs):
    b = dict(zip(["self", "dim", "start", "end", "step"], args)) | dict(kwargs)
    dim = b.get("dim", 0)
    cut = slice(b.get("start"), b.get("end"), b.get("step", 1))
    # a negative dim counts from the end: ``x[..., cut, :, ...]`` with -dim-1 whole dims after it
    idx = (slice(None),) * dim + (cut,) if dim >= 0 else (Ellipsis, cut) + (slice(None),) * (-dim - 1)
    return (b["self"], idx), {}


def _sum_default(args, kwargs):
    return (args[0],), {"dtype": kwargs.get("dtype", args[1] if len(args) > 1 else None)}


def _to(args, kwargs):
    """``aten.to.*`` / ``aten._to_copy``: keep dtype and device, drop layout and memory options."""
    keep = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
    pos = [a for a in args[1:] if isinstance(a, (torch.dtype, torch.device))]
    return (args[0], *pos), keep


def _scalar_alpha(args, kwargs):  # aten.add.Scalar(self, other, alpha=1): torch.add takes alpha as a keyword
    b = dict(zip(["self", "other", "alpha"], args)) | dict(kwargs)
    return (b["self"], b["other"]), ({"alpha": b["alpha"]} if "alpha" in b else {})


def _einsum(args, kwargs):
    return (args[0], *args[1]), {}


def _factory(args, kwargs):
    return tuple(args), {k: v for k, v in kwargs.items() if k in ("dtype", "device", "requires_grad")}


def _softmax_private(args, kwargs):  # aten._softmax(self, dim, half_to_float)
    return (args[0], args[1]), {}


def _dropout(args, kwargs):  # aten.dropout(input, p, train)
    return (args[0],), {"p": args[1], "training": args[2]}


def _constant_pad(args, kwargs):  # aten.constant_pad_nd(self, pad, value=0)
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    return (args[0], args[1], "constant", value), {}


def _squeeze(args, kwargs):
    return tuple(args), dict(kwargs)


# ATen overload -> (torch function whose rule applies, binder).  Method names ("view") stand for the
# unbound ``torch.Tensor`` method, as in hidup.rules.registry.
_TABLE: dict[Any, tuple[Any, Binder]] = {
    # matmul family
    aten.linear.default: (F.linear, _same),
    aten.addmm.default: (torch.addmm, _same),
    aten.mm.default: (torch.mm, _same),
    aten.bmm.default: (torch.bmm, _same),
    aten.baddbmm.default: (torch.baddbmm, _same),
    aten.matmul.default: (torch.matmul, _same),
    aten.einsum.default: (torch.einsum, _einsum),
    # elementwise arithmetic
    aten.add.Tensor: (torch.add, _same),
    aten.add.Scalar: (torch.add, _scalar_alpha),
    aten.sub.Tensor: (torch.sub, _same),
    aten.sub.Scalar: (torch.sub, _scalar_alpha),
    aten.mul.Tensor: (torch.mul, _same),
    aten.mul.Scalar: (torch.mul, _same),
    aten.div.Tensor: (torch.div, _same),
    aten.div.Scalar: (torch.div, _same),
    aten.div_.Tensor: (torch.div, _same),
    aten.neg.default: (torch.neg, _same),
    aten.pow.Tensor_Scalar: (torch.pow, _same),
    aten.pow.Tensor_Tensor: (torch.pow, _same),
    aten.masked_fill.Scalar: (torch.masked_fill, _same),
    aten.masked_fill.Tensor: (torch.masked_fill, _same),
    aten.where.self: (torch.where, _same),
    aten.tril.default: (torch.tril, _same),
    aten.triu.default: (torch.triu, _same),
    aten.cumsum.default: (torch.cumsum, _same),
    aten.clamp.default: (torch.clamp, _same),
    aten.maximum.default: (torch.maximum, _same),
    aten.minimum.default: (torch.minimum, _same),
    aten.gelu.default: (F.gelu, _same),
    aten.silu.default: (F.silu, _same),
    aten.relu.default: (F.relu, _same),
    aten.dropout.default: (F.dropout, _dropout),
    # copies, aliases, casts
    aten.contiguous.default: ("contiguous", _keep(1)),
    aten.clone.default: (torch.clone, _keep(1)),
    aten.alias.default: (torch.clone, _same),
    aten.lift_fresh_copy.default: (torch.clone, _same),
    aten.detach.default: (torch.detach, _same),
    aten.detach_.default: (torch.detach, _same),
    aten.to.dtype: ("to", _to),
    aten.to.dtype_layout: ("to", _to),
    aten.to.device: ("to", _to),
    aten._to_copy.default: ("to", _to),
    aten.type_as.default: ("type_as", _same),
    # shapes
    aten.view.default: ("reshape", _same),
    aten.reshape.default: ("reshape", _same),
    aten._unsafe_view.default: ("reshape", _same),
    aten.expand.default: ("expand", _keep(2)),
    aten.transpose.int: (torch.transpose, _same),
    aten.t.default: (torch.t, _same),
    aten.permute.default: (torch.permute, _same),
    aten.unsqueeze.default: (torch.unsqueeze, _same),
    aten.squeeze.dim: (torch.squeeze, _squeeze),
    aten.squeeze.dims: (torch.squeeze, _squeeze),
    aten.flatten.using_ints: (torch.flatten, _same),
    aten.unflatten.int: (torch.unflatten, _same),
    aten.repeat.default: ("repeat", _same),
    # indexing and joining
    aten.slice.Tensor: (operator.getitem, _slice),
    aten.select.int: (torch.select, _same),
    aten.narrow.default: (torch.narrow, _same),
    aten.split.Tensor: (torch.split, _same),
    aten.split_with_sizes.default: (torch.split, _same),
    aten.chunk.default: (torch.chunk, _same),
    aten.unbind.int: (torch.unbind, _same),
    aten.cat.default: (torch.cat, _same),
    aten.stack.default: (torch.stack, _same),
    aten.index_select.default: (torch.index_select, _same),
    aten.gather.default: (torch.gather, _same),
    aten.pad.default: (F.pad, _same),
    aten.constant_pad_nd.default: (F.pad, _constant_pad),
    # reductions and normalizations
    aten.sum.dim_IntList: (torch.sum, _same),
    aten.sum.default: (torch.sum, _sum_default),
    aten.mean.dim: (torch.mean, _same),
    aten.mean.default: (torch.mean, _sum_default),
    aten.amax.default: (torch.amax, _same),
    aten.amin.default: (torch.amin, _same),
    aten.logsumexp.default: (torch.logsumexp, _same),
    aten.argmax.default: (torch.argmax, _same),
    aten.topk.default: (torch.topk, _same),
    aten.softmax.int: (torch.softmax, _same),
    aten._softmax.default: (torch.softmax, _softmax_private),
    aten.log_softmax.int: (torch.log_softmax, _same),
    aten._log_softmax.default: (torch.log_softmax, _softmax_private),
    aten.layer_norm.default: (F.layer_norm, _layer_norm),
    aten.rms_norm.default: (F.rms_norm, _same),
    # convolutions (aten.convolution also covers transposed ones)
    aten.conv1d.default: (F.conv1d, _same),
    aten.conv2d.default: (F.conv2d, _same),
    aten.conv3d.default: (F.conv3d, _same),
    aten.conv1d.padding: (F.conv1d, _same),
    aten.conv2d.padding: (F.conv2d, _same),
    aten.conv3d.padding: (F.conv3d, _same),
    aten.convolution.default: (torch.convolution, _same),
    # attention, embedding, losses
    aten.scaled_dot_product_attention.default: (F.scaled_dot_product_attention, _same),
    aten.embedding.default: (F.embedding, _embedding),
    aten.cross_entropy_loss.default: (
        F.cross_entropy,
        _loss(["self", "target", "weight", "reduction", "ignore_index", "label_smoothing"]),
    ),
    aten.nll_loss.default: (F.nll_loss, _loss(["self", "target", "weight", "reduction", "ignore_index"])),
    aten.nll_loss_nd.default: (F.nll_loss, _loss(["self", "target", "weight", "reduction", "ignore_index"])),
    # factories
    aten.arange.default: (torch.arange, _factory),
    aten.arange.start: (torch.arange, _factory),
    aten.arange.start_step: (torch.arange, _factory),
    aten.zeros.default: (torch.zeros, _factory),
    aten.ones.default: (torch.ones, _factory),
    aten.full.default: (torch.full, _factory),
    aten.empty.memory_format: (torch.empty, _factory),
    aten.zeros_like.default: (torch.zeros_like, _factory),
    aten.ones_like.default: (torch.ones_like, _factory),
    aten.full_like.default: (torch.full_like, _factory),
    aten.empty_like.default: (torch.empty_like, _factory),
}

for _name in (
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
    "reciprocal",
    "log1p",
    "expm1",
    "sign",
    "isnan",
    "isinf",
    "logical_not",
    "square",
):
    _TABLE[getattr(aten, _name).default] = (getattr(torch, _name), _same)
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    for _overload in ("Tensor", "Scalar"):
        _TABLE[getattr(getattr(aten, _name), _overload)] = (getattr(torch, _name), _same)
for _name in ("logical_and", "logical_or", "floor_divide"):
    _TABLE[getattr(aten, _name).default] = (getattr(torch, _name), _same)


def torch_equivalent(target: Any) -> Any:
    """The torch function (or method name) an ATen overload is rewritten to, or ``None``."""
    entry = _TABLE.get(target)
    return entry[0] if entry is not None else None


def _slotted(args: tuple, kwargs: dict, is_slot: Callable[[Any], bool]) -> tuple[tuple, dict]:
    counter = iter(range(1 << 30))
    return map_value((tuple(args), dict(kwargs)), lambda v: _Slot(next(counter)) if is_slot(v) else v)


def _permutation(
    args: tuple, kwargs: dict, binder: Binder, is_slot: Callable[[Any], bool], n: int, where: str
) -> list[int]:
    """``p`` with torch input j = ATen input p[j] (see module docstring)."""
    s_args, s_kwargs = _slotted(args, kwargs, is_slot)
    t_args, t_kwargs = binder(s_args, s_kwargs)
    order = [s.index for s in value_leaves((t_args, t_kwargs), _Slot)]
    if sorted(order) != list(range(n)):
        raise Unsupported(f"{where}: the torch form of this call does not read each tensor argument once")
    return order


def _rebound(ctx: RuleContext, is_slot: Callable[[Any], bool]) -> tuple[RuleContext, list[int], Rule]:
    torch_target, binder = _TABLE[ctx.target]
    rule = lookup(torch_target)
    if rule is None:
        raise Unsupported(f"no rule for {torch_target}")
    where = f"{ctx.target} at {ctx.node_name}"
    order = _permutation(ctx.args, ctx.kwargs, binder, is_slot, len(ctx.inputs), where)
    t_args, t_kwargs = binder(tuple(ctx.args), dict(ctx.kwargs))
    torch_ctx = replace(ctx, target=torch_target, args=t_args, kwargs=t_kwargs, inputs=[ctx.inputs[i] for i in order])
    return torch_ctx, order, rule


def _signatures(ctx: RuleContext) -> list[Signature]:
    torch_ctx, order, rule = _rebound(ctx, lambda v: isinstance(v, TensorMeta))
    back = [0] * len(order)
    for j, i in enumerate(order):
        back[i] = j
    sigs = rule.signatures(torch_ctx)
    return [replace(s, inputs=tuple(s.inputs[back[i]] for i in range(len(order)))) for s in sigs]


def _localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    torch_ctx, order, rule = _rebound(ctx, is_tensor_value)
    torch_sig = replace(sig, inputs=tuple(sig.inputs[i] for i in order))
    if rule.localize is None:
        return default_localize(torch_ctx, torch_sig, rank)
    return rule.localize(torch_ctx, torch_sig, rank)


def _variant(ctx: RuleContext) -> str:
    torch_ctx, _, rule = _rebound(ctx, lambda v: isinstance(v, TensorMeta))
    return rule.variant(torch_ctx) if rule.variant is not None else ""


ATEN_RULES: dict[Any, Rule] = {}
for _op in _TABLE:
    ATEN_RULES[_op] = _RULES[_op] = Rule(f"aten:{_op}", _signatures, _localize, _variant)
