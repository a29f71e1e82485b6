"""Triton kernels of :mod:`hidup.rules.expert_rows` (imported on a CUDA device only).

One program per row (sorted pair) or per token; a program whose row lies past ``count`` (read from
device memory) masks every load and store off, so it moves no data, or writes zeros where the caller
asks for a zero tail (the masked grouped form reads every row).  Sums are in float32; each token
sums its ``k`` slots in slot order, so results do not depend on scheduling.  The math is the module
docstring of :mod:`hidup.rules.expert_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # columns per chunk
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}  # the activations of hidup.rules.grouped


@triton.jit
def _gather(x, order, count, out, k, D, ZERO_TAIL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    own = row < tl.load(count)
    cols = tl.arange(0, BLOCK)
    token = tl.load(order + row, mask=own, other=0).to(tl.int64) // k
    for c in range(0, D, BLOCK):
        m = c + cols < D
        value = tl.load(x + token * D + c + cols, mask=m & own, other=0.0)
        if ZERO_TAIL:
            tl.store(out + row * D + c + cols, value, mask=m)
        else:
            tl.store(out + row * D + c + cols, value, mask=m & own)


@triton.jit
def _gather_backward(grad, inverse, count, out, k, D, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = c + cols < D
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(k):
            r = tl.load(inverse + t * k + j).to(tl.int64)
            acc += tl.load(grad + r * D + c + cols, mask=m & (r < n), other=0.0).to(tl.float32)
        tl.store(out + t * D + c + cols, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _act_value(g, ACT: tl.constexpr):
    if ACT == 0:
        value = g * tl.sigmoid(g)
    elif ACT == 1:
        value = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        value = g * tl.sigmoid(2.0 * inner)  # 0.5 g (1 + tanh(inner))
    else:
        value = tl.maximum(g, 0.0)
    return value


@triton.jit
def _act_slope(g, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(g)
        slope = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        slope = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476)) + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        slope = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    else:
        slope = tl.where(g > 0.0, 1.0, 0.0)
    return slope


@triton.jit
def _act(gu, count, out, F, ACT: tl.constexpr, ZERO_TAIL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    own = row < tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, F, BLOCK):
        m = c + cols < F
        g = tl.load(gu + row * 2 * F + c + cols, mask=m & own, other=0.0).to(tl.float32)
        u = tl.load(gu + row * 2 * F + F + c + cols, mask=m & own, other=0.0).to(tl.float32)
        value = (_act_value(g, ACT) * u).to(out.dtype.element_ty)  # 0 past count (g = u = 0)
        if ZERO_TAIL:
            tl.store(out + row * F + c + cols, value, mask=m)
        else:
            tl.store(out + row * F + c + cols, value, mask=m & own)


@triton.jit
def _act_backward(grad, gu, count, out, F, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    own = row < tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, F, BLOCK):
        m = (c + cols < F) & own
        g = tl.load(gu + row * 2 * F + c + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + row * 2 * F + F + c + cols, mask=m, other=0.0).to(tl.float32)
        ga = tl.load(grad + row * F + c + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * 2 * F + c + cols, (ga * u * _act_slope(g, ACT)).to(out.dtype.element_ty), mask=m)
        tl.store(out + row * 2 * F + F + c + cols, (ga * _act_value(g, ACT)).to(out.dtype.element_ty), mask=m)


@triton.jit
def _combine(h, w, inverse, count, out, k, D, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = c + cols < D
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(k):
            r = tl.load(inverse + t * k + j).to(tl.int64)
            weight = tl.load(w + t * k + j).to(tl.float32)
            acc += weight * tl.load(h + r * D + c + cols, mask=m & (r < n), other=0.0).to(tl.float32)
        tl.store(out + t * D + c + cols, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _combine_grad_h(grad, w, order, count, out, k, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    own = row < tl.load(count)
    pair = tl.load(order + row, mask=own, other=0).to(tl.int64)
    weight = tl.load(w + pair, mask=own, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = (c + cols < D) & own
        gy = tl.load(grad + (pair // k) * D + c + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * D + c + cols, (weight * gy).to(out.dtype.element_ty), mask=m)


@triton.jit
def _combine_grad_w(grad, h, inverse, count, out, k, D, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for j in range(k):
        r = tl.load(inverse + t * k + j).to(tl.int64)
        acc = tl.zeros([BLOCK], tl.float32)
        for c in range(0, D, BLOCK):
            m = (c + cols < D) & (r < n)
            gy = tl.load(grad + t * D + c + cols, mask=m, other=0.0).to(tl.float32)
            acc += gy * tl.load(h + r * D + c + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out + t * k + j, tl.sum(acc, axis=0).to(out.dtype.element_ty))


# ------------------------------------------------------------------------------------- launchers
def gather_rows(x: Tensor, order: Tensor, count: Tensor, k: int, zero_tail: bool) -> Tensor:
    x = x.contiguous()
    out = torch.empty(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    _gather[(order.numel(),)](x, order, count, out, k, x.shape[1], ZERO_TAIL=zero_tail, BLOCK=BLOCK)
    return out


def gather_rows_backward(grad: Tensor, inverse: Tensor, count: Tensor, k: int) -> Tensor:
    tokens = inverse.numel() // k
    out = torch.empty(tokens, grad.shape[1], dtype=grad.dtype, device=grad.device)
    _gather_backward[(tokens,)](grad.contiguous(), inverse, count, out, k, grad.shape[1], BLOCK=BLOCK)
    return out


def act_rows(gu: Tensor, count: Tensor, act: str, zero_tail: bool) -> Tensor:
    ffn = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], ffn, dtype=gu.dtype, device=gu.device)
    _act[(gu.shape[0],)](gu.contiguous(), count, out, ffn, ACT=ACT_CODES[act], ZERO_TAIL=zero_tail, BLOCK=BLOCK)
    return out


def act_rows_backward(grad: Tensor, gu: Tensor, count: Tensor, act: str) -> Tensor:
    out = torch.empty_like(gu)
    _act_backward[(gu.shape[0],)](
        grad.contiguous(), gu.contiguous(), count, out, gu.shape[1] // 2, ACT=ACT_CODES[act], BLOCK=BLOCK
    )
    return out


def combine_rows(h: Tensor, w: Tensor, inverse: Tensor, count: Tensor, k: int, out_dtype: torch.dtype) -> Tensor:
    out = torch.empty(w.shape[0], h.shape[1], dtype=out_dtype, device=h.device)
    _combine[(w.shape[0],)](h.contiguous(), w.contiguous(), inverse, count, out, k, h.shape[1], BLOCK=BLOCK)
    return out


def combine_rows_backward(
    grad: Tensor, h: Tensor, w: Tensor, order: Tensor, inverse: Tensor, count: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    grad, h, w = grad.contiguous(), h.contiguous(), w.contiguous()
    grad_h = torch.empty_like(h)
    grad_w = torch.empty_like(w)
    _combine_grad_h[(h.shape[0],)](grad, w, order, count, grad_h, k, h.shape[1], BLOCK=BLOCK)
    _combine_grad_w[(w.shape[0],)](grad, h, inverse, count, grad_w, k, h.shape[1], BLOCK=BLOCK)
    return grad_h, grad_w
