"""Simulated-SPMD tests of factories, custom ops declared sharded along the batch and the notation engine.

The property-test helpers (hypothesis settings, random tensors, shape strategies) are those of
``tests/test_rules.py``; ``tests/spmd.py`` runs each signature per rank and rebuilds the result.
"""

from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from hidup import rules
from hidup.ir import FULL
from spmd import check_op, has_sig, make_context
from test_rules import EVEN, FAST, SIZES, rn


def test_factories_and_like():
    for fn, args in [(torch.arange, (8,)), (torch.zeros, (4, 2)), (torch.ones, (2,)), (torch.full, ((2, 2), 3.0))]:
        ctx, _, _ = make_context(fn, args, {}, 2)
        assert [str(s) for s in rules.signatures(ctx)] == ["() -> (full)"]
    x = rn(4, 2)
    for fn in (torch.zeros_like, torch.ones_like):
        assert has_sig(check_op(fn, (x,))[2], ["gather_0"], ["gather_0"])
    check_op(torch.full_like, (x, 2.0))
    res = check_op("new_zeros", (x, (8, 4)))
    assert has_sig(res[2], ["full"], ["gather_1"]) and has_sig(res[2], ["gather_0"], ["full"])
    check_op("new_ones", (x, 4, 2))
    check_op("new_full", (x, (4, 4), 1.5))


@torch.library.custom_op("hidup_test::top1_gating", mutates_args=())
def top1_gating(
    logits: torch.Tensor, shift: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group top-1 routing with capacity of ``logits + shift`` (``shift[E]`` shared by every group):
    (combine[G,S,E,C], dispatch[G,S,E,C], aux[G])."""
    return _top1(logits, shift, capacity)


def _top1(logits, shift, capacity):
    G, S, E = logits.shape
    probs = torch.softmax(logits + shift, -1)
    mask = F.one_hot(probs.argmax(-1), E).to(logits.dtype)  # [G,S,E]
    pos = torch.cumsum(mask, 1) - 1  # slot of each token in its expert, per group
    keep = mask * (pos < capacity).to(logits.dtype)
    slot = F.one_hot(pos.clamp(0, capacity - 1).long(), capacity).to(logits.dtype)  # [G,S,E,C]
    dispatch = keep.unsqueeze(-1) * slot
    combine = dispatch * probs.unsqueeze(-1)
    aux = (mask.mean(1) * probs.mean(1)).sum(-1) * E
    return combine, dispatch, aux


@top1_gating.register_fake
def _(logits, shift, capacity):
    G, S, E = logits.shape
    return logits.new_empty(G, S, E, capacity), logits.new_empty(G, S, E, capacity), logits.new_empty(G)


def _top1_backward(ctx, g_combine, g_dispatch, g_aux):
    logits, shift = ctx.saved_tensors
    with torch.enable_grad():
        x, s = logits.detach().requires_grad_(True), shift.detach().requires_grad_(True)
        c, _, a = _top1(x, s, ctx.capacity)
        gx, gs = torch.autograd.grad([c, a], [x, s], [g_combine, g_aux])
    return gx, gs, None


def _top1_context(ctx, inputs, output):
    logits, shift, ctx.capacity = inputs
    ctx.save_for_backward(logits, shift)


top1_gating.register_autograd(_top1_backward, setup_context=_top1_context)
rules.declare_batch_op(top1_gating, ([0, None], [0, 0, 0]))


@FAST
@given(g=EVEN, s=SIZES, e=SIZES, cap=st.sampled_from([1, 2]))
def test_declared_batch_op(g, s, e, cap):
    """A custom op declared with a batch dim per input (None: the shared ``shift`` stays full)."""
    op = torch.ops.hidup_test.top1_gating.default
    assert rules.find_rule(op) is not None
    res = check_op(op, (rn(g, s, e), rn(e), cap))
    for sigs in res.values():
        assert has_sig(sigs, ["gather_0", "full"], ["gather_0"] * 3, kind="data")


@FAST
@given(g=EVEN, s=SIZES, e=st.integers(2, 5), k=st.sampled_from([1, 2]), cap=st.sampled_from([1, 2, 3]))
def test_moe_gating_op(g, s, e, k, cap):
    """``hidup::moe_gating`` sharded along its groups, forward and backward (its own autograd).  The op
    routes in float32 whatever the logits' dtype, so it is checked on float32 logits, at float32's
    tolerance (the all-full signature sums random partial output gradients)."""
    import hidup.models  # noqa: F401  (registers the op and its rule)

    res = check_op(torch.ops.hidup.moe_gating.default, (rn(g, s, e).float(), k, cap, k > 1))
    for sigs in res.values():
        assert has_sig(sigs, ["gather_0"], ["gather_0"] * 3, kind="data")


def test_declare_batch_op_rejects_plain_functions():
    with pytest.raises(TypeError, match="custom op"):
        rules.declare_batch_op(_top1)


# --------------------------------------------------------------------------------------------- API contract


def test_non_divisible_never_offered_and_unknown_ops():
    for N in (2, 4):
        ctx, _, _ = make_context(F.linear, (rn(3, 5), rn(7, 5, param=True)), {}, N)
        sigs = rules.signatures(ctx)
        assert all(not f.is_gather for s in sigs for f in s.inputs + s.outputs)
        assert sigs[0].kind == "replicated" and all(f == FULL for f in sigs[0].inputs + sigs[0].outputs)
    ctx, _, _ = make_context(torch.fft.fft, (rn(4),), {}, 2)
    assert rules.find_rule(torch.fft.fft) is None and rules.signatures(ctx) is None
    ctx, _, _ = make_context(torch.einsum, ("ij,jk->ik", [rn(2, 2), rn(2, 2)]), {}, 2)
    assert rules.signatures(ctx) is not None
    ctx, _, _ = make_context("view", (rn(4, 2), torch.float64), {}, 2)  # view(dtype): no rule for it
    assert rules.signatures(ctx) is None


def test_flops_split_per_rank():
    ctx, _, _ = make_context(F.linear, (rn(4, 8), rn(6, 8, param=True)), {}, 2)
    sigs = rules.signatures(ctx)
    assert sigs[0].flops == 2 * 4 * 6 * 8
    assert all(s.flops == sigs[0].flops / 2 for s in sigs if any(f.is_gather for f in s.inputs + s.outputs))
    ctx, _, _ = make_context(F.scaled_dot_product_attention, (rn(2, 2, 4, 8),) * 3, {}, 2)
    assert rules.signatures(ctx)[0].flops == 4 * 2 * 2 * 4 * 4 * 8


def test_local_calls_run_in_fx_graph():
    """Local calls are plain callables + args: code generation can put them into an fx graph."""
    cases = [
        ("view", (rn(4, 6), 4, 2, 3), {}),
        (torch.mean, (rn(4, 6), 1), {}),
        (F.embedding, (torch.randint(0, 8, (4,)), rn(8, 2, param=True)), {}),
        (operator.getitem, (rn(4, 6), (slice(0, 4), 1)), {}),
        ("new_zeros", (rn(4, 6), (4, 6)), {}),
    ]
    for target, args, kwargs in cases:
        ctx, values, _ = make_context(target, args, kwargs, 2)
        for sig in rules.signatures(ctx):
            call = rules.localize(ctx, sig, 1)
            g = torch.fx.Graph()
            holders = {}

            def node_for(v, g=g, holders=holders):
                if isinstance(v, rules.TensorMeta):
                    holders.setdefault(len(holders), None)
                    return g.placeholder(f"t{len(holders) - 1}")
                return v

            a, k = torch.fx.node.map_aggregate((call.args, call.kwargs), node_for)
            g.output(g.call_function(call.target, tuple(a), dict(k)))
            gm = torch.fx.GraphModule(nn.Module(), g)
            local = [torch.chunk(v, 2, f.dim)[1] if f.is_gather else v for v, f in zip(values, sig.inputs)]
            if all(f.kind != "reduce" for f in sig.inputs):
                out = gm(*local)
                assert tuple(out.shape) == sig.outputs[0].local_shape(ctx.outputs[0].shape, 2)


def test_reduce_never_on_bool():
    ctx, _, _ = make_context(operator.and_, (torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)), {}, 2)
    assert not any(str(f) == "reduce" for s in rules.signatures(ctx) for f in s.inputs + s.outputs)


def test_notation_engine():
    from hidup.rules.base import TensorMeta as M

    x, w, b, out = (
        M((4, 6, 8), "float32"),
        M((12, 8), "float32", True, True),
        M((12,), "float32", True, True),
        M((4, 6, 12), "float32"),
    )
    d = rules.dims("...k, nk!, n -> ...n", additive=[2])
    assert d.fixed == {"k"}
    sigs = d.signatures([x, w, b], [out], 2, 100.0)
    assert [str(s) for s in sigs] == [
        "(full, full, full) -> (full)",
        "(gather_0, full, full) -> (gather_0)",
        "(gather_1, full, full) -> (gather_1)",
        "(full, gather_0, gather_0) -> (gather_2)",
    ]
    assert [s.flops for s in sigs] == [100.0, 50.0, 50.0, 50.0]
    assert [s.kind for s in sigs] == ["replicated", "data", "data", "tensor"]
    # broadcasting: a size-1 dim stays full; a contracted letter with an additive operand makes it reduce
    sigs = rules.dims("...k, nk, n -> ...n", additive=[2]).signatures(
        [M((1, 6, 8), "float32"), w, b], [M((1, 6, 12), "float32")], 2, 1.0
    )
    assert "(gather_2, gather_1, reduce) -> (reduce)" in [str(s) for s in sigs]
    assert not any(str(s.inputs[0]) == "gather_0" for s in sigs)
    with pytest.raises(rules.SpecError):
        rules.dims("ab, b -> a").signatures([M((4, 2), "f"), M((3,), "f")], [M((4,), "f")], 2, 1.0)
