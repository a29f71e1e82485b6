"""Physically sharded parameters and their logical (single-device) layout.

A compiled module holds, for every parameter or buffer of the original model, one local tensor:
the whole tensor for ``replicate`` (or ``full``) and only this rank's slice for ``gather_d``
(``X[..., r*n/N:(r+1)*n/N, ...]`` along ``d``, so memory really drops by N).  :class:`ParamShard`
records the logical name, logical shape and form; :func:`shard_tensor` maps a logical tensor to
the local piece and :func:`gather_tensor` back (an all-gather along ``d``).  The map lives on the
module as ``module.param_shards`` (local attribute name -> ParamShard); modules without it are
treated as unsharded (every tensor ``replicate``).

On a device mesh (:mod:`hidup.codegen.mesh`) the form is a :class:`~hidup.ir.Layout` and the
sharding nests: the rank at coordinates ``(c_0, c_1, ...)`` stores slice ``c_0`` of axis 0's split,
then slice ``c_1`` of axis 1's split of that piece, and so on (``Layout.local_shape``).  Gathering
goes the other way, innermost axis first, each an all-gather on that axis's group; the helpers
below then take the module's :class:`~hidup.codegen.mesh.MeshGroups` (``module.mesh_groups``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from hidup.codegen.collectives import apply_op, rank_of, world_of
from hidup.codegen.mesh import MeshGroups, coordinates
from hidup.ir import FULL, REPLICATE, Form, Layout

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
    form: Form | Layout  # gather_d (a slice is stored) or replicate/full (the whole tensor); a Layout on a mesh
    is_buffer: bool = False

    @property
    def sharded(self) -> bool:
        return self.form.is_gather


def local_name(logical_name: str) -> str:
    """Attribute name of a logical parameter inside a compiled module (dots are not allowed)."""
    return logical_name.replace(".", "__")


def shard_tensor(
    full: torch.Tensor, form: Form | Layout, rank: int, world: int, mesh: tuple[int, ...] | None = None
) -> torch.Tensor:
    """This rank's stored piece of the logical tensor ``full`` (a contiguous copy for gather); a
    :class:`~hidup.ir.Layout` ``form`` is cut on ``mesh`` (module docstring)."""
    if isinstance(form, Layout):
        if mesh is None or len(mesh) != len(form.forms):
            raise ValueError(f"layout {form} needs the device mesh it was chosen for, got mesh={mesh}")
        for f, c, n in zip(form.forms, coordinates(rank, tuple(mesh)), mesh):
            full = shard_tensor(full, f, c, n)
        return full
    if not form.is_gather or world == 1:
        return full
    if form.dim >= full.dim() or full.shape[form.dim] % world:
        raise ValueError(f"cannot shard a tensor of shape {tuple(full.shape)} as {form} over {world} ranks")
    k = full.shape[form.dim] // world
    return full.narrow(form.dim, rank * k, k).contiguous()


def gather_tensor(local: torch.Tensor, form: Form | Layout, group=None) -> torch.Tensor:
    """The logical tensor from every rank's stored piece (collective for gather forms); for a
    :class:`~hidup.ir.Layout` ``group`` is the :class:`~hidup.codegen.mesh.MeshGroups`."""
    if isinstance(form, Layout):
        if not isinstance(group, MeshGroups):
            raise ValueError(f"layout {form} is gathered on the mesh's groups (a MeshGroups), got {group!r}")
        out = local.detach()
        for axis in reversed(range(len(form.forms))):
            f = form.forms[axis]
            if f.is_gather and world_of(group.axes[axis]) > 1:
                out = apply_op("all_gather", out, f, FULL, group.axes[axis])
        return out
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
    group = _groups_of(module) if group is None else group
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _, t, shard in iter_shards(module):
        full = gather_tensor(t.detach(), shard.form, group)
        if tuple(full.shape) != shard.logical_shape:
            raise RuntimeError(
                f"{shard.logical_name}: gathered shape {tuple(full.shape)} differs from the "
                f"logical shape {shard.logical_shape}"
            )
        out[shard.logical_name] = full if shard.sharded and _ranks(group) > 1 else full.clone()  # never alias
    return out


def full_grad_dict(module: nn.Module, group=None) -> "OrderedDict[str, torch.Tensor | None]":
    """Every parameter's gradient in its logical layout (None where it has none); collective.

    Call after the backward (replicated gradients are then already summed over ranks; a ZeRO-2
    parameter's are gathered from the ranks' rows, :mod:`hidup.codegen.zero`)."""
    group = _groups_of(module) if group is None else group
    zero = getattr(module, "zero", None)
    out: OrderedDict[str, torch.Tensor | None] = OrderedDict()
    for _, t, shard in iter_shards(module):
        if shard.is_buffer:
            continue
        z = zero.by_param.get(id(t)) if zero else None
        if z is not None and world_of(group) > 1:  # ZeRO: the summed gradient is whole (stage 1) or in rows
            out[shard.logical_name] = zero.full_grad(z) if t.grad is None else t.grad.detach().clone()
        elif t.grad is None:
            out[shard.logical_name] = None
        else:
            g = gather_tensor(t.grad.detach(), shard.form, group)
            out[shard.logical_name] = g if shard.sharded and _ranks(group) > 1 else g.clone()
    return out


def load_full_state_dict(module: nn.Module, state: dict, group=None, strict: bool = True) -> None:
    """Copy logical tensors into the module's stored pieces (re-sharding for this rank/world)."""
    group = _groups_of(module) if group is None else group
    mesh = group.mesh if isinstance(group, MeshGroups) else None
    rank, world = rank_of(_world_group(group)), world_of(_world_group(group))
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
            t.copy_(shard_tensor(full, shard.form, rank, world, mesh).to(t.device, t.dtype))
        seen.add(shard.logical_name)
    extra = set(state) - seen
    if strict and extra:
        raise KeyError(f"state has entries the model does not know: {sorted(extra)[:5]}")


def _groups_of(module: nn.Module):
    """The groups a module's parameters are sharded over: its MeshGroups on a mesh, else its group."""
    mesh = getattr(module, "mesh_groups", None)
    return mesh if mesh is not None else getattr(module, "group", None)


def _world_group(group):
    return group.world if isinstance(group, MeshGroups) else group


def _ranks(group) -> int:
    return world_of(_world_group(group))
