"""Atomic, world-size-independent checkpoints.

A checkpoint stores the *logical* layout: every parameter/buffer gathered to its full shape and
keyed by its name in the original model; every per-element optimizer state tensor (one with the
stored parameter's shape: Adam's ``exp_avg``, SGD's ``momentum_buffer``) gathered the same way;
other optimizer state (Adam's ``step``) and the optimizer's hyper-parameters as they are; the step,
the loss history, the RNG states of every rank, and free-form ``extra`` data.

``save`` is collective (every rank gathers) and only rank 0 writes: to a temporary file in the
target's directory, flushed and ``fsync``-ed, then ``os.replace``-d over the target (atomic on
POSIX), and the directory is ``fsync``-ed.  A crash mid-write leaves the previous checkpoint.

``load`` reads the logical tensors and re-shards them for the *current* module's plan and world
(slice ``r`` of ``N`` along the stored form's dim), so a run may resume on a different world size.
RNG states are restored per rank when the world size is unchanged, else every rank takes rank 0's.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

from hidup.codegen.collectives import rank_of, world_of
from hidup.codegen.params import gather_tensor, iter_shards, load_full_state_dict, shard_tensor

__all__ = ["save", "load", "atomic_write", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def atomic_write(path: str | os.PathLike, obj) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temp file in the same dir, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _group(module, group):
    return getattr(module, "group", None) if group is None else group


def _optimizer_state(module, optimizer, group) -> dict:
    by_id = {id(t): shard for _, t, shard in iter_shards(module)}
    groups, state = [], {}
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            shard = by_id.get(id(p))
            if shard is None:
                raise ValueError("checkpoint.save: the optimizer holds a tensor that is not a parameter of the "
                                 "module; build the optimizer from module.parameters()")
            names.append(shard.logical_name)
            entry = {}
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape) and value.dim() > 0:
                    entry[key] = gather_tensor(value.detach(), shard.form, group).cpu()
                else:
                    entry[key] = value.detach().cpu() if torch.is_tensor(value) else value
            if entry:
                state[shard.logical_name] = entry
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return {"groups": groups, "state": state}


def save(path: str | os.PathLike, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int = 0, loss_history=(), extra: dict | None = None, group=None) -> None:
    """Write a checkpoint of ``module`` (compiled or plain) and ``optimizer``; collective."""
    group = _group(module, group)
    world, rank = world_of(group), rank_of(group)
    params = {}
    for _, t, shard in iter_shards(module):
        params[shard.logical_name] = gather_tensor(t.detach(), shard.form, group).cpu().clone()
    opt = _optimizer_state(module, optimizer, group) if optimizer is not None else None
    rng = _rng_state()
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng, group=group)
    else:
        rngs = [rng]
    if rank == 0:
        atomic_write(path, {"version": FORMAT_VERSION, "world_size": world, "step": int(step),
                            "loss_history": [float(x) for x in loss_history], "params": params,
                            "optimizer": opt, "rng": rngs, "extra": extra or {}})
    if world > 1:
        dist.barrier(group=group)


def load(path: str | os.PathLike, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         group=None, restore_rng: bool = True) -> dict:
    """Load a checkpoint into ``module``/``optimizer``, re-sharded for the current plan and world.

    Returns ``{"step", "loss_history", "extra", "world_size"}`` (the world size it was saved on)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {ckpt.get('version')}, expected {FORMAT_VERSION}")
    group = _group(module, group)
    world, rank = world_of(group), rank_of(group)
    load_full_state_dict(module, ckpt["params"], group)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state; load without an optimizer")
        shards = {shard.logical_name: (t, shard) for _, t, shard in iter_shards(module)}
        saved_groups = ckpt["optimizer"]["groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint {path} has {len(saved_groups)} optimizer param groups, the optimizer "
                             f"{len(optimizer.param_groups)}; build the optimizer the same way as when saving")
        for g, saved in zip(optimizer.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    g[key] = value
            ids = {id(p) for p in g["params"]}
            if len(saved["params"]) != len(ids) or any(n not in shards or id(shards[n][0]) not in ids
                                                      for n in saved["params"]):
                raise ValueError(f"checkpoint {path}: optimizer param group {saved['params'][:3]}... does not match "
                                 f"the optimizer's; build the optimizer the same way as when saving")
        for name, entry in ckpt["optimizer"]["state"].items():
            t, shard = shards[name]
            local = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and tuple(value.shape) == shard.logical_shape and value.dim() > 0:
                    local[key] = shard_tensor(value, shard.form, rank, world).to(t.device, t.dtype).clone()
                elif torch.is_tensor(value):
                    local[key] = value.clone()
                else:
                    local[key] = value
            optimizer.state[t] = local
    if restore_rng:
        rngs = ckpt["rng"]
        _set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
    return {"step": ckpt["step"], "loss_history": list(ckpt["loss_history"]), "extra": ckpt["extra"],
            "world_size": ckpt["world_size"]}
