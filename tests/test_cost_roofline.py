"""The cost model's roofline and fixed per-op cost (profile fields memory_bandwidth, op_overhead)."""

import dataclasses

import pytest

import hidup.profiler
from hidup.ir import FULL, REPLICATE, Graph, Node, Signature, Tensor, gather
from hidup.search.cost import CostModel


def _graph(world=4):
    x = Tensor(0, (64, 1024), "float32", "x")
    y = Tensor(1, (64, 1024), "float32", "gelu", requires_grad=True)
    flops = 64 * 1024
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (FULL,)), Signature((), (gather(0),))]),
        Node(
            "gelu",
            "call",
            "gelu",
            [0],
            [1],
            [Signature((FULL,), (FULL,), flops), Signature((gather(0),), (gather(0),), flops / world, "data")],
        ),
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


def test_concurrent_copies_divide_per_copy_collectives():
    """Duplicated copies communicate on two communicators: per-copy collectives are divided by the
    measured pair speedup; the no-duplication costs and the once-per-step gradient all-reduce not."""
    from hidup.ir import REPLICATE

    g = _graph()
    base = _profile(concurrency={})
    fast = _profile(concurrency={c: {4: ([1e3, 1e9], [1.6, 1.6])} for c in hidup.profiler.COLLECTIVES})
    plain, paired = CostModel(g, base), CostModel(g, fast)
    for src, dst in ((FULL, gather(0)), (gather(0), FULL)):  # batch tensor 0: both copies move half
        a, b = plain.conversion(0, src, dst), paired.conversion(0, src, dst)
        assert (b.fwd, b.bwd) == (a.fwd, a.bwd)
        assert b.fwd_comm_a == pytest.approx(a.fwd_comm_a / 1.6) and b.fwd_comm_b == pytest.approx(a.fwd_comm_b / 1.6)
    w = Tensor(2, (1024, 1024), "float32", "w", requires_grad=True)
    g2 = Graph(g.nodes, {**g.tensors, 2: w}, 4)
    plain, paired = CostModel(g2, base), CostModel(g2, fast)
    a, b = plain.conversion(2, REPLICATE, FULL), paired.conversion(2, REPLICATE, FULL)
    # the gradient all-reduce runs once, alone
    assert (b.bwd_comm_a, b.bwd_comm_b) == (a.bwd_comm_a, a.bwd_comm_b) and b.bwd_comm_a > 0
    a, b = plain.conversion(2, gather(0), FULL), paired.conversion(2, gather(0), FULL)
    assert b.fwd_comm_a == pytest.approx(a.fwd_comm_a / 1.6) and b.bwd_comm_b == pytest.approx(a.bwd_comm_b / 1.6)
    assert fast.pair_speedup("all_reduce", 4, 1e6) == 1.6 and base.pair_speedup("all_reduce", 4, 1e6) == 1.0
    assert _profile(concurrency={"all_gather": {4: ([1e3], [3.0])}}).pair_speedup("all_gather", 4, 1e4) == 2.0


def _params_graph(sizes, world=4):
    """Parameters of ``sizes`` float32 elements, each used whole (``replicate -> full``) by one op."""
    nodes, tensors = [], {}
    for i, n in enumerate(sizes):
        w, y = 2 * i, 2 * i + 1
        tensors[w] = Tensor(w, (n,), "float32", f"p{i}", requires_grad=True, is_param=True)
        tensors[y] = Tensor(y, (n,), "float32", f"f{i}", requires_grad=True)
        nodes.append(Node(f"p{i}", "param", "parameter", [], [w], [Signature((), (REPLICATE,), 0, "param")]))
        nodes.append(Node(f"f{i}", "call", "neg", [w], [y], [Signature((FULL,), (FULL,), n)]))
    return Graph(nodes, tensors, world)


def test_gradient_all_reduce_is_priced_by_the_runtimes_buckets():
    mb = 2**20
    sizes = [mb // 4, mb // 2, 3 * mb]  # 1 MiB, 2 MiB, 12 MiB of float32 gradients
    g = _params_graph(sizes)
    cm = CostModel(g, _profile(), bucket_mb=4.0)
    assert cm.bucket_bytes == 4 * mb
    costs = [cm.conversion(2 * i, REPLICATE, FULL) for i in range(len(sizes))]
    assert all(c.grad_sync and c.fwd == 0.0 for c in costs)
    comm = [c.bwd - c.bwd_copies for c in costs]  # the all-reduce; lb packs the gradient and copies the sum back
    bucket = cm.comm("all_reduce", 4 * mb)
    # a parameter smaller than a bucket pays its share of one bucket: one alpha per bucket, not per parameter
    assert comm[0] == pytest.approx(bucket / 4) and comm[1] == pytest.approx(bucket / 2)
    assert comm[0] < cm.comm("all_reduce", mb)
    # one larger than a bucket is a bucket of its own
    assert comm[2] == pytest.approx(cm.comm("all_reduce", 12 * mb))
    # with duplication, the sync and its copies run once per step, after both copies
    assert (costs[0].bwd_comm_a, costs[0].bwd_comm_b) == (comm[0], 0.0)
    assert (costs[0].bwd_copies_a, costs[0].bwd_copies_b) == (costs[0].bwd_copies, 0.0)
    # four such 1 MiB parameters cost exactly one full bucket
    assert 4 * comm[0] == pytest.approx(bucket)


def test_gradient_bucket_is_capped_by_the_trainable_bytes():
    mb = 2**20
    g = _params_graph([mb // 4, mb // 4])  # 2 MiB of gradients in all: one message of 2 MiB
    cm = CostModel(g, _profile())  # the runtime's default bucket (25 MB) is larger
    assert cm.bucket_bytes == 2 * mb
    both = sum(c.bwd - c.bwd_copies for c in (cm.conversion(2 * i, REPLICATE, FULL) for i in range(2)))
    assert both == pytest.approx(cm.comm("all_reduce", 2 * mb))
    with pytest.raises(ValueError, match="bucket_mb"):
        CostModel(g, _profile(), bucket_mb=0)
