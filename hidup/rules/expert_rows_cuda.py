"""Triton kernels of :mod:`hidup.rules.expert_rows` (imported on a CUDA device only).

Each program takes a tile of ``ROWS`` rows (sorted pairs) or tokens and walks their columns in
chunks of ``BLOCK``.  A row program whose first row lies past ``count`` (read from device memory)
returns at once, so the rows of other ranks' experts cost a launch slot and no data; where the
caller asks for a zero tail (the masked grouped form reads every row) it writes zeros there instead.
Sums are in float32; each token sums its ``k`` slots in slot order, so results do not depend on
scheduling.  The math is the module docstring of :mod:`hidup.rules.expert_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 16  # rows or tokens per program
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}  # the activations of hidup.rules.grouped


def _block(width: int) -> int:
    """Columns per chunk: the width's power of two, at most 256."""
    return min(256, triton.next_power_of_2(width))


@triton.jit
def _gather(x, order, count, out, S, k, D, ZERO_TAIL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * ROWS
    n = tl.load(count)
    if not ZERO_TAIL:
        if start >= n:
            return
    rows = start + tl.arange(0, ROWS)
    own = rows < n
    token = tl.load(order + rows, mask=own, other=0).to(tl.int64) // k
    if ZERO_TAIL:
        keep = rows < S
    else:
        keep = own
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = (c + cols < D)[None, :]
        value = tl.load(x + token[:, None] * D + (c + cols)[None, :], mask=own[:, None] & m, other=0.0)
        tl.store(out + rows[:, None] * D + (c + cols)[None, :], value, mask=keep[:, None] & m)


@triton.jit
def _gather_backward(grad, inverse, count, out, T, k, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = tokens < T
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = (c + cols < D)[None, :]
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for j in range(k):
            r = tl.load(inverse + tokens * k + j, mask=live, other=0).to(tl.int64)
            valid = (live & (r < n))[:, None] & m
            acc += tl.load(grad + r[:, None] * D + (c + cols)[None, :], mask=valid, other=0.0).to(tl.float32)
        tl.store(out + tokens[:, None] * D + (c + cols)[None, :], acc.to(out.dtype.element_ty), mask=live[:, None] & m)


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
def _act(gu, count, out, S, F, ACT: tl.constexpr, ZERO_TAIL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * ROWS
    n = tl.load(count)
    if not ZERO_TAIL:
        if start >= n:
            return
    rows = start + tl.arange(0, ROWS)
    own = rows < n
    if ZERO_TAIL:
        keep = rows < S
    else:
        keep = own
    cols = tl.arange(0, BLOCK)
    for c in range(0, F, BLOCK):
        m = (c + cols < F)[None, :]
        at = rows[:, None] * 2 * F + (c + cols)[None, :]
        g = tl.load(gu + at, mask=own[:, None] & m, other=0.0).to(tl.float32)
        u = tl.load(gu + at + F, mask=own[:, None] & m, other=0.0).to(tl.float32)
        value = (_act_value(g, ACT) * u).to(out.dtype.element_ty)  # 0 past count (g = u = 0)
        tl.store(out + rows[:, None] * F + (c + cols)[None, :], value, mask=keep[:, None] & m)


@triton.jit
def _act_backward(grad, gu, count, out, F, ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * ROWS
    n = tl.load(count)
    if start >= n:
        return
    rows = start + tl.arange(0, ROWS)
    own = (rows < n)[:, None]
    cols = tl.arange(0, BLOCK)
    for c in range(0, F, BLOCK):
        m = own & (c + cols < F)[None, :]
        at = rows[:, None] * 2 * F + (c + cols)[None, :]
        g = tl.load(gu + at, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + at + F, mask=m, other=0.0).to(tl.float32)
        ga = tl.load(grad + rows[:, None] * F + (c + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out + at, (ga * u * _act_slope(g, ACT)).to(out.dtype.element_ty), mask=m)
        tl.store(out + at + F, (ga * _act_value(g, ACT)).to(out.dtype.element_ty), mask=m)


@triton.jit
def _combine(h, w, inverse, count, out, T, k, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = tokens < T
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = (c + cols < D)[None, :]
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for j in range(k):
            r = tl.load(inverse + tokens * k + j, mask=live, other=0).to(tl.int64)
            weight = tl.load(w + tokens * k + j, mask=live, other=0.0).to(tl.float32)
            valid = (live & (r < n))[:, None] & m
            rows = tl.load(h + r[:, None] * D + (c + cols)[None, :], mask=valid, other=0.0).to(tl.float32)
            acc += weight[:, None] * rows
        tl.store(out + tokens[:, None] * D + (c + cols)[None, :], acc.to(out.dtype.element_ty), mask=live[:, None] & m)


@triton.jit
def _combine_grad_h(grad, w, order, count, out, k, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * ROWS
    n = tl.load(count)
    if start >= n:
        return
    rows = start + tl.arange(0, ROWS)
    own = rows < n
    pair = tl.load(order + rows, mask=own, other=0).to(tl.int64)
    weight = tl.load(w + pair, mask=own, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = own[:, None] & (c + cols < D)[None, :]
        gy = tl.load(grad + (pair // k)[:, None] * D + (c + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        value = (weight[:, None] * gy).to(out.dtype.element_ty)
        tl.store(out + rows[:, None] * D + (c + cols)[None, :], value, mask=m)


@triton.jit
def _combine_grad_w(grad, h, inverse, count, out, T, k, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = tokens < T
    n = tl.load(count)
    cols = tl.arange(0, BLOCK)
    for j in range(k):
        r = tl.load(inverse + tokens * k + j, mask=live, other=0).to(tl.int64)
        valid = live & (r < n)
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for c in range(0, D, BLOCK):
            m = valid[:, None] & (c + cols < D)[None, :]
            gy = tl.load(grad + tokens[:, None] * D + (c + cols)[None, :], mask=m, other=0.0).to(tl.float32)
            acc += gy * tl.load(h + r[:, None] * D + (c + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out + tokens * k + j, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=live)


# ------------------------------------------------------------------------------------- launchers
def _tiles(n: int) -> tuple[int]:
    return (triton.cdiv(n, ROWS),)


def gather_rows(x: Tensor, order: Tensor, count: Tensor, k: int, zero_tail: bool) -> Tensor:
    x = x.contiguous()
    rows, d = order.numel(), x.shape[1]
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    _gather[_tiles(rows)](x, order, count, out, rows, k, d, ZERO_TAIL=zero_tail, ROWS=ROWS, BLOCK=_block(d))
    return out


def gather_rows_backward(grad: Tensor, inverse: Tensor, count: Tensor, k: int) -> Tensor:
    tokens, d = inverse.numel() // k, grad.shape[1]
    out = torch.empty(tokens, d, dtype=grad.dtype, device=grad.device)
    _gather_backward[_tiles(tokens)](grad.contiguous(), inverse, count, out, tokens, k, d, ROWS=ROWS, BLOCK=_block(d))
    return out


def act_rows(gu: Tensor, count: Tensor, act: str, zero_tail: bool) -> Tensor:
    rows, ffn = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, ffn, dtype=gu.dtype, device=gu.device)
    code = ACT_CODES[act]
    _act[_tiles(rows)](
        gu.contiguous(), count, out, rows, ffn, ACT=code, ZERO_TAIL=zero_tail, ROWS=ROWS, BLOCK=_block(ffn)
    )
    return out


def act_rows_backward(grad: Tensor, gu: Tensor, count: Tensor, act: str) -> Tensor:
    out = torch.empty_like(gu)
    ffn = gu.shape[1] // 2
    _act_backward[_tiles(gu.shape[0])](
        grad.contiguous(), gu.contiguous(), count, out, ffn, ACT=ACT_CODES[act], ROWS=ROWS, BLOCK=_block(ffn)
    )
    return out


def combine_rows(h: Tensor, w: Tensor, inverse: Tensor, count: Tensor, k: int, out_dtype: torch.dtype) -> Tensor:
    tokens, d = w.shape[0], h.shape[1]
    out = torch.empty(tokens, d, dtype=out_dtype, device=h.device)
    _combine[_tiles(tokens)](
        h.contiguous(), w.contiguous(), inverse, count, out, tokens, k, d, ROWS=ROWS, BLOCK=_block(d)
    )
    return out


def combine_rows_backward(
    grad: Tensor, h: Tensor, w: Tensor, order: Tensor, inverse: Tensor, count: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    grad, h, w = grad.contiguous(), h.contiguous(), w.contiguous()
    tokens, d = w.shape[0], h.shape[1]
    grad_h = torch.empty_like(h)
    grad_w = torch.empty_like(w)
    _combine_grad_h[_tiles(h.shape[0])](grad, w, order, count, grad_h, k, d, ROWS=ROWS, BLOCK=_block(d))
    _combine_grad_w[_tiles(tokens)](grad, h, inverse, count, grad_w, tokens, k, d, ROWS=ROWS, BLOCK=_block(d))
    return grad_h, grad_w
