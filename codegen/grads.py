"""Gradient synchronisation of replicated parameters and global gradient clipping.

Under the gradient convention of :mod:`hidup.ir` a ``replicate`` parameter used as a ``full``
tensor accumulates a *partial* gradient on every rank; its true gradient is ``sum_r g_r``.  Rather
than one all-reduce per use (the ``replicate -> full`` conversion's backward), codegen uses the
plain ``full`` view of the parameter in the graph and sums the accumulated gradients once per
backward pass with bucketed, asynchronous all-reduces that overlap the rest of the backward (as
DDP does):

* parameters are packed into buckets of about ``bucket_mb`` MB in reverse order of first use in
  the forward (the order in which backward finishes them), one dtype/device per bucket;
* a ``post_accumulate_grad_hook`` marks a parameter ready once autograd has summed all of its
  uses (the hook runs once per backward, however often the parameter is used); when a bucket is
  complete and all earlier buckets are launched, its all-reduce is started (``async_op``) as one
  coalesced call (``torch.distributed._coalescing_manager``: NCCL runs the tensors' all-reduces as
  one grouped launch) over

  - the gradients of at least ``pack_bytes`` (:data:`hidup.ir.GRAD_PACK_BYTES`) bytes, summed where they lie: no copy
    at all (DDP instead copies every gradient into its flat bucket and back, or views it there);
  - one flat buffer holding the smaller gradients and any gradient that is not contiguous (a
    collective needs dense memory), copied in with one ``torch.cat``: many tiny tensors (biases,
    norms) would each cost a collective op more than their copy;
* a callback queued on the autograd engine waits for every bucket at the end of the backward,
  launches buckets that were left incomplete (parameters that received no gradient are skipped
  consistently on every rank), and makes each packed parameter's ``.grad`` the view of its sum in
  the flat buffer (as DDP's ``gradient_as_bucket_view``: no copy back; a gradient with a strided
  layout is copied instead).

Every rank holds the same parameters with gradients in the same order and applies the same size
rule, so the coalesced calls match across ranks tensor by tensor.

On a device mesh (:mod:`hidup.codegen.mesh`) a parameter whose layout is ``replicate`` on axes ``K``
holds a gradient that is partial over exactly those axes, so it is summed over the ranks that
differ only in the coordinates ``K``: one bucketer per set ``K`` (the compiled module makes them),
its group the axis's group for one axis, the mesh's whole group for every axis, else the axes'
groups in turn (a sum over each axis of ``K`` in turn is the sum over ``K``).

ZeRO (:mod:`hidup.codegen.zero`, ``zero``): a stage-2 parameter's gradient is reduce-scattered
instead (``reduce_scatter_tensor`` into a new tensor of this rank's rows, one coalesced call per
bucket beside the all-reduces; never packed), and its whole gradient is dropped at the launch (the
collective holds it until it completes); at the end of the backward every split parameter's slice
receives its rows of the sum (:meth:`~hidup.codegen.zero.ZeroShards.synced`).

Gradients reduced in bf16 (:mod:`hidup.precision`): while ``reduce_dtype`` is ``torch.bfloat16`` (the
compiled module sets it per forward: a program that reduces in bf16, under a bf16 autocast) a
float32 bucket sums bfloat16 copies instead, ``g = float32(sum_r bf16(g_r))``: the packed gradients
are cast into a bfloat16 flat buffer (one ``copy_`` each, in place of the ``cat``) and copied back,
cast, into their ``.grad`` after the sum (no view of the buffer); a gradient summed where it lies is
cast to a bfloat16 copy, summed, and copied back into itself; a ZeRO-2 gradient is cast before its
reduce-scatter, and the rows received are cast back.  Half the bytes travel; the casts are kernels on
the compute stream (:mod:`hidup.search.cost` prices both).

Because the sum is taken over the whole accumulated ``.grad``, gradient accumulation over several
backward passes must skip the sync for all but the last one (``with module.no_sync(): ...``), and
gradients must be zeroed between steps, as with DDP.

:func:`clip_grad_norm_` computes ``||g|| = sqrt(sum_sharded ||g_r||^2 summed over ranks +
sum_replicated ||g||^2)``: slices of sharded parameters (and ZeRO-2's rows of a gradient) are
disjoint and added over ranks, replicated gradients (identical on every rank after the sync) are
counted once.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.distributed_c10d import _coalescing_manager

from hidup.codegen.collectives import world_of
from hidup.codegen.mesh import MeshGroups
from hidup.codegen.params import iter_shards
from hidup.codegen.zero import REDUCE_SCATTER
from hidup.ir import GRAD_BUCKET_MB, GRAD_PACK_BYTES

__all__ = ["GradBucketer", "clip_grad_norm_"]


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.ready: set[int] = set()
        self.work = None
        self.buffer: torch.Tensor | None = None  # the packed gradients, flat
        self.packed: list[torch.nn.Parameter] = []  # parameters whose gradient is in ``buffer``
        self.summed: list[torch.Tensor] = []  # every tensor the all-reduce sums in place
        self.scattered: list[tuple] = []  # (ZeroSlice, its rows of the sum) of the stage-2 parameters
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gradient, its bf16 copy summed in its place)


class GradBucketer:
    """Bucketed, overlapped all-reduce of the gradients of ``params`` (in forward first-use order)
    over ``group``, or over each group of a tuple in turn (module docstring)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group=None,
        bucket_mb: float = GRAD_BUCKET_MB,
        pack_bytes: float = GRAD_PACK_BYTES,
        zero=None,
    ):
        self.group = group
        self.zero = zero  # the ZeroShards of the split parameters (hidup.codegen.zero), or None
        self.pack_bytes = pack_bytes  # a contiguous gradient of this many bytes or more is summed in place
        self.groups = tuple(group) if isinstance(group, tuple) else (group,)
        self.enabled = True
        self.reduce_dtype: torch.dtype | None = None  # bfloat16: float32 gradients summed in bf16 (module doc)
        self.buckets: list[_Bucket] = []
        self._handles = []
        self._pending = False
        self._next = 0  # index of the next bucket to launch
        limit = max(1, int(bucket_mb * 2**20))
        current: list[torch.nn.Parameter] = []
        size = 0
        seen: set[int] = set()
        for p in reversed(params):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > limit or p.dtype != current[0].dtype or p.device != current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        self._where = {}
        for i, b in enumerate(self.buckets):
            for p in b.params:
                self._where[id(p)] = i
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the gradient sync inside the block (gradient accumulation)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- backward-time machinery
    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled or all(world_of(g) == 1 for g in self.groups):
            return
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self.buckets[self._where[id(p)]]
        bucket.ready.add(id(p))
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _wire_dtype(self, p: torch.Tensor) -> torch.dtype | None:
        """The dtype a bucket of ``p``'s dtype sums in other than its own: ``reduce_dtype`` for float32
        gradients (module docstring), else None."""
        return self.reduce_dtype if p.dtype == torch.float32 and self.reduce_dtype not in (None, p.dtype) else None

    def _launch(self, bucket: _Bucket) -> None:
        members = [p for p in bucket.params if id(p) in bucket.ready and p.grad is not None]
        if not members:
            return
        low = self._wire_dtype(members[0])
        in_place, bucket.packed, scatter = [], [], []
        for p in members:
            g = p.grad
            z = self.zero.by_param.get(id(p)) if self.zero else None
            if z is not None and z.stage == 2:
                scatter.append((z, g.detach().to(low or g.dtype, memory_format=torch.contiguous_format)))
                p.grad = None  # the collective keeps the whole gradient until it is done
            elif g.is_contiguous() and g.numel() * g.element_size() >= self.pack_bytes:
                in_place.append(g if low is None else g.detach().to(low))
                if low is not None:
                    bucket.back.append((g.detach(), in_place[-1]))
            else:
                bucket.packed.append(p)
        if bucket.packed:
            bucket.buffer = _packed([p.grad.detach() for p in bucket.packed], low)
        bucket.summed = ([bucket.buffer] if bucket.packed else []) + in_place
        works = [_all_reduce(bucket.summed, self.groups[0], async_op=True)] if bucket.summed else []
        if scatter:
            bucket.scattered = [
                (z, torch.empty_like(z.shard, dtype=low or z.shard.dtype, memory_format=torch.contiguous_format))
                for z, _ in scatter
            ]
            pairs = [(out, g) for (_, out), (_, g) in zip(bucket.scattered, scatter)]
            works.append(_reduce_scatter(pairs, self.groups[0]))
        bucket.work = works[0] if len(works) == 1 else _Calls(works)

    def _finish(self) -> None:
        try:
            while self._next < len(self.buckets):  # incomplete buckets: reduce what arrived
                self._launch(self.buckets[self._next])
                self._next += 1
            for bucket in self.buckets:
                if bucket.work is None:
                    continue
                bucket.work.wait()
                for g in self.groups[1:]:
                    _all_reduce(bucket.summed, g, async_op=False)
                offset = 0
                for p in bucket.packed:
                    n = p.numel()
                    summed = bucket.buffer[offset : offset + n].view(p.grad.shape)
                    # the sum becomes the gradient, a view of the bucket: no copy back (a bf16 sum is cast back)
                    if p.grad.is_contiguous() and summed.dtype == p.grad.dtype:
                        p.grad = summed
                    else:
                        p.grad.detach().copy_(summed)
                    offset += n
                for g, low in bucket.back:
                    g.copy_(low)
                self._zero_synced(bucket)
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = bucket.buffer = None
                bucket.packed = []
                bucket.summed = []
                bucket.scattered = []
                bucket.back = []
            self._next = 0
            self._pending = False

    def _zero_synced(self, bucket: _Bucket) -> None:
        """Hand each split parameter's slice its rows of the summed gradient (:mod:`hidup.codegen.zero`)."""
        if not self.zero:
            return
        for z, rows in bucket.scattered:
            self.zero.synced(z, rows.to(z.shard.dtype))
        for p in bucket.params:
            z = self.zero.by_param.get(id(p))
            if z is not None and z.stage == 1 and id(p) in bucket.ready:
                self.zero.synced(z, None)


def _packed(grads: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """The gradients ``grads`` flat in one new buffer of ``dtype`` (None: theirs, by ``torch.cat``)."""
    if dtype is None:
        return torch.cat([g.reshape(-1) for g in grads])
    out = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
    offset = 0
    for g in grads:
        out[offset : offset + g.numel()].view(g.shape).copy_(g)
        offset += g.numel()
    return out


class _Calls:
    """The handles of several collectives, waited for together."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _all_reduce(tensors: list[torch.Tensor], group, async_op: bool):
    """Sum each of ``tensors`` (one dtype and device) over ``group`` in place, as one coalesced call;
    returns the call's handle when ``async_op`` (its ``wait()`` waits for all of them).  Fake tensors
    (the peak-memory replay, :mod:`hidup.runtime.peak`) take one call each: torch has no fake kernel
    for the coalesced one, and the sums allocate nothing either way."""
    if len(tensors) == 1:
        return dist.all_reduce(tensors[0], group=group, async_op=async_op)
    if any(isinstance(t, FakeTensor) for t in tensors):
        works = [dist.all_reduce(t, group=group, async_op=async_op) for t in tensors]
        return _Calls(works) if async_op else None
    with _coalescing_manager(group, async_ops=async_op) as calls:
        for t in tensors:
            dist.all_reduce(t, group=group, async_op=async_op)
    return calls if async_op else None


def _reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]], group):
    """``out = this rank's rows of sum over ranks of g`` for each ``(out, g)``, asynchronously, as one
    coalesced call (fake tensors: one call each, as :func:`_all_reduce`); the handle of the call(s)."""
    if len(pairs) == 1 or any(isinstance(g, FakeTensor) for _, g in pairs):
        return _Calls([REDUCE_SCATTER(out, g, group=group, async_op=True) for out, g in pairs])
    with _coalescing_manager(group, async_ops=True) as calls:
        for out, g in pairs:
            REDUCE_SCATTER(out, g, group=group, async_op=True)
    return calls


def clip_grad_norm_(module: torch.nn.Module, max_norm: float, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Scale the gradients of ``module`` (compiled or plain) so that their global norm is at most
    ``max_norm``; returns the global norm (before clipping).  Collective for compiled modules."""
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_: only the 2-norm is supported, got norm_type={norm_type}")
    mesh = getattr(module, "mesh_groups", None) if group is None else group
    if isinstance(mesh, MeshGroups):
        return _clip_on_mesh(module, max_norm, mesh)
    group = getattr(module, "group", None) if group is None else group
    sharded, replicated = [], []
    for _, t, shard in iter_shards(module):
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            (sharded if shard.sharded else replicated).append(t.grad.detach())
    zero = getattr(module, "zero", None)
    if zero:  # ZeRO-2: a rank holds its rows of the summed gradient, disjoint from the others' (hidup.codegen.zero)
        sharded.extend(zero.scattered_grads())
    device = (sharded or replicated or [torch.zeros(())])[0].device
    sq_sharded = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        sq_sharded += g.float().pow(2).sum()
    if world_of(group) > 1:
        dist.all_reduce(sq_sharded, group=group)
    sq = sq_sharded + sum((g.float().pow(2).sum() for g in replicated), torch.zeros((), device=device))
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.dtype))
    return total


def _clip_on_mesh(module: torch.nn.Module, max_norm: float, mesh: MeshGroups) -> torch.Tensor:
    """:func:`clip_grad_norm_` on a device mesh: a piece stored in layout ``L`` is held by
    ``c = prod(mesh[k] for the axes k that do not split it)`` ranks (with equal gradients after the
    sync), so ``||g||^2 = sum over ranks of sum over pieces ||g_piece||^2 / c``."""
    grads = []
    for _, t, shard in iter_shards(module):
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            forms = getattr(shard.form, "forms", None) or (shard.form,) * len(mesh.mesh)
            copies = math.prod(n for f, n in zip(forms, mesh.mesh) if not f.is_gather)
            grads.append((t.grad.detach(), copies))
    device = grads[0][0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g, copies in grads:
        sq += g.float().pow(2).sum() / copies
    if world_of(mesh.world) > 1:
        dist.all_reduce(sq, group=mesh.world)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.mul_(coef.to(g.dtype))
    return total
