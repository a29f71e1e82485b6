"""One device running one rank's share: the model of the ``N``-rank configuration (same experts)
on ``batch_per_gpu`` groups, with no communication at all.  Its iteration time is the floor a
perfectly scaling ``N``-rank scheme would reach, and ``N`` times its throughput the ceiling.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from baseline_util import Prepared


def prepare(model: nn.Module, rank: int, world: int, device: torch.device) -> Prepared:
    model.to(device)
    return Prepared(model, loss_scale=1.0)
