"""Grouped matrix multiply and on-device expert routing, the kernels of the routed-experts op.

Grouped matmul
--------------
``grouped_mm(a[S,K], b[G,K,N], offsets[G]) -> out[S,N]`` with ``offsets`` the int32 cumulative row
counts of the groups (``offsets[g]`` ends group ``g``; rows at or past ``offsets[G-1]`` belong to no
group)::

    out[r] = a[r] @ b[g]    for offsets[g-1] <= r < offsets[g]   (offsets[-1] := 0)
    out[r] = 0              for r >= offsets[G-1]

On a CUDA device of compute capability 8.0 or more, in bfloat16 with ``K`` and ``N`` multiples of 8
(16-byte rows), it is torch's ``grouped_mm`` kernel: one launch, no host synchronization, static
shapes, differentiable (its backward is two more grouped matmuls), lowered by inductor.  The kernel
leaves rows past the last offset unwritten, so callers mask them (:func:`masked_rows`) before a
value reaches a sum.  Everywhere else (the CPU, float32 and float64, misaligned dims) it is the
masked form ``out = sum_g [group(r) = g] * (a @ b[g])``: ``G`` dense matmuls over all ``S`` rows,
exact, sync-free and differentiable with plain autograd, at ``G`` times the FLOPs; it is what the
CPU tests and float64 verification run.

Routing
-------
:func:`route` turns ``top_k_index[T,k]`` (global expert ids) into the permutation that sorts the
``S = T k`` (token, slot) pairs by local expert ``e = id - offset`` for the ``E_l`` experts
``[offset, offset + E_l)`` a rank holds; pairs routed elsewhere take the sentinel key ``E_l`` and sort
last.  ``offsets = searchsorted(sorted keys, [0 .. E_l), right)`` counts the pairs at or below each
expert, so no histogram and no host synchronization are needed: every shape is fixed by ``T``, ``k``
and ``E_l`` alone, and a step with it is captured as one CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "Routing",
    "route",
    "inverse_permutation",
    "grouped_mm",
    "masked_grouped_mm",
    "native_grouped_mm",
    "masked_rows",
    "compute_dtype",
]

# activation name -> the function applied to the gate half
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs of one rank's experts in expert order (module docstring).

    ``order[i]`` is the flat pair index ``t k + j`` of sorted row ``i``; ``token = order // k``;
    ``valid[i]`` says whether row ``i`` goes to one of the rank's experts; ``offsets`` (int32, one per
    local expert) ends each expert's rows; ``inverse`` undoes ``order``."""

    order: Tensor
    token: Tensor
    valid: Tensor
    offsets: Tensor
    inverse: Tensor

    @property
    def count(self) -> Tensor:
        """The rows of the rank's experts (the last offset), as a one-element device tensor: the row
        steps (:mod:`hidup.rules.expert_rows`) read it on the device and skip the rows past it."""
        return self.offsets[-1:]


def route(top_k_index: Tensor, expert_offset: int, local_experts: int) -> Routing:
    """Sort the pairs of ``top_k_index[T,k]`` by local expert, pairs of other ranks' experts last."""
    k = top_k_index.shape[1]
    key = top_k_index.reshape(-1) - expert_offset
    key = torch.where((key >= 0) & (key < local_experts), key, torch.full_like(key, local_experts))
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(local_experts, device=key.device, dtype=sorted_key.dtype)
    offsets = torch.searchsorted(sorted_key, bounds, right=True).to(torch.int32)
    token = torch.div(order, k, rounding_mode="floor")
    return Routing(order, token, sorted_key < local_experts, offsets, inverse_permutation(order))


def inverse_permutation(order: Tensor) -> Tensor:
    """``inverse`` with ``inverse[order[i]] = i`` (on the device, no sort)."""
    rows = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, rows)


def native_grouped_mm(a: Tensor, b: Tensor) -> bool:
    """Whether torch's grouped kernel runs ``a[S,K] @ b[G,K,N]`` (module docstring's conditions).

    Fake and meta tensors on a CUDA device count as CUDA; a meta tensor without a device counts
    when it is bfloat16 and aligned, so traced memory follows what a GPU would run."""
    if _GROUPED_MM is None or a.dtype != torch.bfloat16 or b.dtype != a.dtype:
        return False
    if a.shape[-1] % 8 or b.shape[-1] % 8:
        return False
    if a.device.type == "meta":
        return True
    if a.device.type != "cuda":
        return False
    try:
        return torch.cuda.get_device_capability(a.device) >= (8, 0)
    except (RuntimeError, AssertionError):  # a fake CUDA tensor on a machine without CUDA
        return True


def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """``out[S,N]`` of the module docstring; rows past the last offset are unspecified on the native path."""
    if native_grouped_mm(a, b):
        return _GROUPED_MM(a, b, offs=offsets)
    return masked_grouped_mm(a, b, offsets)


def masked_grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """The masked form of :func:`grouped_mm` (module docstring): exact anywhere, rows past the last
    offset zero, at ``G`` times the FLOPs."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offsets.dtype)
    group = torch.searchsorted(offsets, rows, right=True)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g in range(b.shape[0]):
        out = out + torch.where((group == g).unsqueeze(-1), a @ b[g], 0)
    return out


def masked_rows(t: Tensor, valid: Tensor) -> Tensor:
    """``t`` with the rows where ``valid`` is false set to zero (by selection: no NaN passes)."""
    return torch.where(valid.unsqueeze(-1), t, torch.zeros((), dtype=t.dtype, device=t.device))


def compute_dtype(x: Tensor, *weights: Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` and ``weights`` runs in: autocast's where it is on for their
    device (as ``F.linear`` would), else their promoted dtype."""
    kind = x.device.type
    if kind in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(kind):
                return torch.get_autocast_dtype(kind)
        except (TypeError, RuntimeError):  # torch < 2.4: only the CUDA flag, without a device
            if kind == "cuda" and torch.is_autocast_enabled():
                return torch.get_autocast_gpu_dtype()
    dtype = x.dtype
    for w in weights:
        dtype = torch.promote_types(dtype, w.dtype)
    return dtype
