"""Contractions: linear, matmul/mm/bmm, addmm/baddbmm, and one generic rule for any einsum.

Specs (``!`` = never sharded, ``...`` = broadcast leading dims):

=================  ====================================  ===========================================
op                 spec                                  reduce propagation (linear in)
=================  ====================================  ===========================================
linear(x, W[, b])  ``...k, nk[, n] -> ...n``             {x[, b]} (never {x} alone when b exists)
matmul(a, b)       ``...mk, ...kn -> ...mn`` (1-D cases)  {a}, {b}
bmm(a, b)          ``bmk, bkn -> bmn``                   {a}, {b}
baddbmm(c, a, b)   ``bmn, bmk, bkn -> bmn`` (c additive)  {c, a}, {c, b}
einsum(eq, ...)    the equation itself                   each operand alone
=================  ====================================  ===========================================

``n`` of linear is column parallel (W ``gather_0``, output ``gather_last``); ``k`` is row parallel
(x ``gather_last``, W ``gather_1``, output ``reduce``, the bias ``reduce`` so that it is added once:
``sum_r (x_r W_r^T + b_r) = x W^T + b`` when ``sum_r b_r = b``).  Every leading dim of ``x`` is data
parallel.  For einsum, letters of the output are gathered, contracted letters reduce; MoE layers
need nothing special: ``gsec,gsd->egcd`` then ``egcd,edf->egcf`` shards ``g`` (data) and then ``e``
(expert), and the change between them is an all-to-all.

FLOPs: ``2 * prod(sizes of all distinct letters)`` for a contraction (``2*M*N*K`` for a matmul),
plus ``numel(out)`` for a bias.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from hidup.ir import Signature
from hidup.rules.base import RuleContext
from hidup.rules.notation import Dims, SpecError, dims
from hidup.rules.registry import Unsupported, bind, register, tensor_slots

__all__ = ["einsum_signatures", "contraction_flops"]


def contraction_flops(d: Dims, ctx: RuleContext) -> float:
    tin, tout = d.tokens([m.shape for m in ctx.inputs], [m.shape for m in ctx.outputs])
    size: dict[str, int] = {}
    for row, m in zip(tin + tout, list(ctx.inputs) + list(ctx.outputs)):
        for t, s in zip(row, m.shape):
            size[t] = max(size.get(t, 1), s)
    return 2.0 * math.prod(size.values())


def _run(d: Dims, ctx: RuleContext, extra_flops: float = 0.0) -> list[Signature]:
    try:
        return d.signatures(ctx.inputs, ctx.outputs, ctx.world, contraction_flops(d, ctx) + extra_flops)
    except SpecError as e:
        raise Unsupported(str(e)) from None


@register(F.linear, name="linear")
def _linear(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "weight", "bias"], {"bias": None}, where="linear")
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, ["input", "weight", "bias"])]
    role = {"input": "...k", "weight": "nk", "bias": "n"}
    spec = ", ".join(role[n] for n in slots) + " -> ...n"
    if ctx.inputs[slots.index("weight")].shape.__len__() != 2:
        raise Unsupported("linear with a weight that is not 2-D")
    if "bias" in slots:
        x, w, bi = slots.index("input"), slots.index("weight"), slots.index("bias")
        d = dims(spec, linear=[(x, bi), (w, bi)], additive=[bi])
    else:
        d = dims(spec, linear=[(slots.index("input"),), (slots.index("weight"),)])
    extra = math.prod(ctx.outputs[0].shape) if b["bias"] is not None else 0
    return _run(d, ctx, extra)


def _matmul_spec(a_nd: int, b_nd: int) -> str:
    if a_nd == 0 or b_nd == 0:
        raise Unsupported("matmul of a 0-d tensor")
    a = "...mk" if a_nd >= 2 else "k"
    bb = "...kn" if b_nd >= 2 else "k"
    out = "..." + ("m" if a_nd >= 2 else "") + ("n" if b_nd >= 2 else "")
    if a_nd < 2 and b_nd < 2:
        out = ""
    return f"{a}, {bb} -> {out}"


@register(torch.matmul, operator.matmul, torch.mm, "matmul", "mm", "__matmul__", name="matmul")
def _matmul(ctx: RuleContext) -> list[Signature]:
    if len(ctx.inputs) != 2:
        raise Unsupported("matmul needs two tensors")
    spec = _matmul_spec(len(ctx.inputs[0].shape), len(ctx.inputs[1].shape))
    return _run(dims(spec, linear=[(0,), (1,)]), ctx)


@register(torch.bmm, "bmm", name="bmm")
def _bmm(ctx: RuleContext) -> list[Signature]:
    return _run(dims("bmk, bkn -> bmn", linear=[(0,), (1,)]), ctx)


def _addmm_like(ctx: RuleContext, core: str, names: list[str]) -> list[Signature]:
    """``beta * input + alpha * (mat1 @ mat2)``: ``input`` broadcasts to the output and is additive."""
    extra = ["beta", "alpha"]
    bind(ctx.args, ctx.kwargs, names + extra, {"beta": 1, "alpha": 1}, where=str(ctx.target))
    slots = [n for n, _ in tensor_slots(ctx.args, ctx.kwargs, names + extra)]
    if sorted(slots) != sorted(names):
        raise Unsupported(f"{ctx.target}: expected tensors {names}")
    a_spec, b_spec, out = core.replace(" ", "").replace("->", ",").split(",")
    c, m1, m2 = (slots.index(n) for n in names)
    nd = len(ctx.inputs[c].shape)
    if nd > len(out):
        raise Unsupported(f"{ctx.target}: input has more dims than the output")
    role = {names[0]: out[len(out) - nd :], names[1]: a_spec, names[2]: b_spec}
    spec = ", ".join(role[n] for n in slots) + " -> " + out
    return _run(dims(spec, linear=[(c, m1), (c, m2)], additive=[c]), ctx, math.prod(ctx.outputs[0].shape))


@register(torch.baddbmm, "baddbmm", name="baddbmm")
def _baddbmm(ctx: RuleContext) -> list[Signature]:
    return _addmm_like(ctx, "bmk, bkn -> bmn", ["input", "batch1", "batch2"])


@register(torch.addmm, "addmm", name="addmm")
def _addmm(ctx: RuleContext) -> list[Signature]:
    return _addmm_like(ctx, "mk, kn -> mn", ["input", "mat1", "mat2"])


def einsum_signatures(equation: str, ctx: RuleContext) -> list[Signature]:
    eq = equation.replace(" ", "")
    if "->" not in eq:  # implicit output: letters seen once, alphabetical, after the ellipsis
        lhs = eq
        letters = [c for c in lhs if c.isalpha()]
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        eq = lhs + "->" + ("..." if "..." in lhs else "") + "".join(once)
    lhs, rhs = eq.split("->")
    if len(lhs.split(",")) != len(ctx.inputs):
        raise Unsupported(f"einsum {equation!r} names {len(lhs.split(','))} operands, got {len(ctx.inputs)}")
    # a letter repeated inside one operand (a diagonal) is never sharded
    rep = {c for op in lhs.split(",") for c in set(op) if c.isalpha() and op.count(c) > 1}
    d = dims(eq, fixed=rep, linear=[(i,) for i in range(len(ctx.inputs))])
    return _run(d, ctx)


def _einsum_equation(ctx: RuleContext) -> str:
    if not ctx.args or not isinstance(ctx.args[0], str):
        raise Unsupported("einsum in sublist form; only the equation-string form is supported")
    return ctx.args[0]


@register(torch.einsum, torch.functional.einsum, name="einsum")
def _einsum(ctx: RuleContext) -> list[Signature]:
    return einsum_signatures(_einsum_equation(ctx), ctx)
