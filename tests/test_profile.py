"""Profiles: builtins, interpolation, group-size scaling, validation, round trip, perturbation."""

import dataclasses
import json
import math

import pytest

import hidup.profiler as P
from hidup.ir import FULL, REPLICATE, Graph, Node, Signature, Tensor, gather
from hidup.profiler.profile import CommTable, ProfileError, op_key
from hidup.search.cost import CostModel

MB = 2**20


def test_builtins_load_with_metadata():
    assert set(P.builtin_names()) >= {"h200x4-nvlink", "h200x4-socket", "paper-v100-9.7gbps"}
    nv = P.load("h200x4-nvlink")
    assert nv.source == "builtin" and nv.gpu and nv.host and 4 in nv.world_sizes
    assert nv.rate("fp32") == 51e12 and nv.rate("tf32") == 407e12 and nv.rate("bf16") == 774e12
    assert nv.bandwidth("all_reduce", 4, 16 * MB) == pytest.approx(146e9)
    assert nv.bandwidth("all_gather", 4, 256 * MB) == pytest.approx(394e9)
    so = P.load("h200x4-socket")
    assert so.bandwidth("reduce_scatter", 4, 64 * MB) == pytest.approx(6.0e9)
    pv = P.load("paper-v100-9.7gbps")
    assert all(pv.rate(d) == 4.14e12 for d in P.DTYPES)
    for c, bw in {"all_gather": 1.22e9, "all_reduce": 0.61e9, "reduce_scatter": 1.13e9, "all_to_all": 10.7e9}.items():
        assert pv.bandwidth(c, 8, 1) == pytest.approx(bw) == pytest.approx(pv.bandwidth(c, 8, 1e10))


def test_log_linear_interpolation_and_clamping():
    t = CommTable(0.0, [1 * MB, 16 * MB], [10.0, 50.0])
    assert t.bandwidth(1 * MB) == 10.0 and t.bandwidth(16 * MB) == 50.0
    assert t.bandwidth(4 * MB) == pytest.approx(30.0)  # 4 MiB is halfway between 1 and 16 in log size
    assert t.bandwidth(2 * MB) == pytest.approx(20.0)
    assert t.bandwidth(1) == 10.0 and t.bandwidth(1e12) == 50.0  # clamped
    nv = P.load("h200x4-nvlink")
    mid = math.sqrt(16 * 64) * MB
    assert nv.bandwidth("all_to_all", 4, mid) == pytest.approx((197e9 + 319e9) / 2)


def test_comm_time_is_alpha_plus_bytes_over_bandwidth():
    nv = P.load("h200x4-nvlink")
    tab, _ = nv.table("all_reduce", 4)
    b = 16 * MB
    assert nv.comm_time("all_reduce", 4, b) == pytest.approx(tab.alpha + b / 146e9)
    assert nv.comm_time("all_reduce", 1, b) == 0.0
    assert nv.comm_time("all_reduce", 4, 0) == 0.0


def test_group_size_scaling_from_nearest_measured():
    nv = P.load("h200x4-nvlink")
    # measured 4; 2 and 8 are derived in the file by ring scaling
    assert nv.bandwidth("all_gather", 2, 16 * MB) == pytest.approx(196e9 * (3 / 4) / (1 / 2), rel=1e-6)
    assert nv.bandwidth("all_gather", 8, 16 * MB) == pytest.approx(196e9 * (3 / 4) / (7 / 8), rel=1e-6)
    # 16 is not in the file: nearest is 8, scaled by ring factor 8 -> 16
    bw8 = nv.bandwidth("all_reduce", 8, 64 * MB)
    assert nv.bandwidth("all_reduce", 16, 64 * MB) == pytest.approx(bw8 * (7 / 8) / (15 / 16))
    # 3 is equally far from 2 and 4: ties go to the larger measured size
    assert nv.bandwidth("all_to_all", 3, 64 * MB) == pytest.approx(319e9 * (3 / 4) / (2 / 3))


def test_save_load_round_trip(tmp_path):
    nv = P.load("h200x4-nvlink").with_ops({op_key("linear", [(8, 16), (32, 16)], "fp32"): (1e-5, 2e-5)})
    path = P.save(nv, tmp_path / "p.json")
    back = P.load(str(path))
    assert back.to_dict() == nv.to_dict()
    assert back.op_time("linear", [(8, 16), (32, 16)], "fp32") == (1e-5, 2e-5)


def test_load_unknown_name_lists_builtins():
    with pytest.raises(FileNotFoundError, match="h200x4-nvlink"):
        P.load("no-such-profile")


def _base() -> dict:
    return json.loads(json.dumps(P.load("paper-v100-9.7gbps").to_dict()))


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["flops"].pop("bf16"), "flops.bf16"),
        (lambda d: d["flops"].__setitem__("fp32", -1), "flops.fp32"),
        (lambda d: d["flops"].__setitem__("fp8", 1e12), "flops"),
        (lambda d: d["collectives"].pop("all_to_all"), "collectives.all_to_all"),
        (
            lambda d: d["collectives"]["all_reduce"]["8"].__setitem__("algbw", [0.0]),
            "collectives.all_reduce.8.algbw[0]",
        ),
        (lambda d: d["collectives"]["all_reduce"]["8"].__setitem__("alpha", -1e-6), "collectives.all_reduce.8.alpha"),
        (
            lambda d: d["collectives"]["all_gather"]["8"].update(sizes=[2.0, 1.0], algbw=[1.0, 1.0]),
            "collectives.all_gather.8.sizes",
        ),
        (
            lambda d: d["collectives"]["all_gather"]["8"].update(sizes=[1.0, 2.0], algbw=[1.0]),
            "collectives.all_gather.8.algbw",
        ),
        (
            lambda d: d["collectives"]["all_gather"].__setitem__("1", d["collectives"]["all_gather"]["8"]),
            "collectives.all_gather.1",
        ),
        (lambda d: d["collectives"].__setitem__("broadcast", {}), "collectives"),
        (lambda d: d.__setitem__("source", "guessed"), "source"),
        (lambda d: d.__setitem__("version", 99), "version"),
        (lambda d: d.__setitem__("name", ""), "name"),
        (lambda d: d.__setitem__("ops", {"k": {"forward": 1.0}}), "ops['k']"),
        (lambda d: d.__setitem__("world_sizes", [0]), "world_sizes"),
    ],
)
def test_validation_names_the_field(mutate, field):
    d = _base()
    mutate(d)
    with pytest.raises(ProfileError) as e:
        P.Profile.from_dict(d, where="test.json")
    assert f"field {field!r}" in str(e.value) and "test.json" in str(e.value)


def test_load_rejects_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        P.load(str(path))


def test_perturb_reproducible_and_bounded():
    base = P.load("h200x4-nvlink").with_ops({"k": (1.0, 2.0)})
    a = base.perturb(noise=0.2, seed=7)
    b = base.perturb(noise=0.2, seed=7)
    c = base.perturb(noise=0.2, seed=8)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict()["flops"] != c.to_dict()["flops"]
    assert a.source == "perturbed" and a.name != base.name
    for dt in P.DTYPES:
        assert 0.8 * base.rate(dt) <= a.rate(dt) <= 1.2 * base.rate(dt)
    fw, bw = a.ops["k"]
    assert 0.8 <= fw <= 1.2 and 1.6 <= bw <= 2.4
    factors = set()
    for coll in P.COLLECTIVES:
        for g, t in base.collectives[coll].items():
            for x, y in zip(t.algbw, a.collectives[coll][g].algbw):
                assert 0.8 * x <= y <= 1.2 * x
                factors.add(round(y / x, 12))
    assert len(factors) > 10  # independent factors, not one global scale
    same = base.perturb(noise=0.0, seed=3)
    assert same.flops == base.flops
    assert same.collectives["all_reduce"][4].algbw == base.collectives["all_reduce"][4].algbw


def test_perturb_comm_scale():
    base = P.load("h200x4-socket")
    slow = base.perturb(noise=0.0, seed=0, comm_scale=2.0)
    assert slow.bandwidth("all_gather", 4, 16 * MB) == pytest.approx(base.bandwidth("all_gather", 4, 16 * MB) / 2)
    assert slow.comm_time("all_gather", 4, 16 * MB) == pytest.approx(2 * base.comm_time("all_gather", 4, 16 * MB))
    with pytest.raises(ValueError, match="noise"):
        base.perturb(noise=1.5)
    with pytest.raises(ValueError, match="comm_scale"):
        base.perturb(noise=0.1, comm_scale=0)


def _one_linear_graph(dtype="float32"):
    tensors = {
        0: Tensor(0, (8, 16), dtype, "x"),
        1: Tensor(1, (32, 16), dtype, "w", True, True),
        2: Tensor(2, (8, 32), dtype, "lin", True),
    }
    sig_full = Signature((FULL, FULL), (FULL,), 2 * 8 * 16 * 32, "replicated")
    sig_data = Signature((gather(0), FULL), (gather(0),), 2 * 8 * 16 * 32 / 4, "data")
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (FULL,))]),
        Node("w", "param", "parameter", [], [1], [Signature((), (FULL,), 0, "param")]),
        Node("lin", "call", "linear", [0, 1], [2], [sig_full, sig_data], 2 * 8 * 16 * 32),
    ]
    return Graph(nodes, tensors, 4), sig_full, sig_data


def test_cost_model_uses_measured_op_times_then_flops():
    g, sig_full, sig_data = _one_linear_graph()
    # FLOP-only pricing (the roofline and per-op terms are tested in test_cost_roofline.py)
    prof = dataclasses.replace(P.load("h200x4-nvlink"), memory_bandwidth=0.0, op_overhead=0.0)
    cm = CostModel(g, prof)
    fwd, bwd = cm.compute(g.node("lin"), sig_full)
    assert fwd == pytest.approx(sig_full.flops / 51e12) and bwd == pytest.approx(2 * fwd)
    assert CostModel(g, prof, precision="tf32").compute(g.node("lin"), sig_full)[0] == pytest.approx(
        sig_full.flops / 407e12
    )
    measured = prof.with_ops({op_key("linear", [(2, 16), (32, 16)], "fp32"): (3e-6, 5e-6)})
    assert CostModel(g, measured).compute(g.node("lin"), sig_data) == (3e-6, 5e-6)
    # keys carry the precision: a tf32 search does not read an fp32 measurement
    assert CostModel(g, measured, precision="tf32").compute(g.node("lin"), sig_data)[0] == pytest.approx(
        sig_data.flops / 407e12
    )
    # not measured at the full shapes: falls back to FLOPs
    assert CostModel(g, measured).compute(g.node("lin"), sig_full)[0] == pytest.approx(sig_full.flops / 51e12)
    gb, sf, _ = _one_linear_graph("bfloat16")
    assert CostModel(gb, prof).compute(gb.node("lin"), sf)[0] == pytest.approx(sf.flops / 774e12)


def test_conversion_cost_uses_logical_bytes_and_backward_only_with_grad():
    g, _, _ = _one_linear_graph()
    prof = P.load("h200x4-socket")
    cm = CostModel(g, prof)
    c = cm.conversion(2, gather(0), FULL)  # all_gather forward, reduce_scatter backward (needs grad)
    nb = 8 * 32 * 4
    assert c.fwd == pytest.approx(prof.comm_time("all_gather", 4, nb))
    assert c.bwd == pytest.approx(prof.comm_time("reduce_scatter", 4, nb))
    assert c.fwd_comm_a == c.fwd_comm_b == pytest.approx(prof.comm_time("all_gather", 4, nb / 2))
    c0 = cm.conversion(0, gather(0), FULL)  # model input: no gradient, no backward collective
    assert c0.bwd == 0.0 and c0.fwd > 0
    w = cm.conversion(1, FULL, gather(0))  # slice / zero_pad: no collective
    assert w.fwd == 0.0  # a slice of the first dim is a view
    assert w.bwd == w.bwd_copies > 0.0  # zero_pad fills zeros and copies the slice in: memory copies only
    assert cm.conversion(1, FULL, REPLICATE) is None  # only a parameter produces 'replicate'


def test_launched_picks_the_graph_overhead():
    from hidup.profiler import load
    from hidup.profiler.profile import Profile

    prof = load("h200x4-nvlink")
    assert 0 < prof.op_overhead_graph < prof.op_overhead
    assert prof.launched(False) is prof
    graphed = prof.launched(True)
    assert graphed.op_overhead == prof.op_overhead_graph and prof.op_overhead > graphed.op_overhead
    again = Profile.from_dict(prof.to_dict())
    assert again.op_overhead_graph == prof.op_overhead_graph
    unmeasured = Profile.from_dict({k: v for k, v in prof.to_dict().items() if k != "op_overhead_graph"})
    assert unmeasured.op_overhead_graph == 0.0 and unmeasured.launched(True).op_overhead == prof.op_overhead
    noisy = prof.perturb(0.5, seed=1)
    assert noisy.op_overhead_graph != prof.op_overhead_graph and noisy.op_overhead_graph > 0


def test_search_prices_graph_or_eager_dispatch():
    import hidup.models
    from hidup.frontend.trace import trace
    from hidup.search import search

    model, inputs = hidup.models.build(
        "gpt",
        world_size=4,
        layers=2,
        d_model=64,
        heads=4,
        ffn=128,
        batch_per_gpu=2,
        seq_len=16,
        vocab=128,
        device="meta",
    )
    graph = trace(model, inputs, world_size=4)
    graphed = search(graph, "h200x4-nvlink", cuda_graphs=True)
    eager = search(graph, "h200x4-nvlink", cuda_graphs=False)
    assert graphed.options["cuda_graphs"] is True and eager.options["cuda_graphs"] is False
    # the fixed cost per op is ~10x smaller in a graph, so the graphed plan is predicted faster
    assert graphed.predicted["total"] < eager.predicted["total"]
