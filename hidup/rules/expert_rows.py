"""The row-wise steps of the routed-experts op, over the rank's own rows only.

The op (:mod:`hidup.rules.experts`) sorts its ``S = T k`` (token, slot) pairs by local expert
(:func:`hidup.rules.grouped.route`): the first ``count = offsets[-1]`` sorted rows go to the rank's
experts, the rest to other ranks' experts (under the all-gather dispatcher ``(N-1)/N`` of them).  Shapes
stay static (``S`` rows) for capture, but nothing past ``count`` needs computing: these three steps
read ``count`` on the device and skip those rows, so their work follows the rank's own rows.

* ``gather_rows(x[T,D], order[S], inverse[S], count[1], k) -> xs[S,D]``::

      xs[r] = x[order[r] // k]  (r < count),   0  (r >= count)

  backward: ``grad_x[t] = sum_j [inverse[t k + j] < count] grad_xs[inverse[t k + j]]`` (each token sums
  its own slots: no atomics, the same order every run).
* ``act_rows(gu[S,2F], count[1], act) -> a[S,F]``: ``a[r] = act(gu[r,:F]) * gu[r,F:]`` for ``r <
  count``, 0 past it; backward ``d gate = grad_a * up * act'(gate)``, ``d up = grad_a * act(gate)``.
* ``combine_rows(h[S,D], w[T,k], order, inverse, count, k) -> y[T,D]``::

      y[t] = sum_j [inverse[t k + j] < count] w[t,j] h[inverse[t k + j]]

  in float32, returned in ``out_dtype``; backward ``grad_h[r] = w_flat[order[r]] grad_y[order[r] // k]``
  (``r < count``), ``grad_w[t,j] = <grad_y[t], h[inverse[t k + j]]>`` for the pair's row below ``count``.

Past ``count`` nothing reads a row: the grouped kernels (:func:`hidup.rules.grouped.grouped_mm`) stop
at the last offset and these steps skip those rows, so on CUDA the outputs' tails stay unwritten (no
traffic) and the grouped kernels' unwritten rows never reach a sum; ``zero_tail`` writes zeros there
for the masked grouped form, whose weight gradients multiply every row by zero.  On the CPU tails are
zero.  Each step is a ``torch.library`` custom op
with a fake implementation, a CUDA kernel and its backward registered, so the training step that uses them compiles
(inductor calls them as kernels of their own) and is captured as one CUDA graph.  On CUDA they run
Triton kernels (:mod:`hidup.rules.expert_rows_cuda`) whose programs past ``count`` return at once;
elsewhere (the CPU, float64 verification) the same math in torch ops.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from hidup.rules.grouped import ACTIVATIONS

__all__ = ["gather_rows", "act_rows", "combine_rows"]


def _below(count: Tensor, rows: int, device) -> Tensor:
    """Bool ``[rows]``: row index below ``count``."""
    return torch.arange(rows, device=device) < count.to(torch.int64)


@functools.cache
def _cuda():
    """The Triton kernels' launchers, imported on first use on a CUDA device."""
    from hidup.rules import expert_rows_cuda

    return expert_rows_cuda


# ------------------------------------------------------------------------------------------ gather
@torch.library.custom_op("hidup::gather_rows", mutates_args=())
def gather_rows(x: Tensor, order: Tensor, inverse: Tensor, count: Tensor, k: int, zero_tail: bool) -> Tensor:
    """``xs[r] = x[order[r] // k]`` below ``count``; past it zero (unwritten on CUDA unless
    ``zero_tail``: module docstring)."""
    keep = _below(count, order.numel(), x.device).unsqueeze(-1)
    return torch.where(keep, x[torch.div(order, k, rounding_mode="floor")], torch.zeros((), dtype=x.dtype))


@gather_rows.register_kernel("cuda")
def _(x, order, inverse, count, k, zero_tail):
    return _cuda().gather_rows(x, order, count, k, zero_tail)


@gather_rows.register_fake
def _(x, order, inverse, count, k, zero_tail):
    return x.new_empty(order.numel(), x.shape[1])


@torch.library.custom_op("hidup::gather_rows_backward", mutates_args=())
def gather_rows_backward(grad: Tensor, inverse: Tensor, count: Tensor, k: int) -> Tensor:
    """``grad_x[t] = sum_j [inverse[t k + j] < count] grad[inverse[t k + j]]``."""
    keep = (inverse < count.to(inverse.dtype)).unsqueeze(-1)
    picked = torch.where(keep, grad[inverse], torch.zeros((), dtype=grad.dtype))
    return picked.view(-1, k, grad.shape[1]).sum(dim=1)


@gather_rows_backward.register_kernel("cuda")
def _(grad, inverse, count, k):
    return _cuda().gather_rows_backward(grad, inverse, count, k)


@gather_rows_backward.register_fake
def _(grad, inverse, count, k):
    return grad.new_empty(inverse.numel() // k, grad.shape[1])


def _gather_setup(ctx, inputs, output) -> None:
    _, _, inverse, count, k, _ = inputs
    ctx.save_for_backward(inverse, count)
    ctx.k = k


def _gather_backward(ctx, grad):
    inverse, count = ctx.saved_tensors
    return gather_rows_backward(grad.contiguous(), inverse, count, ctx.k), None, None, None, None, None


gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)


# ------------------------------------------------------------------------------------- activation
@torch.library.custom_op("hidup::act_rows", mutates_args=())
def act_rows(gu: Tensor, count: Tensor, act: str, zero_tail: bool) -> Tensor:
    """``act(gate) * up`` below ``count``; past it zero (unwritten on CUDA unless ``zero_tail``)."""
    gate, up = gu.chunk(2, dim=-1)
    keep = _below(count, gu.shape[0], gu.device).unsqueeze(-1)
    return torch.where(keep, ACTIVATIONS[act](gate) * up, torch.zeros((), dtype=gu.dtype))


@act_rows.register_kernel("cuda")
def _(gu, count, act, zero_tail):
    return _cuda().act_rows(gu, count, act, zero_tail)


@act_rows.register_fake
def _(gu, count, act, zero_tail):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _act_grad(act: str, grad: Tensor, gate: Tensor) -> Tensor:
    """``grad * act'(gate)`` by torch's own backward kernels (the same values autograd would give)."""
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    if act in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh" if act == "gelu_tanh" else "none")
    return torch.where(gate > 0, grad, torch.zeros((), dtype=grad.dtype))


@torch.library.custom_op("hidup::act_rows_backward", mutates_args=())
def act_rows_backward(grad: Tensor, gu: Tensor, count: Tensor, act: str) -> Tensor:
    """``[d gate, d up]`` of :func:`act_rows` below ``count``, zero past it."""
    gate, up = gu.chunk(2, dim=-1)
    keep = _below(count, gu.shape[0], gu.device).unsqueeze(-1)
    grad = torch.where(keep, grad, torch.zeros((), dtype=grad.dtype))
    return torch.cat([_act_grad(act, grad * up, gate), grad * ACTIVATIONS[act](gate)], dim=-1)


@act_rows_backward.register_kernel("cuda")
def _(grad, gu, count, act):
    return _cuda().act_rows_backward(grad, gu, count, act)


@act_rows_backward.register_fake
def _(grad, gu, count, act):
    return torch.empty_like(gu)


def _act_setup(ctx, inputs, output) -> None:
    gu, count, act, _ = inputs
    ctx.save_for_backward(gu, count)
    ctx.act = act


def _act_backward(ctx, grad):
    gu, count = ctx.saved_tensors
    return act_rows_backward(grad.contiguous(), gu, count, ctx.act), None, None, None


act_rows.register_autograd(_act_backward, setup_context=_act_setup)


# ---------------------------------------------------------------------------------------- combine
@torch.library.custom_op("hidup::combine_rows", mutates_args=())
def combine_rows(
    h: Tensor, w: Tensor, order: Tensor, inverse: Tensor, count: Tensor, k: int, out_dtype: torch.dtype
) -> Tensor:
    """``y[t] = sum_j [row < count] w[t,j] h[row]``, ``row = inverse[t k + j]`` (module docstring)."""
    keep = (inverse < count.to(inverse.dtype)).unsqueeze(-1)
    wide = torch.promote_types(h.dtype, w.dtype)
    picked = torch.where(keep, h[inverse].to(wide), torch.zeros((), dtype=wide))
    return (picked * w.reshape(-1, 1).to(wide)).view(-1, k, h.shape[1]).sum(dim=1).to(out_dtype)


@combine_rows.register_kernel("cuda")
def _(h, w, order, inverse, count, k, out_dtype):
    return _cuda().combine_rows(h, w, inverse, count, k, out_dtype)


@combine_rows.register_fake
def _(h, w, order, inverse, count, k, out_dtype):
    return h.new_empty(w.shape[0], h.shape[1], dtype=out_dtype)


@torch.library.custom_op("hidup::combine_rows_backward", mutates_args=())
def combine_rows_backward(
    grad: Tensor, h: Tensor, w: Tensor, order: Tensor, inverse: Tensor, count: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """(``grad_h``, ``grad_w``) of :func:`combine_rows` (module docstring)."""
    wide = torch.promote_types(h.dtype, w.dtype)
    below = _below(count, h.shape[0], h.device).unsqueeze(-1)
    token = torch.div(order, k, rounding_mode="floor")
    scaled = grad[token].to(wide) * w.reshape(-1)[order].unsqueeze(-1).to(wide)
    grad_h = torch.where(below, scaled, torch.zeros((), dtype=wide)).to(h.dtype)
    keep = (inverse < count.to(inverse.dtype)).unsqueeze(-1)
    picked = torch.where(keep, h[inverse].to(wide), torch.zeros((), dtype=wide)).view(-1, k, h.shape[1])
    grad_w = (picked * grad.to(wide).unsqueeze(1)).sum(dim=-1).to(w.dtype)
    return grad_h, grad_w


@combine_rows_backward.register_kernel("cuda")
def _(grad, h, w, order, inverse, count, k):
    return _cuda().combine_rows_backward(grad, h, w, order, inverse, count, k)


@combine_rows_backward.register_fake
def _(grad, h, w, order, inverse, count, k):
    return torch.empty_like(h), torch.empty_like(w)


def _combine_setup(ctx, inputs, output) -> None:
    h, w, order, inverse, count, k, _ = inputs
    ctx.save_for_backward(h, w, order, inverse, count)
    ctx.k = k


def _combine_backward(ctx, grad):
    h, w, order, inverse, count = ctx.saved_tensors
    grad_h, grad_w = combine_rows_backward(grad.contiguous(), h, w, order, inverse, count, ctx.k)
    return grad_h, grad_w, None, None, None, None, None


combine_rows.register_autograd(_combine_backward, setup_context=_combine_setup)
