"""Memory copies around form changes and gradient buckets (search/cost.py, "Memory copies around a
form change"; profile fields layout_bandwidth, grad_copy_overhead[_graph])."""

import dataclasses

import pytest
import torch

import hidup.profiler
from hidup.ir import FULL, GRAD_PACK_BYTES, REDUCE, REPLICATE, Graph, Node, Signature, Tensor, gather
from hidup.search.cost import CostModel
from hidup.search.problem import Problem

MEM, LAYOUT, OVERHEAD = 4e12, 2e12, 1e-6


def _profile(**changes):
    base = dict(memory_bandwidth=MEM, layout_bandwidth=LAYOUT, op_overhead=OVERHEAD, grad_copy_overhead=3e-6)
    base.update(changes)
    return dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), **base)


def _graph(shape=(8, 16, 32, 64), world=4, grad=True, dtype="float32"):
    """One activation ``a`` (from input ``x``) read by ``f``; every gather form is allowed."""
    forms = [FULL] + [gather(d) for d in range(len(shape))]
    x = Tensor(0, shape, dtype, "x")
    a = Tensor(1, shape, dtype, "e", requires_grad=grad)
    y = Tensor(2, shape, dtype, "f", requires_grad=grad)
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (f,)) for f in forms]),
        Node("e", "call", "exp", [0], [1], [Signature((f,), (f,), 1.0) for f in forms]),
        Node("f", "call", "neg", [1], [2], [Signature((f,), (f,), 1.0) for f in forms]),
    ]
    return Graph(nodes, {0: x, 1: a, 2: y}, world)


def _copy(nbytes, rate, passes=2.0):
    return OVERHEAD + passes * nbytes / rate


def test_all_to_all_copies_depend_on_which_dims_move():
    g = _graph()
    cm = CostModel(g, _profile())
    nb = 8 * 16 * 32 * 64 * 4
    part = nb / 4
    # gather_1 -> gather_0: no dim to move to the front; the received parts are concatenated on dim 1
    c = cm.conversion(1, gather(1), gather(0))
    assert c.fwd_copies == pytest.approx(_copy(part, MEM))
    # backward runs gather_0 -> gather_1: dim 1 moves to the front, and the parts are strided
    assert c.bwd_copies == pytest.approx(2 * _copy(part, LAYOUT))
    assert c.fwd == pytest.approx(cm.comm("all_to_all", nb) + c.fwd_copies)
    assert c.bwd == pytest.approx(cm.comm("all_to_all", nb) + c.bwd_copies)


def test_leading_dims_of_size_one_move_nothing():
    g = _graph(shape=(1, 16, 32, 64))
    cm = CostModel(g, _profile())
    nb = 16 * 32 * 64 * 4
    # dim 1 after a dim of size 1: the all-gather needs no layout copy
    assert cm.conversion(1, gather(1), FULL).fwd_copies == 0.0
    g2 = _graph(shape=(8, 16, 32, 64))
    cm2 = CostModel(g2, _profile())
    ag = cm2.conversion(1, gather(1), FULL)
    nb2 = 8 * nb
    assert ag.fwd_copies == pytest.approx(_copy(nb2 / 4, LAYOUT) + _copy(nb2, LAYOUT))  # to the front and back
    assert ag.bwd_copies == pytest.approx(_copy(nb2, LAYOUT) + _copy(nb2 / 4, LAYOUT))  # the reduce-scatter's
    # on dim 0 the collectives work in place
    assert cm2.conversion(1, gather(0), FULL).fwd_copies == cm2.conversion(1, gather(0), FULL).bwd_copies == 0.0


def test_slice_zero_pad_all_reduce_and_keep_rank0_copies():
    g = _graph()
    cm = CostModel(g, _profile())
    nb = 8 * 16 * 32 * 64 * 4
    s0 = cm.conversion(1, FULL, gather(0))  # slice of dim 0 is a view; its adjoint zero-pads
    assert s0.fwd_copies == 0.0
    assert s0.bwd_copies == pytest.approx(_copy(nb, MEM, 1.0) + _copy(nb / 4, MEM))
    s2 = cm.conversion(1, FULL, gather(2))  # a strided slice is a copy
    assert s2.fwd_copies == pytest.approx(_copy(nb / 4, LAYOUT))
    ar = cm.conversion(1, REDUCE, FULL)  # the sum lands in a new buffer, both ways
    assert ar.fwd_copies == ar.bwd_copies == pytest.approx(_copy(nb, MEM))
    k = cm.conversion(1, FULL, REDUCE)  # keep_rank0: the other ranks hold zeros; its adjoint is the same mask
    assert k.fwd_copies == k.bwd_copies == pytest.approx(_copy(nb, MEM, 1.0))
    assert cm.conversion(1, FULL, FULL).fwd_copies == 0.0


def test_without_gradient_no_backward_copies_and_copies_halve_per_duplicated_copy():
    g = _graph(grad=False)
    cm = CostModel(g, _profile())
    c = cm.conversion(1, gather(1), gather(0))
    assert c.bwd_copies == 0.0 and c.bwd == 0.0
    g2 = _graph()
    c2 = CostModel(g2, _profile()).conversion(1, gather(1), gather(0))  # batch-dependent: half the bytes each
    nb = 8 * 16 * 32 * 64 * 4
    assert c2.fwd_copies_a == c2.fwd_copies_b == pytest.approx(_copy(nb / 8, MEM))
    assert c2.bwd_copies_a == c2.bwd_copies_b == pytest.approx(2 * _copy(nb / 8, LAYOUT))


def test_layout_rate_falls_back_to_the_memory_bandwidth():
    g = _graph()
    nb = 8 * 16 * 32 * 64 * 4
    measured = CostModel(g, _profile()).conversion(1, gather(0), gather(1))
    fallback = CostModel(g, _profile(layout_bandwidth=0.0)).conversion(1, gather(0), gather(1))
    assert fallback.fwd_copies == pytest.approx(2 * _copy(nb / 4, MEM))
    assert fallback.fwd_copies < measured.fwd_copies
    free = CostModel(g, _profile(memory_bandwidth=0.0, layout_bandwidth=0.0, op_overhead=0.0))
    assert free.conversion(1, gather(0), gather(1)).fwd_copies == 0.0


def _param_graph(n=1 << 18, world=4):
    w = Tensor(0, (n,), "float32", "w", requires_grad=True, is_param=True)
    y = Tensor(1, (n,), "float32", "f", requires_grad=True)
    nodes = [
        Node("w", "param", "parameter", [], [0], [Signature((), (REPLICATE,), 0, "param")]),
        Node("f", "call", "neg", [0], [1], [Signature((FULL,), (FULL,), n)]),
    ]
    return Graph(nodes, {0: w, 1: y}, world)


def test_gradient_bucket_copies_run_on_the_compute_stream():
    n = GRAD_PACK_BYTES // 4 - 1  # just below the size summed in place: packed into the bucket's buffer
    g = _param_graph(n)
    prof = _profile()
    cm = CostModel(g, prof)
    c = cm.conversion(0, REPLICATE, FULL)
    nb = n * 4
    assert c.bwd_copies == pytest.approx(3e-6 + 2 * nb / MEM)  # packed into the bucket; the sum stays there (a view)
    assert c.bwd == pytest.approx(cm.grad_sync(nb) + c.bwd_copies)
    assert (c.bwd_copies_a, c.bwd_copies_b) == (c.bwd_copies, 0.0)  # once per step, after both copies
    # the problem counts them as backward compute, not as the asynchronous all-reduce
    p = Problem(g, prof)
    i = p.pos_of["f"]
    step, _ = _walk(p, i)
    assert step.bwd_async == pytest.approx(cm.grad_sync(nb))
    assert step.bwd_compute == pytest.approx(p.compute[i][0][1] + c.bwd_copies)
    assert step.compute == pytest.approx(sum(p.compute[i][0]) + c.bwd_copies)
    # a gradient of GRAD_PACK_BYTES or more is summed where it lies: no copy on the compute stream
    big = CostModel(_param_graph(GRAD_PACK_BYTES // 4), prof).conversion(0, REPLICATE, FULL)
    assert big.bwd_copies == 0.0 and big.bwd == pytest.approx(cm.grad_sync(GRAD_PACK_BYTES))
    # unmeasured: two op overheads per parameter; in a CUDA graph the graph figure
    assert CostModel(g, _profile(grad_copy_overhead=0.0)).grad_copies(0.0) == pytest.approx(2 * OVERHEAD)
    graphed = _profile(grad_copy_overhead_graph=5e-7, op_overhead_graph=2e-7).launched(True)
    assert graphed.grad_copy_fixed() == 5e-7 and graphed.op_overhead == 2e-7
    assert _profile(grad_copy_overhead_graph=5e-7).launched(False).grad_copy_fixed() == 3e-6


def _walk(p, i):
    """The steps of positions 0..i, each with its first signature; returns position i's."""
    key = p.initial_key()
    for j in range(i + 1):
        step, key = p.step(j, 0, key)
    return step, key


def test_new_profile_fields_round_trip_validate_and_perturb_last(tmp_path):
    p = _profile(grad_copy_overhead_graph=7e-7)
    q = hidup.profiler.load(hidup.profiler.save(p, tmp_path / "p.json"))
    assert (q.layout_bandwidth, q.grad_copy_overhead, q.grad_copy_overhead_graph) == (LAYOUT, 3e-6, 7e-7)
    d = p.to_dict()
    d["layout_bandwidth"] = -1.0
    with pytest.raises(hidup.profiler.ProfileError, match="layout_bandwidth"):
        hidup.profiler.profile.Profile.from_dict(d)
    # the new fields are drawn after every older one: a seed perturbs the rest as before
    old = dataclasses.replace(p, layout_bandwidth=0.0, grad_copy_overhead=0.0, grad_copy_overhead_graph=0.0)
    a, b = p.perturb(0.3, seed=5), old.perturb(0.3, seed=5)
    assert a.flops == b.flops and a.memory_bandwidth == b.memory_bandwidth
    assert a.op_overhead_graph == b.op_overhead_graph
    assert a.layout_bandwidth != LAYOUT and 0.7 * LAYOUT <= a.layout_bandwidth <= 1.3 * LAYOUT


def test_device_measures_layout_bandwidth_and_bucket_copy_cost():
    from hidup.profiler.measure.device import grad_copy_overhead, layout_bandwidth, transpose_bandwidth

    assert layout_bandwidth("cpu", 1 << 20, budget_s=0.02) > 0
    assert transpose_bandwidth("cpu", 1 << 20, budget_s=0.02) > 0
    per_param = grad_copy_overhead("cpu", params=16, budget_s=0.02)
    assert 0 < per_param < 1e-3
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            grad_copy_overhead("cpu", graphed=True)


def test_moving_the_innermost_dim_is_a_transpose_bound_by_elements():
    transpose = 1e12
    nb = 8 * 16 * 32 * 64 * 4
    cm = CostModel(_graph(), _profile(transpose_bandwidth=transpose))
    # gather_3 -> full: the innermost dim goes to the front and back, at the float32 transpose rate
    assert cm.conversion(1, gather(3), FULL).fwd_copies == pytest.approx(
        _copy(nb / 4, transpose) + _copy(nb, transpose)
    )
    # a middle dim keeps the innermost rows whole: the layout rate
    assert cm.conversion(1, gather(2), FULL).fwd_copies == pytest.approx(_copy(nb / 4, LAYOUT) + _copy(nb, LAYOUT))
    # bfloat16 elements: half the bytes in as long a time (the rate is per element)
    low = CostModel(_graph(dtype="bfloat16"), _profile(transpose_bandwidth=transpose))
    assert low.conversion(1, gather(3), FULL).fwd_copies == pytest.approx(
        _copy(nb / 8, transpose / 2) + _copy(nb / 2, transpose / 2)
    )
    # a duplicated copy's half moves half the elements at the same per-element rate
    c = CostModel(_graph(), _profile(transpose_bandwidth=transpose)).conversion(1, gather(3), FULL)
    assert c.fwd_copies_a == pytest.approx(_copy(nb / 8, transpose) + _copy(nb / 2, transpose))
    # not measured: the layout rate, as before
    plain = CostModel(_graph(), _profile()).conversion(1, gather(3), FULL)
    assert plain.fwd_copies == pytest.approx(_copy(nb / 4, LAYOUT) + _copy(nb, LAYOUT))
    p = _profile(transpose_bandwidth=transpose)
    assert hidup.profiler.Profile.from_dict(p.to_dict()).transpose_bandwidth == transpose
