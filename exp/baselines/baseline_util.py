"""What every baseline hands to the common train loop, and bucketed gradient all-reduce.

A baseline turns the single-device zoo model into one rank's module (``prepare``) and says how the
loss and gradients relate to the single-device ones.  The zoo's loss is a sum over groups, so with
each rank running ``B/N`` of the ``B`` groups the global loss is ``L = sum_r L_r`` and its gradient
``dL/dw = sum_r dL_r/dw``.  DDP and FSDP *average* gradients over ranks, so they back-propagate
``N * L_r`` (``loss_scale = N``) to get ``sum_r dL_r/dw``; hand-written schemes sum directly.

Bucketed all-reduce (:class:`OverlappedGradSum`): gradients are packed into flat buffers of at
most ``bucket_bytes`` (one collective per bucket instead of one per tensor), summed over ranks and
unpacked, during the backward as DDP does: parameters are bucketed in
reverse registration order (roughly the order backward produces their gradients); when every
gradient of a bucket has been accumulated the bucket's asynchronous all-reduce starts, buckets are
launched strictly in index order (so every rank issues the same sequence of collectives), and
``finish()`` waits for them and writes the sums back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

BUCKET_BYTES = 25 << 20  # DDP's default bucket size


@dataclass
class Prepared:
    """One rank's module plus the glue the train loop needs."""

    module: nn.Module
    loss_scale: float = 1.0  # backward runs on loss * loss_scale
    after_backward: Callable[[], None] | None = None  # e.g. gradient all-reduce
    info: dict = field(default_factory=dict)  # extra facts for the result dict


class OverlappedGradSum:
    """Sum the gradients of ``params`` over ranks with bucketed all-reduces overlapping the backward."""

    def __init__(self, params: list[nn.Parameter], group=None, bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        size, dtype = 0, None
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or p.dtype != dtype or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size, dtype = 0, p.dtype
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._reset()
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for b in self.buckets for p in b]

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.next = 0
        self.pending: list[tuple[int, torch.Tensor, object]] = []

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self.pending.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def _hook(self, p: nn.Parameter) -> None:
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)
            self.next += 1

    def finish(self) -> None:
        """Launch the buckets still waiting (parameters without a gradient count as zeros), wait for
        every all-reduce, and copy the sums into ``.grad``."""
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for i, flat, work in self.pending:
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                if p.grad is None:
                    p.grad = flat[offset:offset + n].view_as(p).clone()
                else:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._reset()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: the elements of its outermost ``nn.ModuleList``s."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():  # pre-order: outer lists come first
        if isinstance(module, nn.ModuleList) and not any(name.startswith(t + ".") for t in taken):
            taken.append(name)
            blocks.extend(module)
    return blocks
