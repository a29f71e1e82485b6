"""Simulated SPMD: run a rule's signatures on N virtual ranks in one process and compare.

For a call ``target(*args, **kwargs)`` on real tensors (``nn.Parameter`` marks parameters):

forward   split every tensor input per its form -- ``gather_d``: the r-th chunk along d;
          ``full``/``replicate``: the same tensor on every rank; ``reduce``: random parts that sum
          to the value -- run ``localize(ctx, sig, r)`` on every rank and rebuild each output per
          its form (``gather_d``: cat along d; ``reduce``: sum; ``full``: all ranks must agree);
          compare with the unsplit op.
backward  seed each output's gradient per its form (``gather_d``: the slice of a random gradient
          G; ``reduce``: the whole G on every rank; ``full``: random parts summing to G), backprop
          on every rank, rebuild each input gradient (``gather_d``: cat; ``full``/``replicate``:
          sum; ``reduce``: every rank must hold the same, exact gradient) and compare with
          autograd of the unsplit op.  Module parameters of leaf modules are shared by the
          simulated ranks, so their ``.grad`` accumulates the per-rank sum directly.

On a device mesh ``(n_0, n_1, ...)`` (:func:`check_mesh_signature`) a tensor
has a :class:`~hidup.ir.Layout`, one form per axis, and everything above nests axis after axis: the
rank at coordinates ``(i, j, ...)`` holds axis 0's piece ``i`` of the value, split by axis 1's form
into piece ``j``, and so on (``reduce`` on an axis: random parts over that axis summing to the piece
the axes before it left).  Outputs and input gradients are rebuilt innermost axis first, each axis by
the rule of its form above; the output gradients are seeded the same way, outer axis first.  Each
rank runs :func:`hidup.rules.mesh.localize_mesh`, the op localized by one rule signature per axis.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from typing import Any

import torch
import torch.nn as nn
from torch.fx.node import map_aggregate

from hidup import rules
from hidup.ir import FULL, Form, Layout, Signature
from hidup.rules import dispatch
from hidup.rules.base import RuleContext, TensorMeta
from hidup.rules.mesh import localize_mesh, mesh_signatures
from hidup.rules.registry import callable_of

__all__ = [
    "make_context",
    "check_op",
    "check_signature",
    "has_sig",
    "dtype_name",
    "mesh_rule_signatures",
    "check_mesh_signature",
    "split_layout",
    "seed_layout_grad",
    "rebuild_layout",
    "rebuild_layout_grad",
]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(
        tuple(t.shape),
        dtype_name(t.dtype),
        bool(t.requires_grad or isinstance(t, nn.Parameter)),
        isinstance(t, nn.Parameter),
    )


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    raise TypeError(f"op returned {type(out).__name__}, expected a tensor or a tuple of tensors")


def _substitute(args, kwargs, values: list) -> tuple[tuple, dict]:
    it = iter(values)

    def sub(v):
        return next(it) if isinstance(v, TensorMeta) else v

    a, k = map_aggregate((args, kwargs), sub)
    return tuple(a), dict(k)


def make_context(target, args: tuple, kwargs: dict | None = None, world: int = 2, module: nn.Module | None = None):
    """(ctx, input values, reference outputs): metas replace the tensors of args/kwargs."""
    kwargs = kwargs or {}
    values: list[torch.Tensor] = []

    def to_meta(v):
        if isinstance(v, torch.Tensor):
            values.append(v)
            return _meta(v)
        return v

    margs, mkwargs = map_aggregate((tuple(args), dict(kwargs)), to_meta)
    inputs = [_meta(v) for v in values]
    if module is not None:
        for _, p in module.named_parameters():
            inputs.append(_meta(p))
    fn = module if module is not None else callable_of(target)
    with torch.no_grad():
        ref = _flat_outputs(fn(*args, **kwargs))
    outputs = [_meta(o) for o in ref]
    ctx = RuleContext(
        target if module is None else type(module),
        tuple(margs),
        dict(mkwargs),
        inputs,
        outputs,
        world,
        module,
        "test_node",
    )
    return ctx, values, ref


def _split_input(v: torch.Tensor, form: Form, world: int, gen: torch.Generator) -> list[torch.Tensor]:
    if form.kind in ("full", "replicate"):
        return [v.detach().clone() for _ in range(world)]
    if form.is_gather:
        return [c.detach().clone().contiguous() for c in torch.chunk(v, world, form.dim)]
    # reduce: random parts summing to v
    if v.is_floating_point():
        parts = [torch.randn(v.shape, generator=gen, dtype=v.dtype) for _ in range(world - 1)]
    else:
        parts = [torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype) for _ in range(world - 1)]
    last = v.detach() - sum(parts) if parts else v.detach().clone()
    return [p.clone() for p in parts] + [last]


def _seed_grad(g: torch.Tensor, form: Form, world: int, gen: torch.Generator) -> list[torch.Tensor]:
    if form.is_gather:
        return [c.contiguous() for c in torch.chunk(g, world, form.dim)]
    if form.kind == "reduce":
        return [g.clone() for _ in range(world)]
    parts = [torch.randn(g.shape, generator=gen, dtype=g.dtype) for _ in range(world - 1)]
    return parts + [g - sum(parts) if parts else g.clone()]


def _coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The floating dtype of least precision among ``dtypes`` (float64 when there is none)."""
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float64)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
    # float64 is checked tightly; lower precisions (casts of random partial sums) by their epsilon;
    # ``dtype``: the precision the values went through when coarser than their own (a cast's gradient)
    tol = {torch.float64: (1e-6, 1e-8), torch.float32: (1e-4, 1e-4)}.get(
        _coarsest(b.dtype, dtype or b.dtype), (1e-2, 1e-2)
    )
    torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1], msg=lambda m: f"{what}: {m}")


def check_signature(
    ctx: RuleContext, sig: Signature, values: list[torch.Tensor], seed: int = 0, no_grad: tuple[int, ...] = ()
) -> None:
    """Forward and backward of one signature on ``ctx.world`` simulated ranks (raises on mismatch).

    ``no_grad``: indices of floating inputs the op cannot differentiate (class weights of a loss).
    """
    N = ctx.world

    def _wants_grad(t: torch.Tensor, i: int) -> bool:
        return t.is_floating_point() and i not in no_grad

    gen = torch.Generator().manual_seed(seed)
    where = f"{getattr(ctx.target, '__name__', ctx.target)} {sig} N={N} shapes={[m.shape for m in ctx.inputs]}"
    module = ctx.module
    n_params = len(list(module.named_parameters())) if module is not None else 0
    for f in sig.inputs[len(sig.inputs) - n_params :] if n_params else ():
        assert f == FULL, f"{where}: module parameters must be full"

    # reference
    ref_in = [v.detach().clone().requires_grad_(_wants_grad(v, i)) for i, v in enumerate(values)]
    args, kwargs = _substitute(ctx.args, ctx.kwargs, ref_in)
    fn = module if module is not None else callable_of(ctx.target)
    if module is not None:
        module.zero_grad(set_to_none=True)
    ref_out = _flat_outputs(fn(*args, **kwargs))
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.requires_grad else None for o in ref_out]
    pairs = [(o, g) for o, g in zip(ref_out, grads) if g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    ref_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref_in]
    ref_pgrads = []
    if module is not None:
        ref_pgrads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
        module.zero_grad(set_to_none=True)

    # per-rank forward
    pieces = [_split_input(v, f, N, gen) for v, f in zip(values, sig.inputs)]
    locals_in, calls = [], []
    for r in range(N):
        loc = [p[r].requires_grad_(_wants_grad(p[r], i)) for i, p in enumerate(pieces)]
        locals_in.append(loc)
        a, k = _substitute(ctx.args, ctx.kwargs, loc)
        calls.append(rules.localize(dataclasses.replace(ctx, args=a, kwargs=k), sig, r))
    ranks = _Ranks(N, communicates=any("mesh_axis" in c.kwargs for c in calls))
    outs = ranks.run([lambda c=c: _flat_outputs(rules.kernel_of(c.target)(*c.args, **c.kwargs)) for c in calls])
    for j, (form, ref) in enumerate(zip(sig.outputs, ref_out)):
        per = [o[j] for o in outs]
        for o in per:
            assert o.shape == tuple(form.local_shape(ref.shape, N)), (
                f"{where}: output {j} local shape {tuple(o.shape)} != {form.local_shape(ref.shape, N)}"
            )
        if form.is_gather:
            got = torch.cat([p.detach() for p in per], form.dim)
        elif form.kind == "reduce":
            got = sum(p.detach() for p in per)
        else:
            for r in range(1, N):
                _close(per[r].detach(), per[0].detach(), f"{where}: full output {j} differs on rank {r}")
            got = per[0].detach()
        _close(got, ref.detach(), f"{where}: output {j}")

    # per-rank backward
    split_grads = [_seed_grad(g, form, N, gen) if g is not None else None for form, g in zip(sig.outputs, grads)]

    def backward(r: int) -> None:
        seeds = []
        for j, sg in enumerate(split_grads):
            if sg is None or not outs[r][j].requires_grad:
                continue
            seeds.append((outs[r][j], sg[r]))
        if seeds:
            torch.autograd.backward([o for o, _ in seeds], [g for _, g in seeds])

    ranks.run([functools.partial(backward, r) for r in range(N)])
    for i, (form, v) in enumerate(zip(sig.inputs, values)):
        if not _wants_grad(v, i):
            continue
        per = [loc[i].grad if loc[i].grad is not None else torch.zeros_like(loc[i]) for loc in locals_in]
        if form.is_gather:
            got = torch.cat(per, form.dim)
        elif form.kind == "reduce":
            for r in range(1, N):
                _close(per[r], per[0], f"{where}: gradient of reduce input {i} differs on rank {r}")
            got = per[0]
        else:
            got = sum(per)
        # an input's gradient passes through the outputs' dtypes (the gradient of a float64 -> float32
        # cast is summed over the ranks' float32 partial gradients)
        _close(got, ref_grads[i], f"{where}: gradient of input {i}", _coarsest(v.dtype, *(o.dtype for o in ref_out)))
    if module is not None:
        for (name, p), g in zip(module.named_parameters(), ref_pgrads):
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            _close(got, g, f"{where}: gradient of parameter {name}")


class _Exchange:
    """Rank ``rank``'s stand-in process group of ranks run as threads (:mod:`hidup.rules.dispatch`):
    ``exchange_rows`` is ``all_to_all_single`` through a shared mailbox."""

    def __init__(self, rank: int, size: int, box: list, barrier: threading.Barrier):
        self.rank, self.size, self._box, self._barrier = rank, size, box, barrier

    def exchange_rows(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self._box[self.rank] = t.split(send)
        self._barrier.wait()
        out = torch.cat([self._box[q][self.rank] for q in range(self.size)])
        assert out.shape[0] == sum(recv), f"rank {self.rank}: received {out.shape[0]} rows, expected {sum(recv)}"
        self._barrier.wait()  # every rank has read the mailbox before the next exchange fills it
        return out


class _Ranks:
    """Runs one function per simulated rank: one after the other, or -- where the local calls
    communicate inside (a ``mesh_axis`` keyword: the routed experts' all-to-all dispatcher) -- as
    threads, each with its :class:`_Exchange` as the call's process group."""

    def __init__(self, world: int, communicates: bool):
        self.world, self.communicates = world, communicates
        barrier, box = threading.Barrier(world, timeout=60), [None] * world
        self.groups = [_Exchange(r, world, box, barrier) for r in range(world)]
        self._local = threading.local()

    def run(self, fns: list) -> list:
        if not self.communicates:
            return [fn() for fn in fns]
        results: list = [None] * self.world
        errors: list = []

        def one(r: int) -> None:
            self._local.group = self.groups[r]
            try:
                results[r] = fns[r]()
            except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread
                errors.append(e)
                self.groups[r]._barrier.abort()

        before = dispatch.group_resolver()
        dispatch.use_group_resolver(lambda axis: self._local.group)
        try:
            threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            dispatch.use_group_resolver(before)
        if errors:
            raise errors[0]
        return results


def check_op(
    target,
    args: tuple,
    kwargs: dict | None = None,
    worlds=(2, 4),
    module: nn.Module | None = None,
    seed: int = 0,
    no_grad: tuple[int, ...] = (),
) -> dict[int, list[Signature]]:
    """Check every signature of the op for each world size; returns the signatures per world."""
    result = {}
    for N in worlds:
        ctx, values, _ = make_context(target, args, kwargs, N, module)
        sigs = rules.signatures(ctx)
        assert sigs is not None, f"no rule for {target!r}"
        full = [s for s in sigs if all(f == FULL for f in s.inputs + s.outputs)]
        assert full, f"{target!r}: the all-full signature is missing"
        for s in sigs:
            for f, m in list(zip(s.inputs, ctx.inputs)) + list(zip(s.outputs, ctx.outputs)):
                if f.is_gather:
                    assert m.shape[f.dim] % N == 0, f"{target!r}: {s} splits {m.shape} on {N} ranks"
            check_signature(ctx, s, values, seed, no_grad)
        result[N] = sigs
    return result


def has_sig(sigs: list[Signature], inputs=None, outputs=None, kind=None) -> bool:
    """Whether a signature with these input/output forms (strings like "gather_0") is present."""

    def match(want, got):
        return want is None or tuple(str(f) for f in got) == tuple(want)

    return any(match(inputs, s.inputs) and match(outputs, s.outputs) and (kind is None or s.kind == kind) for s in sigs)


# --------------------------------------------------------------------------------------------- meshes

Coords = tuple[int, ...]


def _nested(v: torch.Tensor, forms: tuple[Form, ...], mesh: tuple[int, ...], split) -> dict[Coords, torch.Tensor]:
    """``v`` split axis after axis: ``split(piece, form, n)`` gives an axis's pieces of what the axes
    before it left; keyed by mesh coordinates."""
    if not mesh:
        return {(): v}
    out = {}
    for i, piece in enumerate(split(v, forms[0], mesh[0])):
        for rest, sub in _nested(piece, forms[1:], mesh[1:], split).items():
            out[(i,) + rest] = sub
    return out


def _unnested(pieces: dict[Coords, torch.Tensor], forms: tuple[Form, ...], mesh: tuple[int, ...], join, prefix=()):
    """Inverse of :func:`_nested`: ``join(parts, form, where)`` rebuilds one axis's pieces, innermost
    axis first."""
    k = len(prefix)
    if k == len(mesh):
        return pieces[prefix]
    parts = [_unnested(pieces, forms, mesh, join, prefix + (i,)) for i in range(mesh[k])]
    return join(parts, forms[k], f"axis {k} at {prefix}")


def split_layout(v: torch.Tensor, layout: Layout, mesh: tuple[int, ...], gen: torch.Generator):
    """Every rank's piece of ``v`` under ``layout`` (module docstring), keyed by mesh coordinates."""
    return _nested(v, layout.forms, mesh, lambda x, f, n: _split_input(x, f, n, gen))


def seed_layout_grad(g: torch.Tensor, layout: Layout, mesh: tuple[int, ...], gen: torch.Generator):
    """Every rank's gradient of a tensor of ``layout`` whose true gradient is ``g``: the gradient
    convention of :mod:`hidup.ir` applied per axis (``full``: random partial contributions)."""
    return _nested(g, layout.forms, mesh, lambda x, f, n: _seed_grad(x, f, n, gen))


def rebuild_layout(pieces: dict, layout: Layout, mesh: tuple[int, ...], where: str = "") -> torch.Tensor:
    """The logical value of per-rank ``pieces`` of ``layout``; ``full``/``replicate`` axes must agree."""

    def join(parts, form, at):
        if form.is_gather:
            return torch.cat(parts, form.dim)
        if form.kind == "reduce":
            return sum(parts[1:], parts[0])
        for r, p in enumerate(parts[1:], 1):
            _close(p, parts[0], f"{where}: {form} pieces differ along {at}, index {r}")
        return parts[0]

    return _unnested(pieces, layout.forms, mesh, join)


def rebuild_layout_grad(
    grads: dict, layout: Layout, mesh: tuple[int, ...], where: str = "", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The true gradient held as ``grads`` under the per-axis gradient convention of ``layout``
    (``gather``: exact slices; ``full``/``replicate``: partial sums; ``reduce``: exact and identical
    along the axis)."""

    def join(parts, form, at):
        if form.is_gather:
            return torch.cat(parts, form.dim)
        if form.kind == "reduce":
            for r, p in enumerate(parts[1:], 1):
                _close(p, parts[0], f"{where}: reduce gradients differ along {at}, index {r}", dtype)
            return parts[0]
        return sum(parts[1:], parts[0])

    return _unnested(grads, layout.forms, mesh, join)


def mesh_rule_signatures(ctx: RuleContext, mesh: tuple[int, ...]) -> list[Signature]:
    """Every product signature of ``ctx``'s op on ``mesh``, exactly as :func:`hidup.trace` annotates a
    call node (the one-axis rule signatures filtered to each axis's world)."""
    from hidup.frontend.trace import filtered_signatures

    sigs, reason = mesh_signatures(ctx, mesh, lambda c: filtered_signatures(rules.signatures, c), rules.localize)
    assert sigs is not None, f"{ctx.target!r}: no signature on mesh {mesh}: {reason}"
    return sigs


def _coords(mesh: tuple[int, ...]) -> list[Coords]:
    return [tuple(c) for c in itertools.product(*(range(n) for n in mesh))]


def check_mesh_signature(
    ctx: RuleContext,
    sig: Signature,
    values: list[torch.Tensor],
    mesh: tuple[int, ...],
    seed: int = 0,
    no_grad: tuple[int, ...] = (),
) -> None:
    """Forward and backward of one product signature on the simulated ``mesh`` (raises on mismatch):
    inputs split per layout, :func:`localize_mesh` run per rank, outputs and input gradients rebuilt
    per layout and compared with the unsplit op and autograd (module docstring)."""
    if ctx.module is not None:
        raise ValueError("check_mesh_signature checks functions, not leaf modules")

    def _wants_grad(t: torch.Tensor, i: int) -> bool:
        return t.is_floating_point() and i not in no_grad

    gen = torch.Generator().manual_seed(seed)
    name = getattr(ctx.target, "__name__", ctx.target)
    where = f"{name} {sig} mesh={mesh} shapes={[m.shape for m in ctx.inputs]}"
    assert len(sig.axes) == len(mesh), f"{where}: {len(sig.axes)} factors for a mesh of {len(mesh)} axes"

    # reference
    ref_in = [v.detach().clone().requires_grad_(_wants_grad(v, i)) for i, v in enumerate(values)]
    args, kwargs = _substitute(ctx.args, ctx.kwargs, ref_in)
    ref_out = _flat_outputs(callable_of(ctx.target)(*args, **kwargs))
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.requires_grad else None for o in ref_out]
    pairs = [(o, g) for o, g in zip(ref_out, grads) if g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    ref_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref_in]

    # per-rank forward
    coords = _coords(mesh)
    pieces = [split_layout(v, lay, mesh, gen) for v, lay in zip(values, sig.inputs)]
    locals_in, outs = {}, {}
    for c in coords:
        loc = [p[c].requires_grad_(_wants_grad(p[c], i)) for i, p in enumerate(pieces)]
        locals_in[c] = loc
        call = localize_mesh(ctx, sig, c, mesh, rules.localize, loc)
        outs[c] = _flat_outputs(rules.kernel_of(call.target)(*call.args, **call.kwargs))
    for j, (lay, ref) in enumerate(zip(sig.outputs, ref_out)):
        want = lay.local_shape(ref.shape, mesh)
        for c in coords:
            got = tuple(outs[c][j].shape)
            assert got == want, f"{where}: output {j} on rank {c} has local shape {got}, expected {want}"
        per = {c: outs[c][j].detach() for c in coords}
        _close(rebuild_layout(per, lay, mesh, f"{where}: output {j}"), ref.detach(), f"{where}: output {j}")

    # per-rank backward
    seeds = [seed_layout_grad(g, lay, mesh, gen) if g is not None else None for lay, g in zip(sig.outputs, grads)]
    for c in coords:
        todo = [(outs[c][j], sg[c]) for j, sg in enumerate(seeds) if sg is not None and outs[c][j].requires_grad]
        if todo:
            torch.autograd.backward([o for o, _ in todo], [g for _, g in todo])
    out_dtype = _coarsest(*(o.dtype for o in ref_out))
    for i, (lay, v) in enumerate(zip(sig.inputs, values)):
        if not _wants_grad(v, i):
            continue
        dtype = _coarsest(v.dtype, out_dtype)
        per = {c: g if (g := locals_in[c][i].grad) is not None else torch.zeros_like(locals_in[c][i]) for c in coords}
        got = rebuild_layout_grad(per, lay, mesh, f"{where}: gradient of input {i}", dtype)
        _close(got, ref_grads[i], f"{where}: gradient of input {i}", dtype)
