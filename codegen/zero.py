"""ZeRO-1 and ZeRO-2 for the replicated parameters of a rank program (``plan.zero``).

A parameter stored ``replicate`` computes whole on every rank; by default its gradient is summed
over the ranks (all-reduce, :mod:`hidup.codegen.grads`) and every rank keeps the whole gradient and
Adam's two moments and applies the same update.  ZeRO (DeepSpeed's stages 1 and 2, Megatron's
distributed optimizer, FSDP's ``SHARD_GRAD_OP``) splits that redundant work and state over the
``N`` ranks of the module's group.  For a parameter ``W`` whose dim 0 of ``n`` rows ``N`` divides
(:func:`hidup.ir.zero_splits`; any other stays as it is), rank ``r`` owns the rows
``R_r = [r n / N, (r + 1) n / N)``, a contiguous piece of ``W``'s storage, held as the leaf
``ZeroSlice.shard = W[R_r]`` (a view: no copy of the weight):

* **ZeRO-1** (stage 1): the gradient is all-reduced as before, ``g = sum_q g_q``; the optimizer
  steps only ``W[R_r]`` with the gradient ``g[R_r]`` (a view of the summed gradient) and keeps the
  moments of those rows only;
* **ZeRO-2** (stage 2): the gradient is reduce-scattered instead, ``g[R_r] = sum_q g_q[R_r]`` lands
  on rank ``r`` alone (the same bytes on the wire as an all-reduce's first half), and the whole
  gradient is released once its bucket's reduce-scatter is launched (the collective holds it until
  it completes); the optimizer steps ``W[R_r]`` as in stage 1;
* after the optimizer's step (:meth:`ZeroShards.gather`, a step post-hook of the optimizer bound by
  :meth:`ZeroShards.bind`) every ``W`` is all-gathered in place from the updated rows,
  ``W = cat_q W[R_q]``, so the forward of the next step reads the same weight on every rank.

Adam is elementwise, so stepping the rows apart gives each element the update the whole tensor's
step gives it: the weights, the moments (the concatenation over ranks) and the losses equal those
of the unsplit program.  Memory per rank for such a parameter of ``B`` bytes: optimizer state
``2 B / N`` instead of ``2 B`` (both stages), gradient ``B / N`` instead of ``B`` between
backwards (stage 2; the whole gradient still exists during the backward until its reduce-scatter
completes).  Both stages add an all-gather of ``B`` after the optimizer (:mod:`hidup.search.cost`).

The optimizer must be built over :meth:`ZeroShards.optimizer_parameters` (each split parameter's
slice in place of the parameter; ``HidupModule.optimizer_parameters``) and bound with
:meth:`ZeroShards.bind` (``HidupModule.bind_optimizer``); checkpoints save each slice's optimizer
state as rows ``R_r`` of the logical tensor (:func:`iter_optimizer_shards`), so a run resumes with
or without ZeRO, on any world size.  ZeRO applies to plans of one axis; a mesh plan is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.distributed_c10d import _coalescing_manager

from hidup.codegen.collectives import rank_of, world_of
from hidup.codegen.params import ParamShard, iter_shards
from hidup.ir import ZERO_STAGES, Form, zero_splits

# torch 2.13 renamed the tensor collectives (the old names warn); earlier versions have only the old ones
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["ZeroSlice", "ZeroShards", "iter_optimizer_shards", "zero_stages", "ROWS"]

ROWS = Form.parse("gather_0")  # how a slice holds its parameter: rows R_r of dim 0


@dataclass
class ZeroSlice:
    """One split parameter: the whole ``param`` (what the program reads), this rank's rows ``shard`` (a
    leaf view of them, what the optimizer steps), the ZeRO ``stage`` and the rows' ``start`` and count."""

    param: nn.Parameter
    shard: nn.Parameter
    stage: int
    start: int
    rows: int

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor shaped like the parameter (a view)."""
        return full.narrow(0, self.start, self.rows)


def zero_stages(plan_zero: dict[str, int], params: dict[str, tuple], world: int) -> dict[str, int]:
    """The stage of each parameter that ZeRO splits: ``params`` maps a program's replicated trainable
    parameters (by ``param`` node name) to their shapes, ``plan_zero`` names the stage of some of them;
    those whose dim 0 ``world`` does not divide stay unsplit (:func:`hidup.ir.zero_splits`)."""
    out = {}
    for name, stage in plan_zero.items():
        if stage not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage of {name} must be 1 or 2, got {stage!r}")
        if name in params and zero_splits(params[name], world):
            out[name] = stage
    return out


class ZeroShards:
    """The split parameters of one rank program (module docstring): ``stages`` maps each one's path in
    ``gm`` to its stage; ``group`` the module's process group."""

    def __init__(self, gm: nn.Module, stages: dict[str, int], group=None):
        self.group = group
        world, rank = world_of(group), rank_of(group)
        self.slices: dict[str, ZeroSlice] = {}
        for path, stage in stages.items():
            p = gm.get_parameter(path)
            if not zero_splits(tuple(p.shape), world):
                raise ValueError(f"ZeRO cannot split {path} of shape {tuple(p.shape)} over {world} ranks")
            rows = p.shape[0] // world
            shard = nn.Parameter(p.detach().narrow(0, rank * rows, rows), requires_grad=True)
            self.slices[path] = ZeroSlice(p, shard, stage, rank * rows, rows)
        self.by_param = {id(z.param): z for z in self.slices.values()}
        # the all-gathers of one step, one coalesced call per dtype and device (fixed for the module's life)
        self._gathers: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for z in self.slices.values():
            self._gathers.setdefault((z.param.dtype, z.param.device), []).append((z.param.detach(), z.shard.detach()))
        self._hooks = []

    def __bool__(self) -> bool:
        return bool(self.slices)

    def optimizer_parameters(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` with each split parameter replaced by its slice."""
        return [self.by_param[id(p)].shard if id(p) in self.by_param else p for p in params]

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """All-gather the updated rows after every ``optimizer.step()`` (a step post-hook)."""
        self._hooks.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.gather()))

    def gather(self) -> None:
        """Every split parameter made whole again from the ranks' updated rows (in place), and its
        whole gradient dropped (the next backward makes it anew)."""
        with torch.no_grad():
            for pairs in self._gathers.values():
                _all_gather(pairs, self.group)
        for z in self.slices.values():
            z.param.grad = None

    def synced(self, z: ZeroSlice, scattered: torch.Tensor | None) -> None:
        """After the gradient sync of ``z``'s parameter: its slice's gradient is the summed rows
        (stage 1: a view of the all-reduced gradient) or the reduce-scattered ``scattered`` (stage 2).
        Like the all-reduced gradients, they are the sum of what the parameter accumulated since its
        last sync (accumulate under ``no_sync()``, as with DDP)."""
        if scattered is None:
            z.shard.grad = z.rows_of(z.param.grad.detach()) if z.param.grad is not None else None
        else:
            z.shard.grad = scattered

    def scattered_grads(self) -> list[torch.Tensor]:
        """The gradients of the stage-2 slices (this rank's rows only, disjoint across ranks)."""
        return [z.shard.grad.detach() for z in self.slices.values() if z.stage == 2 and z.shard.grad is not None]

    def full_grad(self, z: ZeroSlice) -> torch.Tensor | None:
        """The summed gradient of ``z``'s whole parameter (collective for stage 2: an all-gather of the
        slices' gradients, zeros where a rank has none)."""
        if z.stage == 1:
            return z.param.grad
        local = z.shard.grad if z.shard.grad is not None else torch.zeros_like(z.shard)
        out = torch.empty_like(z.param)
        _all_gather([(out, local.detach().contiguous())], self.group)
        return out


def _all_gather(pairs: list[tuple[torch.Tensor, torch.Tensor]], group) -> None:
    """``out = cat over ranks of piece`` for each ``(out, piece)`` (``out`` contiguous), as one coalesced
    call (fake tensors, in the peak-memory replay, one call each: torch has no fake kernel of the
    coalesced one).  ``piece`` may be the rank's own rows of ``out``: the collective reads them where
    they lie (in place)."""
    if not pairs:
        return
    pieces = [(out.reshape(-1), piece.reshape(-1)) for out, piece in pairs]
    if len(pieces) == 1 or any(isinstance(o, FakeTensor) for o, _ in pieces):
        for out, piece in pieces:
            ALL_GATHER(out, piece, group=group)
        return
    with _coalescing_manager(group, async_ops=True) as calls:
        for out, piece in pieces:
            ALL_GATHER(out, piece, group=group, async_op=True)
    calls.wait()


def iter_optimizer_shards(module: nn.Module) -> Iterator[tuple[torch.Tensor, ParamShard]]:
    """(tensor, ParamShard) for every parameter an optimizer of ``module`` steps: a split parameter's
    slice as rows ``R_r`` (form ``gather_0``) of its logical tensor, every other parameter as
    :func:`hidup.codegen.params.iter_shards` gives it; with the optimizer offloaded, the host copy of
    each (:mod:`hidup.codegen.offload`: what the optimizer holds)."""
    zero = getattr(module, "zero", None)
    offload = getattr(module, "offload", None)
    host = offload.host_of if offload is not None else (lambda t: t)
    for _, t, shard in iter_shards(module):
        z = zero.by_param.get(id(t)) if zero else None
        if z is None:
            yield host(t), shard
        else:
            yield host(z.shard), ParamShard(shard.logical_name, shard.logical_shape, ROWS, shard.is_buffer)
