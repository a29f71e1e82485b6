"""The cost model's roofline and fixed per-op cost (profile fields memory_bandwidth, op_overhead)."""

import dataclasses

import pytest

import hidup.profiler
from hidup.ir import FULL, Graph, Node, Signature, Tensor, gather
from hidup.search.cost import CostModel


def _graph(world=4):
    x = Tensor(0, (64, 1024), "float32", "x")
    y = Tensor(1, (64, 1024), "float32", "gelu", requires_grad=True)
    flops = 64 * 1024
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (FULL,)), Signature((), (gather(0),))]),
        Node("gelu", "call", "gelu", [0], [1], [Signature((FULL,), (FULL,), flops),
                                               Signature((gather(0),), (gather(0),), flops / world, "data")]),
    ]
    return Graph(nodes, {0: x, 1: y}, world)


def _profile(**changes):
    return dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), **changes)


def test_flops_only_profile_prices_elementwise_by_flops():
    g = _graph()
    cm = CostModel(g, _profile(memory_bandwidth=0.0, op_overhead=0.0))
    full, shard = (cm.compute(g.node("gelu"), s)[0] for s in g.node("gelu").signatures)
    assert full == pytest.approx(64 * 1024 / cm.profile.rate("fp32"))
    assert shard == pytest.approx(full / 4)


def test_roofline_charges_bytes_moved():
    g = _graph()
    bw = 1e12
    cm = CostModel(g, _profile(memory_bandwidth=bw, op_overhead=0.0))
    full, shard = (cm.compute(g.node("gelu"), s)[0] for s in g.node("gelu").signatures)
    moved = 2 * 64 * 1024 * 4  # read x, write y
    assert full == pytest.approx(moved / bw)
    assert shard == pytest.approx(moved / 4 / bw)


def test_overhead_is_fixed_and_reported():
    g = _graph()
    cm = CostModel(g, _profile(memory_bandwidth=0.0, op_overhead=2e-5))
    fwd, bwd = cm.compute(g.node("gelu"), g.node("gelu").signatures[1])
    assert fwd == pytest.approx(2e-5 + 64 * 1024 / 4 / cm.profile.rate("fp32"))
    assert bwd == 0.0  # the input needs no gradient
    assert cm.fixed(g.node("gelu")) == (2e-5, 0.0)
    assert cm.fixed(g.node("x")) == (0.0, 0.0)


def test_profile_fields_round_trip_and_validate(tmp_path):
    p = _profile(memory_bandwidth=3e12, op_overhead=1e-5)
    path = hidup.profiler.save(p, tmp_path / "p.json")
    q = hidup.profiler.load(path)
    assert (q.memory_bandwidth, q.op_overhead) == (3e12, 1e-5)
    d = p.to_dict()
    d["op_overhead"] = -1
    with pytest.raises(hidup.profiler.ProfileError, match="op_overhead"):
        hidup.profiler.profile.Profile.from_dict(d)
