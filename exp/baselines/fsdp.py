"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over ranks.

Each transformer block (each element of the model's outermost ``nn.ModuleList``) is one FSDP unit
and the root takes the remaining parameters (embeddings, final norm, head).  Forward all-gathers a
unit's parameters just before it runs (and frees them after); backward all-gathers them again and
reduce-scatters the gradients, which FSDP averages over ranks -- so the loop back-propagates
``N w_r L_r`` to obtain ``sum_r w_r dL_r/dw`` (see baseline_util.py).

bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, as torchtitan trains: the
all-gathers move bf16 parameters (half the bytes) and the compute runs on them, while gradients are
reduced and the sharded parameters and optimizer state kept in fp32.  The step still runs under
the same bf16 autocast as every other method, so ops autocast keeps in fp32 (softmax, norms, the
loss) stay in fp32.

``compile``: each block is compiled before it is sharded (torchtitan's order), so FSDP's
all-gather and reduce-scatter hooks stay outside the compiled regions.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from exp.baselines.baseline_util import EAGER, Options, Prepared, compile_module, outer_module_lists

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # older torch keeps FSDP2 under the composable namespace
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


def prepare(model: nn.Module, rank: int, world: int, device: torch.device, opts: Options = EAGER) -> Prepared:
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if opts.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    units = 0
    for blocks in outer_module_lists(model):
        for i in range(len(blocks)):
            blocks[i] = compile_module(blocks[i], opts)
            fully_shard(blocks[i], mesh=mesh, mp_policy=mp)
            units += 1
    fully_shard(model, mesh=mesh, mp_policy=mp)
    info = {
        "fsdp_units": units + 1,
        "compile": "per block" if opts.compile else None,
        "mixed_precision": "param bf16, reduce fp32" if opts.precision == "bf16" else None,
    }
    return Prepared(model, grads_averaged=True, info=info)
