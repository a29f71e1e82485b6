"""How evenly a MoE model's routers spread a batch over the experts a rank holds.

A rank that holds a block of ``E / N`` of a layer's ``E`` experts (the expert signature of the
routed-experts op, :mod:`hidup.rules.experts`: rank ``r`` keeps experts ``[r E / N, (r + 1) E / N)``)
runs their grouped GEMMs on the (token, slot) pairs its block receives.  Its *load* is that count
over a balanced one: with ``P`` pairs in the world's batch and ``P_r`` of them routed to block ``r``,
``load_r = N P_r / P`` (1 under balanced routing, the cost model's assumption,
:mod:`hidup.search.experts_cost`).  It is measured here from the model's own routers, by hooks on
the ``transformers`` experts modules that read each layer's ``top_k_index``:

* ``world``: the pairs of the whole batch (every rank's rows), what block ``r`` gets in a real
  ``N``-rank step;
* ``mirrored``: ``N`` times the pairs of the rank's own rows, what it gets in ``hidup bench-rank``'s
  stand-in world, where every rank holds this rank's data (:mod:`hidup.runtime.bench_rank`).

A step's expert GEMMs follow the load of the block, so a rank whose block draws more than its
share of pairs takes longer than the price, which assumes 1.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hidup.rules.experts import experts_layout_activation

__all__ = ["expert_loads"]


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if experts_layout_activation(m) is not None}


def _routed(model: nn.Module, layers: dict[str, nn.Module], inputs: list, autocast_dtype) -> dict[str, torch.Tensor]:
    """``{experts module name: top_k_index}`` of the experts modules ``layers`` in one forward of ``model``
    on ``inputs``."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in layers.items():

        def keep(_module, args, kwargs, name=name):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            seen[name] = index.detach()

        hooks.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    device = next(model.parameters()).device
    cast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), cast:
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _block_loads(index: torch.Tensor, experts: int, world: int) -> list[float]:
    """``load_r`` for every block ``r`` of ``experts / world`` experts (module docstring)."""
    counts = torch.bincount(index.reshape(-1).long(), minlength=experts).double()
    blocks = counts.reshape(world, experts // world).sum(1)
    return (blocks * world / counts.sum()).tolist()


def expert_loads(model: nn.Module, world_inputs: list, rank_inputs: list, world: int, rank: int, autocast_dtype=None):
    """Per experts layer of ``model``, the load of rank ``rank``'s block (module docstring) in the world
    (``world_inputs``: every rank's rows) and in the mirrored world (``rank_inputs``: this rank's),
    and the largest block's in the world; None for a model without modelled experts or whose
    experts do not split ``world`` ways."""
    layers = _layers(model)
    if not layers:
        return None
    experts = {name: m.gate_up_proj.shape[0] for name, m in layers.items()}
    if any(e % world for e in experts.values()):
        return None
    in_world = _routed(model, layers, world_inputs, autocast_dtype)
    mirrored = _routed(model, layers, rank_inputs, autocast_dtype)
    out = {}
    for name in layers:
        world_blocks = _block_loads(in_world[name], experts[name], world)
        own = _block_loads(mirrored[name], experts[name], world)
        out[name] = {"world": world_blocks[rank], "mirrored": own[rank], "world_max": max(world_blocks)}
    return out
