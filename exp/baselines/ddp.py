"""PyTorch DistributedDataParallel: every parameter replicated, gradients averaged by DDP's
bucketed, backward-overlapped all-reduce.

Rank ``r`` runs groups ``r B/N .. (r+1) B/N - 1`` of the batch.  DDP averages gradients, so the
loop back-propagates ``N * L_r`` and the parameters see ``sum_r dL_r/dw = dL/dw``
(see baseline_util.py).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from baseline_util import Prepared


def prepare(model: nn.Module, rank: int, world: int, device: torch.device) -> Prepared:
    model.to(device)
    ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
    # Buffers are identical on every rank (same seed), so do not re-broadcast them every forward.
    params = inspect.signature(DDP.__init__).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    module = DDP(model, device_ids=ids, **no_sync)
    return Prepared(module, loss_scale=float(world))
