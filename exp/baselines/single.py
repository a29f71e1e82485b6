"""One device running one rank's share: the model of the ``N``-rank configuration (same experts)
on ``batch_per_gpu`` groups, with no communication at all.  Its iteration time is the floor a
perfectly scaling ``N``-rank scheme would reach, and ``N`` times its throughput the ceiling; its
fastest variant (typically compiled and captured as one CUDA graph) is the fair floor.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from exp.baselines.baseline_util import EAGER, Options, Prepared, compile_module


def prepare(model: nn.Module, rank: int, world: int, device: torch.device, opts: Options = EAGER) -> Prepared:
    model.to(device)
    return Prepared(compile_module(model, opts), info={"compile": "whole model" if opts.compile else None})
