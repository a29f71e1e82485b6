"""What every baseline hands to the common train loop: its module, how its gradients relate to the
single-device ones, the optimizer, and bucketed gradient all-reduce.

Loss and gradients.  Rank ``r`` of ``N`` runs its share of the batch and computes the model's loss on
it, ``L_r``.  How the global loss ``L`` (that of the whole batch on one device) follows from the
``L_r`` depends on the loss (:class:`LossForm`):

* ``sum`` (every zoo model of ``hidup.models``: a sum over groups): ``L = sum_r L_r``;
* ``mean`` over counted items (a mean over samples, or over the tokens whose label is not ignored):
  with ``c_r`` items on rank ``r`` and ``C = sum_r c_r``, ``L_r = s_r / c_r`` and
  ``L = sum_r s_r / C = sum_r (c_r / C) L_r``.  A rank's mean is not the global mean; with equal
  counts ``L = (1/N) sum_r L_r``, with padding the counts differ from rank to rank.

Both are ``L = sum_r w_r L_r`` with a weight per rank, ``w_r = 1`` (sum) or ``w_r = c_r / C`` (mean;
the counts are summed over ranks once, from the fixed batch), so ``dL/dw = sum_r w_r dL_r/dw``.
A method that *sums* gradients over ranks (hand-written expert parallelism) back-propagates
``w_r L_r``; DDP and FSDP *average* them, so they back-propagate ``N w_r L_r``
(``Prepared.loss_scale``, set by :func:`set_loss_weight`).  The reported loss is ``sum_r w_r L_r``.

Optimizer (:func:`make_adam`): ``torch.optim.Adam(fused=True)`` (one kernel over all parameters),
``capturable=True`` when the step is captured in a CUDA graph; plain Adam (capturable where
captured) where fused is unavailable for the parameters' device and dtype, which the result records.

Bucketed all-reduce of gradients that the baselines sum by hand (the expert baseline's dense
parameters): hidup's own :class:`hidup.codegen.GradBucketer`, so both are timed with one implementation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from hidup.models import ModelConfig

BUCKET_BYTES = 25 << 20  # DDP's default bucket size


@dataclass(frozen=True)
class Options:
    """How a baseline is built for one variant: ``compile`` (torch.compile with ``compile_backend``),
    ``graph`` (the whole step will be captured as a CUDA graph), ``precision`` (fp32, tf32, bf16)."""

    compile: bool = False
    graph: bool = False
    precision: str = "fp32"
    compile_backend: str = "inductor"


EAGER = Options()  # the default: eager, fp32


@dataclass
class Prepared:
    """One rank's module plus the glue the train loop needs."""

    module: nn.Module
    grads_averaged: bool = False  # the method averages gradients over ranks (DDP, FSDP) rather than summing
    after_backward: Callable[[], None] | None = None  # e.g. gradient all-reduce
    info: dict = field(default_factory=dict)  # extra facts for the result dict
    capture_warmup: int = 3  # eager steps before a CUDA-graph capture (DDP needs 11)
    loss_weight: float = 1.0  # w_r of the module docstring
    loss_scale: float = 1.0  # backward runs on loss * loss_scale (set_loss_weight)


def set_loss_weight(prepared: Prepared, weight: float, world: int) -> Prepared:
    """Give ``prepared`` its rank's loss weight ``w_r`` and the matching backward scale (module docstring)."""
    prepared.loss_weight = float(weight)
    prepared.loss_scale = float(weight) * (world if prepared.grads_averaged else 1)
    return prepared


@dataclass(frozen=True)
class LossForm:
    """How a model's scalar loss over a batch combines over shares of the batch (module docstring).

    ``kind``: ``"sum"`` or ``"mean"``.  ``count(inputs) -> number`` (``mean`` only): the items the loss
    of ``inputs`` averages over; default the rows of the first input (a mean over samples).  For a
    token mean with ignored labels, e.g. ``lambda inputs: (inputs[1][:, 1:] != -100).sum()``."""

    kind: str = "sum"
    count: Callable | None = None

    def __post_init__(self):
        if self.kind not in ("sum", "mean"):
            raise ValueError(f"LossForm kind {self.kind!r}: choose 'sum' or 'mean'")

    def items(self, inputs: tuple) -> float:
        if self.count is not None:
            return float(self.count(inputs))
        first = next(t for t in inputs if isinstance(t, torch.Tensor))
        return float(first.shape[0])


def loss_form_of(model: nn.Module) -> LossForm:
    """The :class:`LossForm` of ``model``: its ``loss_form`` attribute (a LossForm, ``"sum"`` or
    ``"mean"``) when it has one; ``sum`` for a zoo model (``hidup.models``: summed over groups)."""
    form = getattr(model, "loss_form", None)
    if isinstance(form, LossForm):
        return form
    if form in ("sum", "mean"):
        return LossForm(form)
    if form is None and isinstance(getattr(model, "config", None), ModelConfig):
        return LossForm("sum")
    raise ValueError(
        f"the baselines need to know how the loss of {type(model).__name__} combines over ranks: "
        f"set model.loss_form in its factory to 'sum' (a sum over samples), 'mean' (a mean over "
        f"samples) or LossForm('mean', count=...) (a mean over counted items, e.g. unpadded tokens)"
        + (f"; got {form!r}" if form is not None else "")
    )


def loss_weight(form: LossForm, share: tuple, world: int, device: torch.device, group=None) -> float:
    """``w_r`` of this rank for its inputs ``share`` (the counts are summed over the ranks of ``group``)."""
    if form.kind == "sum":
        return 1.0
    mine = form.items(share)
    total = mine
    if world > 1 and dist.is_available() and dist.is_initialized():
        t = torch.tensor([mine], dtype=torch.float64, device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(t, group=group)
        total = t.item()
    if total <= 0:
        raise ValueError(f"the loss is a mean over {total:g} counted items in the whole batch: nothing to average")
    return mine / total


def make_adam(params, lr: float, capturable: bool = False) -> tuple[torch.optim.Optimizer, str]:
    """(Adam over ``params``, its description): fused where torch has a fused kernel for the parameters'
    device and dtype (``capturable`` for a step inside a CUDA graph), plain Adam otherwise."""
    params = [p for p in params if p.requires_grad]
    missing = fused_unavailable(params)
    if missing is None:
        opt = torch.optim.Adam(params, lr=lr, fused=True, capturable=capturable)
        return opt, "Adam(fused=True" + (", capturable=True)" if capturable else ")")
    warnings.warn(f"fused Adam is unavailable here ({missing}); using plain Adam", stacklevel=2)
    return (
        torch.optim.Adam(params, lr=lr, capturable=capturable),
        ("Adam(capturable=True)" if capturable else "Adam") + f" (fused unavailable: {missing[:120]})",
    )


def fused_unavailable(params) -> str | None:
    """Why torch's fused Adam cannot take ``params`` (None when it can): the check its first step
    makes (a supported device and a floating-point dtype), made up front."""
    try:
        from torch.optim.optimizer import _device_dtype_check_for_fused
    except ImportError:  # another torch: fused Adam reports its own error at the first step
        return None
    for p in params:
        try:
            _device_dtype_check_for_fused(p)
        except RuntimeError as e:
            return str(e)
    return None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the elements of its outermost ``nn.ModuleList``s."""
    return [block for lst in outer_module_lists(model) for block in lst]


def outer_module_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The outermost ``nn.ModuleList``s of ``model`` (pre-order: outer lists come first)."""
    lists: list[nn.ModuleList] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(t + ".") for t in taken):
            taken.append(name)
            lists.append(module)
    return lists


def compile_module(module: nn.Module, opts: Options) -> nn.Module:
    """``torch.compile(module)`` with the options' backend (the module itself when not compiling)."""
    if not opts.compile:
        return module
    return torch.compile(module, backend=opts.compile_backend)
