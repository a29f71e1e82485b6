"""Physically sharded parameters and their logical (single-device) layout.

A compiled module holds, for every parameter or buffer of the original model, one local tensor:
the whole tensor for ``replicate`` (or ``full``) and only this rank's slice for ``gather_d``
(``X[..., r*n/N:(r+1)*n/N, ...]`` along ``d``, so memory really drops by N).  :class:`ParamShard`
records the logical name, logical shape and form; :func:`shard_tensor` maps a logical tensor to
the local piece and :func:`gather_tensor` back (an all-gather along ``d``).  The map lives on the
module as ``module.param_shards`` (local attribute name -> ParamShard); modules without it are
treated as unsharded (every tensor ``replicate``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from hidup.codegen.collectives import apply_op, rank_of, world_of
from hidup.ir import FULL, REPLICATE, Form

__all__ = [
    "ParamShard",
    "shard_tensor",
    "gather_tensor",
    "iter_shards",
    "full_state_dict",
    "full_grad_dict",
    "load_full_state_dict",
    "local_name",
]


@dataclass(frozen=True)
class ParamShard:
    """One parameter/buffer of the original model as this rank stores it."""

    logical_name: str  # dotted name in the original model ("layers.0.attn.qkv.weight")
    logical_shape: tuple[int, ...]
    form: Form  # gather_d (a slice is stored) or replicate/full (the whole tensor is stored)
    is_buffer: bool = False

    @property
    def sharded(self) -> bool:
        return self.form.is_gather


def local_name(logical_name: str) -> str:
    """Attribute name of a logical parameter inside a compiled module (dots are not allowed)."""
    return logical_name.replace(".", "__")


def shard_tensor(full: torch.Tensor, form: Form, rank: int, world: int) -> torch.Tensor:
    """This rank's stored piece of the logical tensor ``full`` (a contiguous copy for gather)."""
    if not form.is_gather or world == 1:
        return full
    if form.dim >= full.dim() or full.shape[form.dim] % world:
        raise ValueError(f"cannot shard a tensor of shape {tuple(full.shape)} as {form} over {world} ranks")
    k = full.shape[form.dim] // world
    return full.narrow(form.dim, rank * k, k).contiguous()


def gather_tensor(local: torch.Tensor, form: Form, group=None) -> torch.Tensor:
    """The logical tensor from every rank's stored piece (collective for gather forms)."""
    if not form.is_gather or world_of(group) == 1:
        return local
    return apply_op("all_gather", local.detach(), form, FULL, group)


def iter_shards(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, ParamShard]]:
    """(local name, local tensor, ParamShard) for every parameter and buffer of ``module``."""
    shards = getattr(module, "param_shards", None)
    if shards is None:
        for name, p in module.named_parameters():
            yield name, p, ParamShard(name, tuple(p.shape), REPLICATE)
        for name, b in module.named_buffers():
            yield name, b, ParamShard(name, tuple(b.shape), REPLICATE, is_buffer=True)
        return
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    for name, shard in shards.items():
        if name not in tensors:
            raise KeyError(f"compiled module lists parameter {name!r} ({shard.logical_name}) but does not hold it")
        yield name, tensors[name], shard


def full_state_dict(module: nn.Module, group=None) -> "OrderedDict[str, torch.Tensor]":
    """Every parameter and buffer in its logical (unsharded) layout, keyed by its name in the
    original model; a collective: every rank of ``group`` must call it (all receive the result)."""
    group = getattr(module, "group", None) if group is None else group
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _, t, shard in iter_shards(module):
        full = gather_tensor(t.detach(), shard.form, group)
        if tuple(full.shape) != shard.logical_shape:
            raise RuntimeError(
                f"{shard.logical_name}: gathered shape {tuple(full.shape)} differs from the "
                f"logical shape {shard.logical_shape}"
            )
        out[shard.logical_name] = full if shard.sharded and world_of(group) > 1 else full.clone()  # never alias
    return out


def full_grad_dict(module: nn.Module, group=None) -> "OrderedDict[str, torch.Tensor | None]":
    """Every parameter's gradient in its logical layout (None where it has none); collective.

    Call after the backward (replicated gradients are then already summed over ranks)."""
    group = getattr(module, "group", None) if group is None else group
    out: OrderedDict[str, torch.Tensor | None] = OrderedDict()
    for _, t, shard in iter_shards(module):
        if shard.is_buffer:
            continue
        if t.grad is None:
            out[shard.logical_name] = None
        else:
            g = gather_tensor(t.grad.detach(), shard.form, group)
            out[shard.logical_name] = g if shard.sharded and world_of(group) > 1 else g.clone()
    return out


def load_full_state_dict(module: nn.Module, state: dict, group=None, strict: bool = True) -> None:
    """Copy logical tensors into the module's stored pieces (re-sharding for this rank/world)."""
    group = getattr(module, "group", None) if group is None else group
    rank, world = rank_of(group), world_of(group)
    seen = set()
    for _, t, shard in iter_shards(module):
        if shard.logical_name not in state:
            if strict:
                raise KeyError(f"state has no entry for {shard.logical_name!r}")
            continue
        full = state[shard.logical_name]
        if tuple(full.shape) != shard.logical_shape:
            raise ValueError(
                f"{shard.logical_name}: state holds shape {tuple(full.shape)}, the model expects {shard.logical_shape}"
            )
        with torch.no_grad():
            t.copy_(shard_tensor(full, shard.form, rank, world).to(t.device, t.dtype))
        seen.add(shard.logical_name)
    extra = set(state) - seen
    if strict and extra:
        raise KeyError(f"state has entries the model does not know: {sorted(extra)[:5]}")
