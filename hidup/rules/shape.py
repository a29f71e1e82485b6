"""Shape ops: view/reshape/flatten/unflatten, transpose/permute, expand, (un)squeeze, repeat.

Dims are tracked through each op.  For a reshape the input and output shapes are cut into groups
of consecutive dims with equal products (``[B, S, D] -> [B*S, D]`` gives groups ``(B,S)->(BS)``
and ``(D)->(D)``).  Inside a group only the *outermost* dim may be sharded, on both sides: if rank
r holds rows ``[r*a/N, (r+1)*a/N)`` of the outermost input dim ``a`` of a group of ``P`` elements,
it holds the contiguous flat range ``[r*P/N, (r+1)*P/N)``, which is exactly the r-th slice of the
outermost output dim ``b`` when ``N | b``.  So the signature ``gather(in_outer) -> gather(out_outer)``
is offered when ``N`` divides both; inner dims of a group are never sharded.  Size-1 dims are
outside every group.

All of them are linear: ``reduce -> reduce`` is always offered; ``full -> full`` too.

``localize`` rewrites size arguments to the local output shape (``view``, ``reshape``,
``expand``, ``unflatten``) and turns ``squeeze()`` and ``squeeze(dims)`` into an explicit
``squeeze(dims)`` of the dims of global size 1, so that a sharded dim whose local size happens to
be 1 is not squeezed away.
"""

from __future__ import annotations

import torch

from hidup.ir import Signature
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, bind, callable_of, register

__all__ = ["reshape_groups", "reshape_tokens"]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of (input dims, output dims) with equal products; size-1 dims belong to none."""
    if 0 in src or 0 in dst:
        raise Unsupported("reshape of an empty tensor")
    groups = []
    i = j = 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) or j == len(dst):
            if i != len(src) or j != len(dst):
                raise Unsupported(f"reshape {src} -> {dst} changes the number of elements")
            return groups
        si, dj, ps, pd = [i], [j], src[i], dst[j]
        i += 1
        j += 1
        while ps != pd:
            if ps < pd:
                if i == len(src):
                    raise Unsupported(f"reshape {src} -> {dst} changes the number of elements")
                si.append(i)
                ps *= src[i]
                i += 1
            else:
                if j == len(dst):
                    raise Unsupported(f"reshape {src} -> {dst} changes the number of elements")
                dj.append(j)
                pd *= dst[j]
                j += 1
        groups.append((si, dj))


def reshape_tokens(src, dst) -> tuple[list[str], list[str], set[str]]:
    tin = [f"i{k}" for k in range(len(src))]
    tout = [f"o{k}" for k in range(len(dst))]
    fixed = set(tin) | set(tout)
    for g, (si, dj) in enumerate(reshape_groups(tuple(src), tuple(dst))):
        tin[si[0]] = tout[dj[0]] = f"g{g}"
    return tin, tout, fixed


def _reshape_sigs(ctx: RuleContext) -> list[Signature]:
    x, out = ctx.inputs[0], ctx.outputs[0]
    tin, tout, fixed = reshape_tokens(x.shape, out.shape)
    return shard_signatures(
        [tin],
        [tout],
        [x],
        [out],
        ctx.world,
        0.0,
        fixed=fixed,
        linear=[(0,)],
        strict=False,
        where=f"{ctx.target} {x.shape}->{out.shape}",
    )


def _local_out(ctx: RuleContext, sig: Signature) -> tuple[int, ...]:
    return tuple(sig.outputs[0].local_shape(ctx.outputs[0].shape, ctx.world))


def _shape_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """view/reshape/expand: the size argument becomes the local output shape."""
    fn = callable_of(ctx.target)
    local = _local_out(ctx, sig)
    kwargs = {k: v for k, v in ctx.kwargs.items() if k not in ("size", "shape")}
    return LocalCall(fn, (ctx.args[0], local), kwargs)


@register(torch.reshape, "view", "reshape", name="reshape", localize=_shape_localize)
def _reshape(ctx: RuleContext) -> list[Signature]:
    if len(ctx.inputs) != 1 or any(isinstance(a, torch.dtype) for a in ctx.args[1:]):
        raise Unsupported("view(dtype) or a reshape with tensor arguments")
    return _reshape_sigs(ctx)


@register(torch.flatten, "flatten", name="flatten")
def _flatten(ctx: RuleContext) -> list[Signature]:
    return _reshape_sigs(ctx)


def _unflatten_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim", "sizes"], where="unflatten")
    nd = len(ctx.inputs[0].shape)
    d = b["dim"] % nd
    k = len(b["sizes"])
    local = _local_out(ctx, sig)[d : d + k]
    return LocalCall(callable_of(ctx.target), (ctx.args[0], b["dim"], tuple(local)))


@register(torch.unflatten, "unflatten", name="unflatten", localize=_unflatten_localize)
def _unflatten(ctx: RuleContext) -> list[Signature]:
    return _reshape_sigs(ctx)


def _permuted(ctx: RuleContext, perm: list[int]) -> list[Signature]:
    x, out = ctx.inputs[0], ctx.outputs[0]
    tin = [f"d{k}" for k in range(len(x.shape))]
    tout = [tin[p] for p in perm]
    return shard_signatures([tin], [tout], [x], [out], ctx.world, 0.0, linear=[(0,)], where=str(ctx.target))


@register(torch.transpose, torch.swapaxes, torch.swapdims, "transpose", "swapaxes", "swapdims", name="transpose")
def _transpose(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "dim0", "dim1"], where="transpose")
    nd = len(ctx.inputs[0].shape)
    perm = list(range(nd))
    if nd:
        a, c = b["dim0"] % nd, b["dim1"] % nd
        perm[a], perm[c] = perm[c], perm[a]
    return _permuted(ctx, perm)


@register(torch.t, "t", name="t")
def _t(ctx: RuleContext) -> list[Signature]:
    nd = len(ctx.inputs[0].shape)
    return _permuted(ctx, [1, 0] if nd == 2 else list(range(nd)))


@register(torch.permute, "permute", name="permute")
def _permute(ctx: RuleContext) -> list[Signature]:
    rest = list(ctx.args[1:])
    if "dims" in ctx.kwargs:
        rest = [ctx.kwargs["dims"]]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    nd = len(ctx.inputs[0].shape)
    return _permuted(ctx, [int(p) % nd for p in rest])


@register(torch.movedim, torch.moveaxis, "movedim", "moveaxis", name="movedim")
def _movedim(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "source", "destination"], where="movedim")
    nd = len(ctx.inputs[0].shape)
    src = [b["source"]] if isinstance(b["source"], int) else list(b["source"])
    dst = [b["destination"]] if isinstance(b["destination"], int) else list(b["destination"])
    src, dst = [s % nd for s in src], [d % nd for d in dst]
    perm = [-1] * nd
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(k for k in range(nd) if k not in src)
    perm = [p if p >= 0 else next(rest) for p in perm]
    return _permuted(ctx, perm)


@register("expand", name="expand", localize=_shape_localize)
def _expand(ctx: RuleContext) -> list[Signature]:
    """Broadcast size-1 (or new leading) dims: sharding such a dim keeps the input ``full``."""
    x, out = ctx.inputs[0], ctx.outputs[0]
    nx, no = len(x.shape), len(out.shape)
    tout = [f"d{k}" for k in range(no)]
    tin = tout[no - nx :]
    return shard_signatures([tin], [tout], [x], [out], ctx.world, 0.0, linear=[(0,)], where="expand")


@register("expand_as", name="expand_as")
def _expand_as(ctx: RuleContext) -> list[Signature]:
    x, other = ctx.inputs[0], ctx.inputs[1]
    out = ctx.outputs[0]
    no = len(out.shape)
    tout = [f"d{k}" for k in range(no)]
    tin = [tout[no - len(x.shape) :], tout[no - len(other.shape) :]]
    return shard_signatures(tin, [tout], ctx.inputs, ctx.outputs, ctx.world, 0.0, linear=[(0,)], where="expand_as")


@register(torch.unsqueeze, "unsqueeze", name="unsqueeze")
def _unsqueeze(ctx: RuleContext) -> list[Signature]:
    return _reshape_sigs(ctx)


def _squeeze_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    x = ctx.inputs[0]
    b = bind(ctx.args, ctx.kwargs, ["input", "dim"], {"dim": None}, where="squeeze")
    if b["dim"] is None:
        d = tuple(k for k, s in enumerate(x.shape) if s == 1)
    elif not x.shape:
        d = b["dim"]
    else:  # a named dim of global size > 1 is kept by squeeze, even where a rank holds one row of it
        named = [b["dim"]] if isinstance(b["dim"], int) else list(b["dim"])
        d = tuple(k % len(x.shape) for k in named if x.shape[k % len(x.shape)] == 1)
    return LocalCall(callable_of(ctx.target), (ctx.args[0], d))


@register(torch.squeeze, "squeeze", name="squeeze", localize=_squeeze_localize)
def _squeeze(ctx: RuleContext) -> list[Signature]:
    return _reshape_sigs(ctx)


@register("repeat", name="repeat")
def _repeat(ctx: RuleContext) -> list[Signature]:
    """``x.repeat(*reps)``: a dim repeated more than once is tiled, not split, so never sharded."""
    x, out = ctx.inputs[0], ctx.outputs[0]
    reps = list(ctx.args[1:])
    if len(reps) == 1 and isinstance(reps[0], (list, tuple)):
        reps = list(reps[0])
    no, nx = len(out.shape), len(x.shape)
    tout = [f"d{k}" for k in range(no)]
    fixed = {tout[k] for k in range(no) if reps[k] != 1}
    tin = tout[no - nx :]
    return shard_signatures(
        [tin], [tout], [x], [out], ctx.world, 0.0, fixed=fixed, linear=[(0,)], strict=False, where="repeat"
    )
