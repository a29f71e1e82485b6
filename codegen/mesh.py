"""The process groups of a device mesh of several axes, and where a rank sits on it.

A plan searched for a mesh ``(n_0, n_1, ...)`` (outer axis first, :mod:`hidup.ir`, "Meshes") runs on
``prod n_k`` ranks; rank ``r`` of the job sits at coordinates ``numpy.unravel_index(r, mesh)``
(row-major, as in torch's ``DeviceMesh``).  Axis ``k`` has one process group per set of ranks that
share every other coordinate -- ``n_k`` ranks differing only in coordinate ``k`` -- and each one-axis
step of a layout change (:class:`hidup.ir.MeshStep`) is an ordinary one-axis form change of the local
tensor on this rank's group of that axis.

:class:`MeshGroups` holds one rank's view: the mesh, its coordinates, its group on every axis (from
:func:`torch.distributed.device_mesh.init_device_mesh`'s ``DeviceMesh.get_group(axis)``, which works
on gloo and NCCL alike) and the group of all the mesh's ranks.  Duplication's two copies communicate
on two sets of axis groups (one :class:`MeshGroups` each) on CUDA, as they use two process groups on
one axis; :func:`mesh_groups` makes and caches them, since creating groups is collective and slow
while a set can serve any number of compiled modules.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.distributed as dist

from hidup.codegen import compiled
from hidup.ir import mesh_text

__all__ = ["MeshGroups", "mesh_groups", "coordinates", "current_group", "using_group", "running"]

_GROUP = threading.local()  # the process group (or MeshGroups) the generated code communicates on


def coordinates(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Coordinates of ``rank`` on ``mesh``, outer axis first (row-major)."""
    if not 0 <= rank < math.prod(mesh):
        raise ValueError(f"rank {rank} is outside a mesh of {math.prod(mesh)} ranks {mesh}")
    out = []
    for size in reversed(mesh):
        rank, c = divmod(rank, size)
        out.append(c)
    return tuple(reversed(out))


class MeshGroups:
    """One rank's process groups on a device mesh (module docstring): ``axes[k]`` its group of
    mesh axis ``k`` (``None`` when no process group is initialized: one process simulates every
    rank, each collective then the identity), ``world`` the group of every rank of the mesh."""

    def __init__(self, mesh: tuple[int, ...], coords: tuple[int, ...], axes: tuple, world=None, device_mesh=None):
        self.mesh, self.coords, self.axes, self.world = tuple(mesh), tuple(coords), tuple(axes), world
        self.device_mesh = device_mesh
        self.default = None  # the default process group when these groups were made

    def __repr__(self) -> str:
        return f"MeshGroups(mesh={self.mesh}, coords={self.coords})"


_CACHE: dict[tuple, MeshGroups] = {}


def mesh_groups(mesh: tuple[int, ...], rank: int, group=None, device_type: str = "cpu", copy: int = 0) -> MeshGroups:
    """This rank's :class:`MeshGroups` on ``mesh`` over the ranks of ``group`` (None: the default
    group), rank ``rank`` being this process's rank in ``group``.  Collective on first use for a
    (mesh, group, device type, ``copy``): every rank of ``group`` must call it; later calls return
    the same groups (``copy`` 1 asks for a second, distinct set, duplication's second copy's)."""
    mesh = tuple(mesh)
    coords = coordinates(rank, mesh)
    if not (dist.is_available() and dist.is_initialized()):
        return MeshGroups(mesh, coords, (None,) * len(mesh), group)
    key = (mesh, id(group), device_type, copy)
    hit = _CACHE.get(key)
    if hit is not None and hit.coords == coords and hit.default is dist.group.WORLD:
        return hit  # made in this process group's lifetime (a test may destroy it and start another)
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if len(ranks) != math.prod(mesh):
        raise ValueError(f"mesh {mesh_text(mesh)} holds {math.prod(mesh)} ranks; the process group has {len(ranks)}")
    from torch.distributed.device_mesh import DeviceMesh

    device_mesh = DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int64).view(mesh))
    axes = tuple(device_mesh.get_group(k) for k in range(len(mesh)))
    if copy:  # the whole mesh's group of a copy: its own communicator too
        world = dist.new_group(ranks)
    else:
        world = group
    out = MeshGroups(mesh, coords, axes, world, device_mesh)
    out.default = dist.group.WORLD
    _CACHE[key] = out
    return out


def current_group():
    """The process group the generated code communicates on (set by :func:`using_group`)."""
    return getattr(_GROUP, "group", None)


@contextlib.contextmanager
def using_group(group):
    """Run generated code on ``group``: a process group, or on a device mesh a
    :class:`MeshGroups` (one group per axis)."""
    before = getattr(_GROUP, "group", None)
    before_key, before_axes = compiled.ACTIVE.key, compiled.ACTIVE.axis_keys
    _GROUP.group = group
    _GROUP.depth = getattr(_GROUP, "depth", 0) + 1
    if isinstance(group, MeshGroups):
        compiled.ACTIVE.set(compiled.group_key(group.world), tuple(compiled.group_key(g) for g in group.axes))
    else:
        compiled.ACTIVE.set(compiled.group_key(group))
    try:
        yield
    finally:
        _GROUP.group = before
        _GROUP.depth -= 1
        compiled.ACTIVE.set(before_key, before_axes)


def running() -> bool:
    """Whether generated code runs now on this thread (inside :func:`using_group`): ``current_group()``
    None then means the default process group, outside it no group at all."""
    return getattr(_GROUP, "depth", 0) > 0
