"""Autograd-aware collectives and form conversions (torch.distributed, NCCL and gloo).

Every function here turns a tensor from one form (see :mod:`hidup.ir`) into another on one rank
of a process group of N ranks, and its backward is the conjugate required by the gradient
convention of :mod:`hidup.ir`:

* the gradient of a ``full`` tensor is a per-rank partial contribution (true gradient = sum),
* the gradient of a ``gather_d`` tensor is exact for the local slice,
* the gradient of a ``reduce`` tensor is exact and identical on every rank.

With rank r, world N, the local piece of a ``gather_d`` tensor X is ``X_r = X[.., rN/N.., ..]``
(the r-th of N equal slices along d).  The ops and their adjoints:

=====================  ===============================  ================================  ===========
function               forward                          backward                          forms
=====================  ===============================  ================================  ===========
``all_gather(x, d)``   ``cat_r x_r`` along d            ``(sum_r g_r)_r`` reduce-scatter  gather→full
``reduce_scatter``     ``(sum_r x_r)_r`` along d        all-gather along d                reduce→gather
``all_to_all(a→b)``    re-slice from dim a to dim b     all-to-all b→a                    gather→gather
``all_reduce``         ``sum_r x_r``                    all-reduce                        reduce→full
``slice(x, d)``        ``x_r``                          zero-pad the local slice          full→gather
``zero_pad(x, d)``     slice placed in zeros            ``g_r`` (slice)                   gather→reduce
``keep_rank0``         ``x`` on rank 0, zeros elsewhere same mask                         full→reduce
``replicate``          identity                         ``grad_sync``: all-reduce         replicate→full
=====================  ===============================  ================================  ===========

Every op is an entry of :data:`hidup.ir.FORM_CHANGE_OPS`; :func:`apply_op` runs it from one table
of implementations that must name exactly those ops.  A replicated parameter converts like a
``full`` tensor forward (``identity``, ``slice``, ``keep_rank0``) and its backward is ``grad_sync``:
the forward op's adjoint, then the sum over ranks.  In a rank program replicated parameters enter
as ``full`` tensors and the gradient bucketer (:mod:`hidup.codegen.grads`) takes that sum once per
backward; :func:`replicate` and :func:`convert` run it at once.

:func:`convert` applies :func:`hidup.ir.conversion` for any pair of forms.  Collectives move the
sharded dim to the front and make it contiguous, so any dim and any memory layout works; outputs
are contiguous.  Where a backend lacks a fused collective (gloo and ``reduce_scatter_tensor`` in
some versions, ``all_to_all_single`` on others) an equivalent built from ``all_gather`` /
``all_reduce`` is used and remembered per backend.  A group of one rank (or no initialized
process group) makes every collective the identity.

Casts on the wire
-----------------
:func:`convert_cast` sends a float32 parameter's slices in autocast's low dtype: the forward is the
conversion of ``x.to(dtype)`` (the consumer, a matmul under autocast, would cast the gathered
weight to that dtype itself, elementwise, so its values are the same and half the bytes travel),
the backward casts the incoming gradient to ``x``'s dtype *before* the adjoint collective, so that
the gradient is summed over ranks in float32 and never rounded to the low dtype: the result equals
the conversion without the cast, bit for bit, in both directions (FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``).  With ``reduce_dtype`` given
(bfloat16: gradients reduced in bf16, :mod:`hidup.precision`) the backward casts the incoming
gradient to ``reduce_dtype`` instead, runs the adjoint collective (the sum) in it, and casts the
result to ``x``'s dtype: ``x.to(dtype)`` converted forward (``dtype`` may be ``x``'s own: no cast),
``float32(adjoint(bf16(g)))`` backward (``reduce_dtype=bfloat16``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hidup.ir import FORM_CHANGE_OPS, FULL, REDUCE, Form, conversion, gather

__all__ = [
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "slice",
    "zero_pad",
    "keep_rank0",
    "replicate",
    "convert",
    "convert_cast",
    "apply_op",
    "world_of",
    "rank_of",
    "gather_raw",
    "reduce_scatter_raw",
    "all_to_all_raw",
    "all_reduce_raw",
]

# (backend name, op) pairs whose fused collective failed once; the fallback is used from then on.
_UNSUPPORTED: set[tuple[str, str]] = set()


def world_of(group=None) -> int:
    """Number of ranks in ``group`` (1 when no process group is initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank_of(group=None) -> int:
    """This process's rank within ``group`` (0 when no process group is initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # pragma: no cover - a group this rank is not in, or no group at all
        return "unknown"


def _fused(group, op: str, fn, fallback, mirror):
    """Run the fused collective ``fn`` unless it failed before on this backend; else ``fallback``; on
    torch's fake process group ``mirror``, which fills the output as a mirrored world would (module
    docstring, "One device standing in for a rank").

    NCCL supports every fused collective used here, so on NCCL an error propagates: falling back on
    one rank only (a transient error, an error during CUDA-graph capture) would make the ranks issue
    different collectives and hang."""
    backend = _backend(group)
    if backend == "nccl":
        return fn()
    if backend == "fake":
        return mirror()
    key = (backend, op)
    if key not in _UNSUPPORTED:
        try:
            return fn()
        except (RuntimeError, NotImplementedError, AttributeError, ValueError):
            _UNSUPPORTED.add(key)
    return fallback()


# ------------------------------------------------------------------------------------------------
# Raw collectives on dim 0 of a contiguous tensor (no autograd).


def gather_raw(x: torch.Tensor, group=None) -> torch.Tensor:
    """``cat`` over ranks along dim 0 of the contiguous tensor ``x`` (equal shapes on all ranks)."""
    n = world_of(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    fused = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def fallback():
        parts = list(out.chunk(n, 0)) if x.shape[0] else [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return out if x.shape[0] else torch.cat(parts, 0)

    def run():
        fused(out, x, group=group)
        return out

    def mirror():  # every rank holds x (out itself is returned: never a view of it)
        out.view((n,) + tuple(x.shape)).copy_(x.expand((n,) + tuple(x.shape)))
        return out

    return _fused(group, "all_gather", run, fallback, mirror)


def all_reduce_raw(x: torch.Tensor, group=None) -> torch.Tensor:
    """A new tensor holding ``sum_r x_r``."""
    if world_of(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def reduce_scatter_raw(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk (along dim 0) of ``sum_r x_r``; ``x.shape[0]`` must divide by N."""
    n = world_of(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"reduce_scatter: dim 0 of size {x.shape[0]} does not divide over {n} ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    fused = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run():
        fused(out, x, group=group)
        return out

    def fallback():
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(n, 0)[rank_of(group)].contiguous()

    def mirror():  # the other ranks' parts taken as zero
        return out.copy_(x.chunk(n, 0)[rank_of(group)])

    return _fused(group, "reduce_scatter", run, fallback, mirror)


def all_to_all_raw(x: torch.Tensor, group=None) -> torch.Tensor:
    """Chunk j (of N, along dim 0) goes to rank j; the output stacks the chunks received from ranks
    0..N-1 along dim 0."""
    n = world_of(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"all_to_all: dim 0 of size {x.shape[0]} does not divide over {n} ranks")
    x = x.contiguous()
    out = torch.empty_like(x)

    def run():
        dist.all_to_all_single(out, x, group=group)
        return out

    def fallback():
        # Every rank gathers everything and keeps the chunks addressed to it.
        everything = gather_raw(x, group).reshape((n, n, x.shape[0] // n) + tuple(x.shape[1:]))
        return everything[:, rank_of(group)].reshape(x.shape).contiguous()

    def mirror():  # every rank sends this rank its chunk r
        mine = x.chunk(n, 0)[rank_of(group)]
        out.view((n,) + tuple(mine.shape)).copy_(mine.expand((n,) + tuple(mine.shape)))
        return out

    return _fused(group, "all_to_all", run, fallback, mirror)


# ------------------------------------------------------------------------------------------------
# Dim-aware ops (no autograd).


def _to_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous() if dim else x.contiguous()


def _from_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(0, dim).contiguous() if dim else x


def _check_dim(x: torch.Tensor, dim: int, what: str) -> None:
    if not 0 <= dim < x.dim():
        raise ValueError(f"{what}: dim {dim} out of range for a tensor of shape {tuple(x.shape)}")


def _slice(x, dim, rank, n):
    _check_dim(x, dim, "slice")
    if x.shape[dim] % n:
        raise ValueError(f"slice: dim {dim} of shape {tuple(x.shape)} does not divide over {n} ranks")
    k = x.shape[dim] // n
    return x.narrow(dim, rank * k, k).contiguous()


def _zero_pad(x, dim, rank, n):
    _check_dim(x, dim, "zero_pad")
    shape = list(x.shape)
    shape[dim] *= n
    out = x.new_zeros(shape)
    out.narrow(dim, rank * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def _all_to_all(x, src_dim, dst_dim, group):
    n = world_of(group)
    if n == 1:
        return x
    _check_dim(x, src_dim, "all_to_all")
    _check_dim(x, dst_dim, "all_to_all")
    if src_dim == dst_dim:
        return x
    received = all_to_all_raw(_to_front(x, dst_dim), group)
    parts = [p.movedim(0, dst_dim) if dst_dim else p for p in received.chunk(n, 0)]
    return torch.cat(parts, dim=src_dim)


def _keep_rank0(x, frm, to, group):
    return x if rank_of(group) == 0 else torch.zeros_like(x)


def _slice_op(x, frm, to, group):
    if not to.is_gather:
        raise ValueError(f"slice needs a gather target form, got {frm} -> {to}")
    n = world_of(group)
    return x if n == 1 else _slice(x, to.dim, rank_of(group), n)


def _zero_pad_op(x, frm, to, group):
    if not frm.is_gather:
        raise ValueError(f"zero_pad needs a gather source form, got {frm} -> {to}")
    n = world_of(group)
    return x if n == 1 else _zero_pad(x, frm.dim, rank_of(group), n)


def _all_gather_op(x, frm, to, group):
    if not frm.is_gather:
        raise ValueError(f"all_gather needs a gather source form, got {frm} -> {to}")
    _check_dim(x, frm.dim, "all_gather")
    return _from_front(gather_raw(_to_front(x, frm.dim), group), frm.dim)


def _reduce_scatter_op(x, frm, to, group):
    if not to.is_gather:
        raise ValueError(f"reduce_scatter needs a gather target form, got {frm} -> {to}")
    _check_dim(x, to.dim, "reduce_scatter")
    return _from_front(reduce_scatter_raw(_to_front(x, to.dim), group), to.dim)


def _grad_sync(x, frm, to, group):
    """The backward of a replicated parameter's conversion ``to -> frm`` (``frm`` is the form of the
    gradient it receives): the adjoint of the forward op, then the sum over ranks."""
    return all_reduce_raw(apply_op(conversion(to, frm).backward_local, x, frm, to, group), group)


# The implementation of every op of hidup.ir.FORM_CHANGE_OPS: fn(x, frm, to, group), no autograd.
_RUN = {
    "identity": lambda x, frm, to, group: x,
    "slice": _slice_op,
    "zero_pad": _zero_pad_op,
    "keep_rank0": _keep_rank0,
    "all_gather": _all_gather_op,
    "reduce_scatter": _reduce_scatter_op,
    "all_reduce": lambda x, frm, to, group: all_reduce_raw(x, group),
    "all_to_all": lambda x, frm, to, group: _all_to_all(x, frm.dim, to.dim, group),
    "grad_sync": _grad_sync,
}
if set(_RUN) != set(FORM_CHANGE_OPS):
    raise AssertionError(f"codegen implements {sorted(_RUN)}, the IR declares {sorted(FORM_CHANGE_OPS)}")


def apply_op(op: str, x: torch.Tensor, frm: Form, to: Form, group=None) -> torch.Tensor:
    """Run the form-change op named ``op`` (:data:`hidup.ir.FORM_CHANGE_OPS`) on ``x``, moving it
    from form ``frm`` to form ``to`` (no autograd).  The sharded dim is the one of whichever side
    is a gather form."""
    run = _RUN.get(op)
    if run is None:
        raise ValueError(f"unknown conversion op {op!r}")
    return run(x, frm, to, group)


# ------------------------------------------------------------------------------------------------
# Autograd.


class _Convert(torch.autograd.Function):
    """Forward ``fwd`` from ``src`` to ``dst``; backward ``bwd`` from ``dst`` to ``src``."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, src, dst, group):
        ctx.spec = (fwd, bwd, src, dst, group)
        out = apply_op(fwd, x, src, dst, group)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        fwd, bwd, src, dst, group = ctx.spec
        out = apply_op(bwd, grad, dst, src, group)
        return out, None, None, None, None, None


def _convert_op(x, fwd, bwd, src, dst, group):
    if world_of(group) == 1 or (fwd == "identity" and bwd == "identity"):
        return x
    return _Convert.apply(x, fwd, bwd, src, dst, group)


def all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """``gather_dim -> full``: concatenate the ranks' slices; backward reduce-scatters."""
    return _convert_op(x, "all_gather", "reduce_scatter", gather(dim), FULL, group)


def reduce_scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """``reduce -> gather_dim``: this rank's slice of the sum; backward all-gathers."""
    return _convert_op(x, "reduce_scatter", "all_gather", REDUCE, gather(dim), group)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group=None) -> torch.Tensor:
    """``gather_src -> gather_dst``: re-slice; backward is the reverse all-to-all."""
    if src_dim == dst_dim:
        return x
    return _convert_op(x, "all_to_all", "all_to_all", gather(src_dim), gather(dst_dim), group)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """``reduce -> full``: the sum over ranks; backward all-reduces the partial gradients."""
    return _convert_op(x, "all_reduce", "all_reduce", REDUCE, FULL, group)


def slice(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:  # noqa: A001 - the table's name
    """``full -> gather_dim``: this rank's slice; backward zero-pads (partial gradient of full)."""
    return _convert_op(x, "slice", "zero_pad", FULL, gather(dim), group)


def zero_pad(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """``gather_dim -> reduce``: the local slice placed in zeros; backward slices."""
    return _convert_op(x, "zero_pad", "slice", gather(dim), REDUCE, group)


def keep_rank0(x: torch.Tensor, group=None) -> torch.Tensor:
    """``full -> reduce``: rank 0 keeps the value, the others hold zeros; backward is the same mask."""
    return _convert_op(x, "keep_rank0", "keep_rank0", FULL, REDUCE, group)


def replicate(x: torch.Tensor, group=None) -> torch.Tensor:
    """``replicate -> full``: identity forward; backward all-reduces, giving every rank the exact
    gradient of the replicated parameter."""
    return _convert_op(x, "identity", "grad_sync", Form("replicate"), FULL, group)


class _ConvertCast(torch.autograd.Function):
    """:class:`_Convert` of ``x`` cast to ``dtype`` first (the data travels in ``dtype``); the backward
    runs in ``reduce`` (``x``'s dtype, or the gradient's reduce dtype) and returns the gradient of ``x``
    in ``x``'s dtype (module docstring, "Casts on the wire")."""

    # why: autograd's forward takes the conversion's spec whole (ops, forms, group, both dtypes)
    @staticmethod
    def forward(ctx, x, fwd, bwd, src, dst, group, dtype, reduce):
        ctx.spec = (bwd, src, dst, group, x.dtype, reduce)
        out = apply_op(fwd, x.to(dtype), src, dst, group)
        return x.view_as(x) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        bwd, src, dst, group, dtype, reduce = ctx.spec
        return apply_op(bwd, grad.to(reduce), dst, src, group).to(dtype), None, None, None, None, None, None, None


def convert_cast(
    x: torch.Tensor, src: Form, dst: Form, group, dtype: torch.dtype, reduce_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`convert` of ``x`` sent in ``dtype`` (the output has ``dtype``), its gradient reduced in
    ``reduce_dtype`` (None: ``x``'s dtype, with no rounding of the gradient to ``dtype``) and returned
    in ``x``'s dtype."""
    conv = conversion(src, dst)
    if conv is None:
        raise ValueError(f"no conversion from form {src} to form {dst}")
    reduce = x.dtype if reduce_dtype is None else reduce_dtype
    if world_of(group) == 1 or (x.dtype == dtype and reduce == x.dtype):
        return convert(x.to(dtype), src, dst, group)
    return _ConvertCast.apply(x, conv.forward, conv.backward, src, dst, group, dtype, reduce)


def convert(x: torch.Tensor, src: Form, dst: Form, group=None) -> torch.Tensor:
    """Turn ``x`` (this rank's piece of a tensor in form ``src``) into its piece in form ``dst``,
    per :func:`hidup.ir.conversion`, with the conjugate backward."""
    conv = conversion(src, dst)
    if conv is None:
        raise ValueError(
            f"no conversion from form {src} to form {dst}; "
            f"only parameters produce 'replicate' and nothing converts into it"
        )
    return _convert_op(x, conv.forward, conv.backward, src, dst, group)
