"""Indexing and (un)joining: getitem, select, narrow, split/chunk/unbind, cat/stack, index_select.

Dims are tracked: a dim that passes through unchanged (a full ``:`` slice, a dim that is not split
or joined) may be sharded, and its index in the output is where it lands (``x[:, 0]`` moves dim 2
to dim 1).  A dim that is indexed by an int, partially sliced, split, concatenated or stacked is
never sharded: rank r's piece of such a result is not the r-th slice of anything.  A slice that
covers the whole of a sharded dim (``x[:, :S]``) is kept: ``localize`` rewrites it to ``:`` (and a
full-length ``narrow`` to the local length) so it selects the whole local piece.

All of these are linear in their tensor operand(s): ``reduce`` in, ``reduce`` out (for ``cat`` and
``stack`` all operands together).  Advanced indexing with a tensor index is linear in ``x`` only:
all-``full`` or ``(x reduce, index full) -> reduce``.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch

from hidup.ir import FULL, REDUCE, Signature
from hidup.rules.base import LocalCall, RuleContext, TensorMeta
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, all_full, bind, callable_of, register

__all__ = ["index_tokens"]


def _full_slice(s: slice, size: int) -> bool:
    return (s.start in (None, 0) or s.start <= -size) and (s.stop is None or s.stop >= size) and s.step in (None, 1)


def _normalize_index(idx, nd: int) -> list:
    items = list(idx) if isinstance(idx, tuple) else [idx]
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise Unsupported("index with more than one Ellipsis")
    out = []
    for it in items:
        if it is Ellipsis:
            out.extend([slice(None)] * (nd - used))
        else:
            out.append(it)
    n_dims = sum(1 for it in out if it is not None)
    out.extend([slice(None)] * (nd - n_dims))
    return out


def index_tokens(idx, shape) -> tuple[list[str], list[str], set[str], list[int | None]]:
    """Tokens of ``x[idx]``; also, per input dim, the position of its item in the normalized index."""
    items = _normalize_index(idx, len(shape))
    tin, tout, fixed, where = [], [], set(), []
    d = 0
    for pos, it in enumerate(items):
        if it is None:
            t = f"n{pos}"
            tout.append(t)
            fixed.add(t)
        elif isinstance(it, bool) or not isinstance(it, (int, slice)):
            raise Unsupported(f"index item {it!r} is not an int, slice, None or Ellipsis")
        elif isinstance(it, int):
            t = f"i{d}"
            tin.append(t)
            fixed.add(t)
            where.append(pos)
            d += 1
        else:
            t = f"d{d}"
            tin.append(t)
            where.append(pos)
            if _full_slice(it, shape[d]):
                tout.append(t)
            else:
                fixed |= {t, f"s{d}"}
                tout.append(f"s{d}")
            d += 1
    if d != len(shape):
        raise Unsupported(f"index {idx!r} does not fit shape {tuple(shape)}")
    return tin, tout, fixed, where


def _has_tensor_index(idx) -> bool:
    items = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(it, (TensorMeta, torch.Tensor, list)) or type(it).__name__ == "Node" for it in items)


def _getitem_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    x, idx = ctx.args[0], ctx.args[1]
    f = sig.inputs[0]
    if not f.is_gather or _has_tensor_index(idx):
        return LocalCall(operator.getitem, (x, idx))
    items = _normalize_index(idx, len(ctx.inputs[0].shape))
    _, _, _, where = index_tokens(idx, ctx.inputs[0].shape)
    items[where[f.dim]] = slice(None)
    return LocalCall(operator.getitem, (x, tuple(items)))


@register(operator.getitem, "__getitem__", name="getitem", localize=_getitem_localize)
def _getitem(ctx: RuleContext) -> list[Signature]:
    if not isinstance(ctx.args[0], TensorMeta):
        raise Unsupported("getitem on a tuple or list: the tracer aliases the selected tensor")
    x, out = ctx.inputs[0], ctx.outputs[0]
    idx = ctx.args[1]
    if _has_tensor_index(idx):
        sigs = [all_full(ctx, 0.0)]
        if x.dtype != "bool" and not any(m.dtype == "bool" for m in ctx.inputs[1:]):
            sigs.append(Signature((REDUCE,) + tuple(FULL for _ in ctx.inputs[1:]), (REDUCE,), 0.0, "data"))
        return sigs
    tin, tout, fixed, _ = index_tokens(idx, x.shape)
    return shard_signatures([tin], [tout], [x], [out], ctx.world, 0.0, fixed=fixed, linear=[(0,)], where="getitem")


@register(torch.select, "select", name="select")
def _select(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "index"], where="select")
    x = ctx.inputs[0]
    d = b["dim"] % len(x.shape)
    tin = [f"d{k}" for k in range(len(x.shape))]
    tout = tin[:d] + tin[d + 1 :]
    return shard_signatures(
        [tin], [tout], [x], ctx.outputs, ctx.world, 0.0, fixed={tin[d]}, linear=[(0,)], where="select"
    )


def _narrow_args(ctx: RuleContext):
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "start", "length"], where="narrow")
    x = ctx.inputs[0]
    return b, b["dim"] % len(x.shape)


def _narrow_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    b, d = _narrow_args(ctx)
    f = sig.inputs[0]
    length = b["length"]
    if f.is_gather and f.dim == d:
        length = ctx.inputs[0].shape[d] // ctx.world
    return LocalCall(callable_of(ctx.target), (ctx.args[0], b["dim"], b["start"], length))


@register(torch.narrow, "narrow", name="narrow", localize=_narrow_localize)
def _narrow(ctx: RuleContext) -> list[Signature]:
    b, d = _narrow_args(ctx)
    x = ctx.inputs[0]
    tin = [f"d{k}" for k in range(len(x.shape))]
    tout = list(tin)
    fixed = set()
    if not (b["start"] in (0, -x.shape[d]) and b["length"] == x.shape[d]):
        tout[d] = "n"
        fixed = {tin[d], "n"}
    return shard_signatures([tin], [tout], [x], ctx.outputs, ctx.world, 0.0, fixed=fixed, linear=[(0,)], where="narrow")


def _split_like(ctx: RuleContext, dim: int, keep_dim: bool) -> list[Signature]:
    """One input, several outputs cut (or unbound) along ``dim``."""
    x = ctx.inputs[0]
    nd = len(x.shape)
    d = dim % nd
    tin = [f"d{k}" for k in range(nd)]
    trivial = len(ctx.outputs) == 1 and keep_dim and ctx.outputs[0].shape == x.shape
    fixed = set() if trivial else {tin[d]}
    touts = []
    for j in range(len(ctx.outputs)):
        row = list(tin)
        if keep_dim:
            if not trivial:
                row[d] = f"p{j}"
                fixed.add(row[d])
        else:
            del row[d]
        touts.append(row)
    return shard_signatures(
        [tin], touts, [x], ctx.outputs, ctx.world, 0.0, fixed=fixed, linear=[(0,)], strict=False, where=str(ctx.target)
    )


def _split_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """A split along a sharded dim is always the trivial one-piece split: make its size local."""
    b = bind(ctx.args, ctx.kwargs, ["tensor", "split_size_or_sections", "dim"], {"dim": 0}, where="split")
    f = sig.inputs[0]
    x = ctx.inputs[0]
    if f.is_gather and f.dim == b["dim"] % len(x.shape):
        sections = x.shape[f.dim] // ctx.world
        if isinstance(b["split_size_or_sections"], (list, tuple)):
            sections = [sections]
        return LocalCall(callable_of(ctx.target), (ctx.args[0], sections, b["dim"]))
    return LocalCall(callable_of(ctx.target), tuple(ctx.args), dict(ctx.kwargs))


@register(torch.split, "split", name="split", localize=_split_localize)
def _split(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["tensor", "split_size_or_sections", "dim"], {"dim": 0}, where="split")
    if isinstance(b["split_size_or_sections"], (TensorMeta, torch.Tensor)):
        raise Unsupported("split with tensor sections")
    return _split_like(ctx, b["dim"], True)


@register(torch.chunk, "chunk", name="chunk")
def _chunk(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "chunks", "dim"], {"dim": 0}, where="chunk")
    return _split_like(ctx, b["dim"], True)


@register(torch.unbind, "unbind", name="unbind")
def _unbind(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim"], {"dim": 0}, where="unbind")
    return _split_like(ctx, b["dim"], False)


def _tensors_dim(ctx: RuleContext, name: str):
    b = bind(ctx.args, ctx.kwargs, ["tensors", "dim", "out"], {"dim": 0, "out": None}, where=name)
    if b["out"] is not None:
        raise Unsupported(f"{name} with out=")
    return b["dim"]


@register(torch.cat, torch.concat, torch.concatenate, name="cat")
def _cat(ctx: RuleContext) -> list[Signature]:
    dim = _tensors_dim(ctx, "cat")
    out = ctx.outputs[0]
    nd = len(out.shape)
    ins = ctx.inputs
    legacy = [j for j, m in enumerate(ins) if m.shape == (0,) and nd != 1]
    if legacy:  # empty 1-D tensors (an empty cache, say) add nothing: every rank passes them whole
        keep = [j for j in range(len(ins)) if j not in legacy]
        sub = _cat(replace(ctx, args=([ins[j] for j in keep], dim), kwargs={}, inputs=[ins[j] for j in keep]))
        out_sigs = []
        for s in sub:
            forms = dict(zip(keep, s.inputs))
            out_sigs.append(replace(s, inputs=tuple(forms.get(j, FULL) for j in range(len(ins)))))
        return out_sigs
    if any(len(m.shape) != nd for m in ins):
        raise Unsupported("cat of tensors with different ranks")
    d = dim % nd
    tout = [f"d{k}" for k in range(nd)]
    tout[d] = "c"
    tin = []
    for j in range(len(ins)):
        row = list(tout)
        row[d] = f"c{j}"
        tin.append(row)
    fixed = {"c"} | {f"c{j}" for j in range(len(ins))}
    return shard_signatures(
        tin,
        [tout],
        ins,
        ctx.outputs,
        ctx.world,
        0.0,
        fixed=fixed,
        linear=[tuple(range(len(ins)))],
        strict=False,
        where="cat",
    )


@register(torch.stack, name="stack")
def _stack(ctx: RuleContext) -> list[Signature]:
    dim = _tensors_dim(ctx, "stack")
    out = ctx.outputs[0]
    nd = len(out.shape)
    d = dim % nd
    tout = [f"d{k}" for k in range(nd)]
    tout[d] = "s"
    tin = [tout[:d] + tout[d + 1 :] for _ in ctx.inputs]
    return shard_signatures(
        tin,
        [tout],
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        0.0,
        fixed={"s"},
        linear=[tuple(range(len(ctx.inputs)))],
        where="stack",
    )


@register(torch.index_select, "index_select", name="index_select")
def _index_select(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "index"], where="index_select")
    x = ctx.inputs[0]
    d = b["dim"] % len(x.shape)
    tin = [f"d{k}" for k in range(len(x.shape))]
    tout = list(tin)
    tin[d], tout[d] = "a", "b"
    idx_tok = ["b"]
    return shard_signatures(
        [tin, idx_tok],
        [tout],
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        0.0,
        fixed={"a", "b"},
        linear=[(0,)],
        strict=False,
        where="index_select",
    )


@register(torch.gather, "gather", name="gather")
def _gather(ctx: RuleContext) -> list[Signature]:
    """``out[.., i, ..] = x[.., index[.., i, ..], ..]`` along ``dim``: the other dims, where ``x`` and
    ``index`` have the same size, may be sharded together; ``dim`` never.  Linear in ``x``."""
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "index", "sparse_grad"], {"sparse_grad": False}, where="gather")
    x, index = ctx.inputs[0], ctx.inputs[1]
    d = b["dim"] % len(x.shape)
    tin = [f"d{k}" for k in range(len(x.shape))]
    tidx = list(tin)
    fixed = {"a", "b"}
    for k in range(len(x.shape)):
        if index.shape[k] != x.shape[k]:
            tidx[k] = f"i{k}"
            fixed |= {tin[k], tidx[k]}
    tin[d], tidx[d] = "a", "b"
    return shard_signatures(
        [tin, tidx], [tidx], ctx.inputs, ctx.outputs, ctx.world, 0.0, fixed=fixed, linear=[(0,)], where="gather"
    )


@register(torch.nn.functional.pad, name="pad")
def _pad(ctx: RuleContext) -> list[Signature]:
    """``F.pad(x, pad)``: the padded dims (the last ``len(pad) // 2``) are never sharded, the others
    may be.  Linear in ``x`` when it pads with zeros (constant mode, value 0 or None)."""
    b = bind(ctx.args, ctx.kwargs, ["input", "pad", "mode", "value"], {"mode": "constant", "value": None}, where="pad")
    x = ctx.inputs[0]
    nd = len(x.shape)
    padded = {nd - 1 - k for k in range(len(b["pad"]) // 2)}
    tin = [f"d{k}" for k in range(nd)]
    tout = [f"p{k}" if k in padded else tin[k] for k in range(nd)]
    fixed = {tin[k] for k in padded} | {tout[k] for k in padded}
    zero = b["mode"] == "constant" and b["value"] in (None, 0, 0.0)
    return shard_signatures(
        [tin],
        [tout],
        [x],
        ctx.outputs,
        ctx.world,
        0.0,
        fixed=fixed,
        linear=[(0,)] if zero else (),
        strict=False,
        where="pad",
    )
