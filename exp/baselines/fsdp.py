"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over ranks.

Each transformer block (each element of the model's outermost ``nn.ModuleList``) is one FSDP unit
and the root takes the remaining parameters (embeddings, final norm, head).  Forward all-gathers a
unit's parameters just before it runs (and frees them after); backward all-gathers them again and
reduce-scatters the gradients, which FSDP averages over ranks -- so the loop back-propagates
``N * L_r`` to obtain ``sum_r dL_r/dw`` (see baseline_util.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from baseline_util import Prepared, transformer_blocks

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # older torch keeps FSDP2 under the composable namespace
    from torch.distributed._composable.fsdp import fully_shard


def prepare(model: nn.Module, rank: int, world: int, device: torch.device) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh

    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Prepared(model, loss_scale=float(world), info={"fsdp_units": len(blocks) + 1})
