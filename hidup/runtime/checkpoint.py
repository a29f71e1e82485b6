"""Atomic checkpoints that scale: every rank writes and reads only its own shards.

What a checkpoint holds (format 2, a directory written by ``torch.distributed.checkpoint``, DCP):

* ``model.<name>`` for every parameter/buffer of the original model (its logical name and shape).
  A tensor stored ``gather_d`` is saved as this rank's slice ``X[..., r*n/N:(r+1)*n/N, ...]`` of the
  logical ``X`` (offset ``r*n/N`` along ``d``); a replicated one is written once, by one rank (DCP
  deduplicates a key every rank holds whole and spreads such keys over the ranks by size; the value
  is the same on every rank, as a compiled module all-reduces replicated gradients).  On a device
  mesh ``(n_0, n_1, ...)`` (:mod:`hidup.codegen.mesh`) a tensor has a :class:`~hidup.ir.Layout`,
  one form per axis, and the splits nest outer axis first: the rank at ``(c_0, c_1, ...)`` holds
  slice ``c_0`` of ``n_0`` along axis 0's dim, then slice ``c_1`` of ``n_1`` of that along axis 1's
  dim, and so on (``gather_0|gather_0`` on 2x2: rank ``(i, j)`` holds chunk ``2 i + j`` of four
  along dim 0, offset ``(2 i + j) n/4``; ``full|gather_1``: chunk ``j`` of two along dim 1).  Each
  distinct chunk is written once, by one of the ranks holding it (ranks differing only in the
  coordinates of ``full``/``replicate`` axes hold the same chunk; DCP deduplicates it as it does a
  whole tensor).
* ``optim.<name>.<key>`` for every per-element optimizer state tensor (one with the stored
  parameter's shape: Adam's ``exp_avg``, SGD's ``momentum_buffer``), sharded exactly as its
  parameter -- or, for a parameter ZeRO splits (:mod:`hidup.codegen.zero`), as the rows ``r n/N ..
  (r+1) n/N`` of dim 0 the rank's optimizer holds (a ``gather_0`` piece of the logical tensor), so a
  checkpoint of a ZeRO run resumes into a plan without ZeRO, or another stage or world size, and back.
  With the optimizer offloaded (:mod:`hidup.codegen.offload`) the state is the host copies', saved and
  loaded the same way, so a run resumes with or without offload; loading refreshes the host copies of
  the weights from the module's.
* ``meta`` (written by rank 0): format version, world size, step, loss history, ``extra``, and the
  optimizer's param groups (hyper-parameters, parameters by logical name) with its small state
  (Adam's ``step``: rank 0's, as it is equal on every rank).
* ``rng.<r>``: rank ``r``'s RNG states (torch, python, numpy, CUDA).
* ``.hidup-check.<r>.json`` (beside DCP's files): the step, and the size and CRC-32 of every file
  rank ``r`` wrote (rank 0's ``.metadata`` included), written and fsynced by each rank after DCP's
  save and before the rename.  :func:`load` checks them first, each loading rank the saved ranks
  ``q`` with ``q mod N' = r'``, and every rank raises :class:`CheckpointDamaged` if any check fails:
  a flipped byte, a truncated or missing file, or a file copied in from another checkpoint is named
  instead of being read.  A checkpoint written before these records has none and loads unchecked.

The shards are described to DCP as DTensors: ``DTensor.from_local(slice, mesh, [Shard(d)],
shape=logical_shape)`` on a 1-D DeviceMesh over the module's process group; for a plan on a mesh of
several axes on the module's own DeviceMesh (``module.mesh_groups.device_mesh``) with one placement
per axis, ``Shard(d)`` for ``gather_d`` and ``Replicate()`` for ``full``/``replicate``.  DTensor
applies nested placements outer axis first, each splitting what the axes before it left -- hidup's
order, which tests/test_mesh_checkpoint.py checks against the written chunks' offsets -- but splits
an uneven size ``torch.chunk``-wise where hidup splits only evenly, so a layout splitting a dim
unevenly on some axis is refused by name (hidup's own sharding refuses it too).  This is the public
torch 2.13 way to tell DCP "this rank holds this chunk of that global tensor" -- the default
planners then compute each chunk's offsets (``compute_local_shape_and_global_offset``), write one
file per rank, and on load give every rank the chunk its *current* DTensor asks for, read from
whichever saved chunks overlap it; ShardedTensor is deprecated and a hand-made planner or
``ChunkStorageMetadata`` would re-implement that bookkeeping.  The DTensors only wrap the module's
tensors for the call (no copy); the module keeps plain tensors.

Save is collective.  Every rank writes its files into ``.<name>.tmp`` next to ``path`` (created
fresh by rank 0; DCP fsyncs every file and writes ``.metadata`` last, from rank 0, after all ranks
finished); then rank 0 fsyncs the directory, renames the previous checkpoint to ``.<name>.old``,
renames the new one to ``path``, fsyncs the parent and deletes the old one (a directory cannot be
renamed over a non-empty one, hence two renames).  A failure or crash while writing leaves ``path``
untouched; one between the two renames leaves the complete previous checkpoint as
``.<name>.old``, which :func:`load` (and :func:`exists`) then use.  An error on any rank is raised
on every rank (DCP gathers the ranks' failures; rank 0's own steps are broadcast), so no rank waits
for one that gave up.  On several nodes ``path`` must be on a filesystem every rank sees (each
writes its own files there).

Load is collective when distributed: every rank reads the slice its current plan and world need
(``r'`` of ``N'`` along the current form's dim, or its nested chunk on a mesh, from whichever saved
chunks overlap it), so a run may resume on another world size, mesh or plan: a checkpoint of a 2x2
plan loads into a one-axis plan of 2 ranks or the plain model on one process, and one of 2 ranks
into a 2x2 plan.  Names and logical shapes are checked against DCP's
metadata before anything is read, so a checkpoint of another model is refused with the first
tensor that differs.  ``meta`` and the RNG states are read by each rank alone.  RNG states are
restored per rank when the world size is unchanged (a mesh counts its ranks), else every rank
takes rank 0's.
:func:`info` reads ``meta`` without a model.
A checkpoint of the earlier single-file format (version 1: one ``torch.save`` file of the gathered
logical tensors) still loads: ``path`` naming a file is read that way and re-sharded the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import socket
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hidup.codegen.collectives import rank_of, world_of
from hidup.codegen.params import iter_shards, load_full_state_dict, shard_tensor
from hidup.codegen.zero import iter_optimizer_shards
from hidup.ir import axis_forms, mesh_text

__all__ = ["save", "load", "info", "exists", "FORMAT_VERSION", "FolderLock", "CheckpointBusy", "CheckpointDamaged"]

FORMAT_VERSION = 2
_SINGLE_FILE_VERSION = 1


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _group(module, group):
    return getattr(module, "group", None) if group is None else group


def _siblings(path: Path) -> tuple[Path, Path]:
    """(the directory a save writes into, where the previous checkpoint waits during the swap)."""
    return path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def kept(path: str | os.PathLike) -> list[Path]:
    """The earlier checkpoints kept beside ``path`` (``save(..., keep=K)``), oldest first."""
    path = Path(path)
    found = []
    for p in path.parent.glob(f"{path.name}.step-*"):
        suffix = p.name[len(path.name) + len(".step-") :]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def _retire(old: Path, path: Path, keep: int) -> None:
    """The checkpoint just replaced (at ``old``): deleted, or with ``keep`` > 1 kept as
    ``<path>.step-<step>`` while the ``keep - 1`` newest kept ones stay."""
    if keep <= 1 or not old.exists():
        _remove(old)
        return
    steps = [json.loads(f.read_text()).get("step") for f in old.glob(f"{CHECK_PREFIX}*.json")]
    if not steps or steps[0] is None:  # a checkpoint without step records cannot be named: dropped
        _remove(old)
    else:
        target = path.parent / f"{path.name}.step-{int(steps[0])}"
        _remove(target)
        os.rename(old, target)
    for stale in kept(path)[: -(keep - 1)]:
        _remove(stale)
    _fsync_dir(path.parent)


def _source(path: Path) -> Path | None:
    """The checkpoint at ``path``: itself, or the previous one a save interrupted mid-swap left."""
    if path.exists():
        return path
    old = _siblings(path)[1]
    return old if old.exists() else None


LOCK_NAME = ".hidup-lock"


class CheckpointBusy(RuntimeError):
    """Another process holds a checkpoint folder's lock (:class:`FolderLock`)."""


class FolderLock:
    """An exclusive lock on a checkpoint folder for one training job: ``fcntl.flock`` on
    ``<folder>/.hidup-lock``, which holds the holder's pid and host for the message a second job gets.
    The kernel drops the lock when its process ends, however it ends, so a crashed job never leaves
    a stale lock; a folder on a filesystem without ``flock`` (some network filesystems) is not
    locked (nothing to guard with), and neither on a platform without ``fcntl``."""

    def __init__(self, folder: str | os.PathLike):
        self.folder, self._fd = Path(folder), None

    def acquire(self) -> "FolderLock":
        """Take the lock, or raise :class:`CheckpointBusy` naming its holder."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            return self
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointBusy(
                f"--checkpoint-dir {self.folder} is in use by another training job ({holder}): two jobs "
                "writing one checkpoint would overwrite each other. Fix: wait for it to end (or stop it), "
                "or give another --checkpoint-dir"
            ) from None
        except OSError:  # no flock on this filesystem
            os.close(fd)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def probe(self) -> None:
        """Raise :class:`CheckpointBusy` if another process holds the lock now; take nothing."""
        self.acquire().release()

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def exists(path: str | os.PathLike) -> bool:
    """Whether :func:`load` finds a checkpoint at ``path``."""
    return _source(Path(path)) is not None


class _Layout:
    """How this rank's tensors map onto the logical ones: the DeviceMesh their DTensors live on (the
    compiled module's own mesh for a plan on several axes, else a 1-D one over the group), built only
    when some tensor is sharded over more than one rank; the same groups as a mesh of another device type
    for a tensor elsewhere (an offloaded optimizer's state in host memory, :mod:`hidup.codegen.offload`:
    ``DTensor.from_local`` would copy it to the mesh's device, and a load would fill the copy)."""

    def __init__(self, module, group):
        self.group, self.world, self.rank = group, world_of(group), rank_of(group)
        self.distributed = dist.is_available() and dist.is_initialized() and self.world > 1
        self.mesh = None
        self.meshes: dict[str, DeviceMesh] = {}  # device type -> ``mesh``'s groups as a mesh of that type
        self.sizes: tuple[int, ...] = (self.world,)  # ranks along each axis of ``mesh``
        sharded = [(t, shard) for t, shard in iter_optimizer_shards(module) if shard.sharded]
        if not self.distributed:
            for t, shard in sharded:  # a piece of a tensor split over ranks that are not there
                if tuple(t.shape) != tuple(shard.logical_shape):
                    raise ValueError(
                        f"checkpoint: {shard.logical_name} is stored as {shard.form}, a piece of shape "
                        f"{tuple(t.shape)} of {tuple(shard.logical_shape)}, but no process group joins the "
                        "ranks holding the other pieces. Fix: save and load from every rank of the job, "
                        "after torch.distributed.init_process_group"
                    )
            return
        if not sharded:
            return
        groups = getattr(module, "mesh_groups", None)
        if groups is not None and len(groups.mesh) > 1:
            if groups.device_mesh is None:
                raise ValueError(
                    f"checkpoint: the module's mesh groups {groups} hold no DeviceMesh; compile the module "
                    "after torch.distributed.init_process_group"
                )
            self.mesh, self.sizes = groups.device_mesh, tuple(groups.mesh)
        else:
            own = next((t for _, t, shard in iter_shards(module) if shard.sharded), sharded[0][0])
            self.mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, own.device.type)
        self.meshes[self.mesh.device_type] = self.mesh

    def mesh_for(self, device_type: str) -> DeviceMesh:
        """The module's mesh as a mesh of ``device_type`` (the same process groups)."""
        hit = self.meshes.get(device_type)
        if hit is None:
            mesh = self.mesh
            groups = [mesh.get_group(k) for k in range(mesh.ndim)]
            if mesh.ndim == 1:
                hit = DeviceMesh.from_group(groups[0], device_type)
            else:
                names = mesh.mesh_dim_names or tuple(f"axis{k}" for k in range(mesh.ndim))
                hit = DeviceMesh.from_group(groups, device_type, mesh=mesh.mesh, mesh_dim_names=names)
            self.meshes[device_type] = hit
        return hit

    def wrap(self, local: torch.Tensor, shard) -> torch.Tensor:
        """``local`` as DCP should see it: a DTensor chunk of the logical tensor, or itself."""
        if self.mesh is None or not shard.sharded:
            return local
        shape = torch.Size(shard.logical_shape)
        stride = torch.empty(shape, device="meta").stride()  # the logical tensor is contiguous
        placements = _placements(shard, self.sizes)
        piece = shard.form.local_shape(shard.logical_shape, self.sizes)
        if tuple(local.shape) != piece:
            raise ValueError(
                f"checkpoint: {shard.logical_name} is stored with shape {tuple(local.shape)}, but {shard.form} "
                f"cuts {tuple(shape)} into pieces of {piece} on {mesh_text(self.sizes)} ranks"
            )
        mesh = self.mesh_for(local.device.type)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def dcp_kwargs(self) -> dict:
        if self.distributed:
            return {"process_group": self.group}
        return {"no_dist": True}


def _placements(shard, sizes: tuple[int, ...]) -> list:
    """DTensor placements of ``shard``'s form, one per mesh axis: ``gather_d`` is ``Shard(d)``,
    ``full``/``replicate`` ``Replicate()``.

    DTensor applies nested placements outer axis first, each ``Shard`` splitting what the axes
    before it left -- hidup's order (rank ``(i, j)`` of ``gather_0|gather_0`` holds chunk
    ``i * n_1 + j``) -- but cuts an uneven size ``torch.chunk``-wise where hidup never splits one,
    so an uneven split is refused here rather than mapped to other offsets."""
    forms = axis_forms(shard.form)
    size = list(shard.logical_shape)
    out = []
    for axis, (form, n) in enumerate(zip(forms, sizes)):
        if form.is_gather:
            if form.dim >= len(size) or size[form.dim] % n:
                have = size[form.dim] if form.dim < len(size) else None
                raise ValueError(
                    f"checkpoint: {shard.logical_name} of shape {tuple(shard.logical_shape)} is stored as "
                    f"{shard.form}, which splits dim {form.dim} (size {have} there) over {n} ranks of mesh "
                    f"axis {axis}: not evenly, so its pieces have no DTensor description. Fix: use a plan "
                    "that splits only dims divisible by the ranks of their axes"
                )
            size[form.dim] //= n
            out.append(Shard(form.dim))
        elif form.kind in ("full", "replicate"):
            out.append(Replicate())
        else:
            raise ValueError(
                f"checkpoint: {shard.logical_name} is stored as {shard.form}, a partial sum on mesh axis "
                f"{axis}; only split (gather) and whole (full, replicate) tensors are checkpointed"
            )
    return out


def _first_failure(e: CheckpointException, rank: int) -> BaseException:
    """The exception of this rank (else of the lowest failing rank) inside a DCP failure."""
    failures = e.failures
    exc, _ = failures[rank] if rank in failures else failures[min(failures)]
    return exc


CHECK_PREFIX = ".hidup-check."  # + rank + ".json": what one rank wrote, with its step and digests


class CheckpointDamaged(ValueError):
    """A checkpoint's files are not what its ranks wrote at its step (a flipped byte, a truncated or
    missing file, a shard copied in from another checkpoint)."""


def _digest(path: Path, chunk: int = 1 << 24) -> dict:
    """Size and CRC-32 of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": crc}


def _write_check(folder: Path, rank: int, step: int) -> None:
    """Record the step and the digest of every file rank ``rank`` wrote into ``folder`` (DCP names
    them ``__<rank>_<i>.distcp``; rank 0 also wrote ``.metadata``), fsynced."""
    files = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])
    record = {"rank": rank, "step": step, "files": {f.name: _digest(f) for f in files if f.exists()}}
    target = folder / f"{CHECK_PREFIX}{rank}.json"
    with open(target, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def _verify_checks(path: Path, source: Path, meta: dict, rank: int, world: int) -> None:
    """Raise :class:`CheckpointDamaged` unless every saved rank's files that this rank checks (saved
    ranks ``q`` with ``q % world == rank``: the work spread over the loading ranks) have the size and
    CRC-32 recorded at save and the checkpoint's step.  A checkpoint written before the checks has none
    and is read as it is."""
    saved = int(meta["world_size"])
    if not any(source.glob(f"{CHECK_PREFIX}*.json")):
        return
    for q in range(rank, saved, world):
        check = source / f"{CHECK_PREFIX}{q}.json"
        if not check.exists():
            raise CheckpointDamaged(f"checkpoint {path} lacks {check.name}, the record of what rank {q} wrote")
        record = json.loads(check.read_text())
        if record.get("step") != meta["step"]:
            raise CheckpointDamaged(
                f"checkpoint {path}: rank {q}'s files are from step {record.get('step')}, the checkpoint's "
                f"step is {meta['step']} (files mixed from two checkpoints)"
            )
        for name, want in record["files"].items():
            file = source / name
            got = _digest(file) if file.exists() else None
            if got != want:
                what = "is missing" if got is None else f"has {got['bytes']} bytes, CRC-32 {got['crc32']:#010x}"
                raise CheckpointDamaged(
                    f"checkpoint {path}: {name} {what}, where rank {q} wrote {want['bytes']} bytes, CRC-32 "
                    f"{want['crc32']:#010x} at step {meta['step']} (the file is damaged or from another checkpoint)"
                )


def _attempt(fn) -> Exception | None:
    """Run ``fn``; the exception it raised, made picklable for another rank (else its message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - handed to every rank by the caller
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its message
            return RuntimeError(f"{type(e).__name__}: {e}")
        return e
    return None


def _on_every_rank(layout: "_Layout", fn) -> None:
    """Run ``fn`` on every rank; every rank returns once all did, or raises the first rank's error
    (so that no rank goes on to a collective its peers will not join)."""
    error = _attempt(fn)
    if layout.distributed:
        boxes: list = [None] * layout.world
        dist.all_gather_object(boxes, error, group=layout.group)
        error = next((e for e in boxes if e is not None), None)
    if error is not None:
        raise error


def _on_rank0(layout: "_Layout", fn) -> None:
    """Run ``fn`` on rank 0 only; every rank returns after it did, or raises what it raised (so a
    failure on rank 0 -- an unwritable directory -- stops every rank instead of leaving them waiting)."""
    error = _attempt(fn) if layout.rank == 0 else None
    if layout.distributed:
        box = [error]
        src = 0 if layout.group is None else dist.get_global_rank(layout.group, 0)
        dist.broadcast_object_list(box, src=src, group=layout.group)
        error = box[0]
    if error is not None:
        raise error


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process call that it assumes a single process; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(
    path: str | os.PathLike,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    loss_history=(),
    extra: dict | None = None,
    group=None,
    keep: int = 1,
) -> None:
    """Write a checkpoint of ``module`` (compiled or plain) and ``optimizer`` to the directory
    ``path``, replacing what is there only once the new one is complete; collective: every rank
    writes its own shards.  With ``keep`` K > 1 the one replaced moves to ``<path>.step-<its step>``
    beside it instead of being deleted, and only the K - 1 newest of those stay (:func:`kept`)."""
    path = Path(path)
    group = _group(module, group)
    layout = _Layout(module, group)
    rank = layout.rank
    state: dict = {}
    for _, t, shard in iter_shards(module):
        state[f"model.{shard.logical_name}"] = layout.wrap(t.detach(), shard)
    by_id = {id(t): (t, shard) for t, shard in iter_optimizer_shards(module)}
    opt_meta = None
    if optimizer is not None:
        groups, per_element, small = [], {}, {}
        for g in optimizer.param_groups:
            names = []
            for p in g["params"]:
                if id(p) not in by_id:
                    raise ValueError(
                        "checkpoint.save: the optimizer holds a tensor that is not a parameter of the "
                        "module; build the optimizer from module.optimizer_parameters() (module.parameters() "
                        "of a module without ZeRO)"
                    )
                shard = by_id[id(p)][1]
                names.append(shard.logical_name)
                for key, value in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape) and value.dim() > 0:
                        state[f"optim.{shard.logical_name}.{key}"] = layout.wrap(value.detach(), shard)
                        per_element.setdefault(shard.logical_name, []).append(key)
                    else:
                        small.setdefault(shard.logical_name, {})[key] = (
                            value.detach().cpu().clone() if torch.is_tensor(value) else value
                        )
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        opt_meta = {"groups": groups, "per_element": per_element, "state": small}
    if rank == 0:
        state["meta"] = {
            "version": FORMAT_VERSION,
            "world_size": layout.world,
            "step": int(step),
            "loss_history": [float(x) for x in loss_history],
            "optimizer": opt_meta,
            "extra": extra or {},
        }
    state[f"rng.{rank}"] = _rng_state()

    tmp, old = _siblings(path)

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)  # what a crashed save left
        tmp.mkdir()

    def swap() -> None:
        _fsync_dir(tmp)
        if path.exists() or path.is_symlink():
            _remove(old)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        _retire(old, path, keep)

    _on_rank0(layout, prepare)
    try:
        with _quiet_single_process():
            dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                **layout.dcp_kwargs(),
            )
    except CheckpointException as e:
        raise _first_failure(e, rank) from None
    _on_every_rank(layout, lambda: _write_check(tmp, rank, int(step)))  # then no rank writes into tmp
    _on_rank0(layout, swap)  # every rank returns once the new checkpoint is in place


def load(
    path: str | os.PathLike,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    group=None,
    restore_rng: bool = True,
) -> dict:
    """Load a checkpoint into ``module``/``optimizer``, re-sharded for the current plan and world
    (collective when distributed: every rank reads the slices it needs).

    Returns ``{"step", "loss_history", "extra", "world_size"}`` (the world size it was saved on)."""
    path = Path(path)
    source = _checkpoint_at(path)
    if source.is_file():
        return _load_single_file(path, source, module, optimizer, group=group, restore_rng=restore_rng)
    metadata, meta = _read_meta(path, source)
    group = _group(module, group)
    layout = _Layout(module, group)
    rank, world = layout.rank, layout.world
    _on_every_rank(layout, lambda: _verify_checks(path, source, meta, rank, world))

    request: dict = {}
    targets = {}  # logical name -> (local tensor, shard)
    for _, t, shard in iter_shards(module):
        key = f"model.{shard.logical_name}"
        if key not in metadata:
            raise KeyError(f"checkpoint {path} has no entry for {shard.logical_name!r}")
        _check_shape(path, shard.logical_name, metadata[key], shard.logical_shape)
        request[key] = layout.wrap(t.detach(), shard)  # read in place into the stored piece
        targets[shard.logical_name] = (t, shard)
    unknown = sorted(
        k[len("model.") :] for k in metadata if k.startswith("model.") and k[len("model.") :] not in targets
    )
    if unknown:
        raise KeyError(f"checkpoint {path} has entries the model does not know: {unknown[:5]}")

    opt_state = {}
    # what the optimizer steps, by logical name: a ZeRO slice in place of its parameter (hidup.codegen.zero)
    stepped = {shard.logical_name: (t, shard) for t, shard in iter_optimizer_shards(module) if not shard.is_buffer}
    if optimizer is not None:
        saved = meta["optimizer"]
        if saved is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state; load without an optimizer")
        _check_groups(path, optimizer, saved["groups"], stepped)
        for name, keys in saved["per_element"].items():
            t, shard = stepped[name]
            for key in keys:
                if f"optim.{name}.{key}" not in metadata:
                    raise KeyError(f"checkpoint {path} lacks the optimizer state {key!r} of {name!r}")
                _check_shape(path, f"{name} ({key})", metadata[f"optim.{name}.{key}"], shard.logical_shape)
                local = torch.empty_like(t, memory_format=torch.contiguous_format).detach()
                opt_state.setdefault(name, {})[key] = local
                request[f"optim.{name}.{key}"] = layout.wrap(local, shard)
    try:
        with _quiet_single_process():
            dcp.load(request, storage_reader=FileSystemReader(source), planner=_load_planner(), **layout.dcp_kwargs())
    except CheckpointException as e:
        exc = _first_failure(e, rank)
        raise RuntimeError(f"checkpoint {path} cannot be read: {type(exc).__name__}: {exc}") from None
    rng = None
    if restore_rng:  # each rank reads its own states, no collective
        own = f"rng.{rank}"
        key = own if meta["world_size"] == world and own in metadata else "rng.0"
        rng = _read_objects(path, source, [key])[key]

    if optimizer is not None:
        _set_hyper_parameters(optimizer, saved["groups"])
        for name, (t, _) in stepped.items():
            entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in saved["state"].get(name, {}).items()}
            entry.update(opt_state.get(name, {}))
            if entry:
                optimizer.state[t] = entry
    if rng is not None:
        _set_rng_state(rng)
    _pull_offloaded(module)
    return {
        "step": meta["step"],
        "loss_history": list(meta["loss_history"]),
        "extra": meta["extra"],
        "world_size": meta["world_size"],
    }


def info(path: str | os.PathLike) -> dict:
    """``{"step", "loss_history", "extra", "world_size"}`` of the checkpoint at ``path``, read
    without a model (by this process alone)."""
    path = Path(path)
    source = _checkpoint_at(path)
    if source.is_file():
        ckpt = _read_single_file(path, source)
    else:
        ckpt = _read_meta(path, source)[1]
    return {
        "step": ckpt["step"],
        "loss_history": list(ckpt["loss_history"]),
        "extra": ckpt["extra"],
        "world_size": ckpt["world_size"],
    }


def _checkpoint_at(path: Path) -> Path:
    """What holds the checkpoint at ``path`` (itself, or the previous one a save left mid-swap)."""
    source = _source(path)
    if source is None:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return source


def _read_meta(path: Path, source: Path) -> tuple[dict, dict]:
    """(DCP's metadata of every entry, the ``meta`` entry) of the format-2 checkpoint in ``source``."""
    if not (source / ".metadata").is_file():
        raise ValueError(f"checkpoint {path} is not a complete checkpoint (the directory has no .metadata)")
    try:
        metadata = FileSystemReader(source).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same to the user
        raise ValueError(f"checkpoint {path}: its .metadata cannot be read ({type(e).__name__}: {e})") from None
    if "meta" not in metadata:
        raise ValueError(f"checkpoint {path} is not a hidup checkpoint (it has no 'meta' entry)")
    meta = _read_objects(path, source, ["meta"])["meta"]
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise ValueError(f"checkpoint {path} has format version {version}, expected {FORMAT_VERSION}")
    return metadata, meta


def _load_planner() -> DefaultLoadPlanner:
    return DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _read_objects(path: Path, source: Path, keys: list[str]) -> dict:
    """The non-tensor entries ``keys`` of the checkpoint, read by this rank alone."""
    request = dict.fromkeys(keys)
    try:
        with _quiet_single_process():
            dcp.load(request, storage_reader=FileSystemReader(source), planner=_load_planner(), no_dist=True)
    except CheckpointException as e:
        exc = _first_failure(e, 0)
        raise RuntimeError(
            f"checkpoint {path}: {', '.join(keys)} cannot be read: {type(exc).__name__}: {exc}"
        ) from None
    return request


def _check_shape(path: Path, what: str, md, expected: tuple[int, ...]) -> None:
    if not isinstance(md, TensorStorageMetadata):
        kind = "an object" if isinstance(md, BytesStorageMetadata) else type(md).__name__
        raise ValueError(f"checkpoint {path}: {what} is {kind}, not a tensor")
    if tuple(md.size) != tuple(expected):
        raise ValueError(f"{what}: checkpoint {path} holds shape {tuple(md.size)}, the model expects {tuple(expected)}")


def _check_groups(path: Path, optimizer, saved_groups: list, targets: dict) -> None:
    """Check that the optimizer's param groups hold the saved groups' parameters."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint {path} has {len(saved_groups)} optimizer param groups, the optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer the same way as when saving"
        )
    for g, saved in zip(optimizer.param_groups, saved_groups):
        ids = {id(p) for p in g["params"]}
        if len(saved["params"]) != len(ids) or any(
            n not in targets or id(targets[n][0]) not in ids for n in saved["params"]
        ):
            raise ValueError(
                f"checkpoint {path}: optimizer param group {saved['params'][:3]}... does not match "
                f"the optimizer's; build the optimizer the same way as when saving"
            )


def _set_hyper_parameters(optimizer, saved_groups: list) -> None:
    for g, saved in zip(optimizer.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                g[key] = value


def _read_single_file(path: Path, source: Path) -> dict:
    ckpt = torch.load(source, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("version") != _SINGLE_FILE_VERSION:
        version = ckpt.get("version") if isinstance(ckpt, dict) else None
        raise ValueError(
            f"checkpoint {path} has format version {version}, expected {FORMAT_VERSION} (a directory) "
            f"or {_SINGLE_FILE_VERSION} (a single file)"
        )
    return ckpt


def _pull_offloaded(module) -> None:
    """The host copies of an offloaded optimizer made the weights just loaded (:mod:`hidup.codegen.offload`)."""
    offload = getattr(module, "offload", None)
    if offload is not None:
        offload.pull()


def _load_single_file(path: Path, source: Path, module, optimizer, *, group, restore_rng: bool) -> dict:
    """Read a checkpoint of the single-file format (version 1): gathered logical tensors, re-sharded."""
    ckpt = _read_single_file(path, source)
    group = _group(module, group)
    world, rank = world_of(group), rank_of(group)
    mesh_groups = getattr(module, "mesh_groups", None)
    mesh = mesh_groups.mesh if mesh_groups is not None else None  # a Layout is cut on the module's mesh
    load_full_state_dict(module, ckpt["params"], mesh_groups if mesh_groups is not None else group)
    _pull_offloaded(module)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state; load without an optimizer")
        shards = {shard.logical_name: (t, shard) for t, shard in iter_optimizer_shards(module)}
        _check_groups(path, optimizer, ckpt["optimizer"]["groups"], shards)
        _set_hyper_parameters(optimizer, ckpt["optimizer"]["groups"])
        for name, entry in ckpt["optimizer"]["state"].items():
            t, shard = shards[name]
            local = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and tuple(value.shape) == shard.logical_shape and value.dim() > 0:
                    local[key] = shard_tensor(value, shard.form, rank, world, mesh).to(t.device, t.dtype).clone()
                elif torch.is_tensor(value):
                    local[key] = value.clone()
                else:
                    local[key] = value
            optimizer.state[t] = local
    if restore_rng:
        rngs = ckpt["rng"]
        _set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
    return {
        "step": ckpt["step"],
        "loss_history": list(ckpt["loss_history"]),
        "extra": ckpt["extra"],
        "world_size": ckpt["world_size"],
    }
