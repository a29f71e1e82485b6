"""A matmul priced by its shape and layout: the profile's GEMM grid (profiler/gemm.py), its measurement and the
cost model's use of it (search/cost.py, "Compute")."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

import hidup.profiler
from hidup.ir import FULL, Graph, Node, Signature, Tensor
from hidup.profiler.gemm import GemmGrid
from hidup.profiler.measure.device import gemm_grid, gemm_point_seconds
from hidup.profiler.profile import Profile
from hidup.search.cost import CostModel

SIZES = (128, 512, 2048)


def _grid(rate=lambda m, n, k: 1e12 * (m * n * k) ** 0.1):
    return GemmGrid(SIZES, tuple(rate(m, n, k) for m in SIZES for n in SIZES for k in SIZES))


def test_grid_is_exact_at_its_points_and_log_linear_between():
    grid = _grid()
    for m in SIZES:
        for n in SIZES:
            for k in SIZES:
                assert grid.rate(m, n, k) == pytest.approx(1e12 * (m * n * k) ** 0.1)
    # halfway in log between 128 and 512 on one dim: the geometric mean of the two rates
    r0, r1 = grid.rate(128, 512, 512), grid.rate(512, 512, 512)
    assert grid.rate(256, 512, 512) == pytest.approx(math.sqrt(r0 * r1))
    # a power law in the dims is reproduced exactly anywhere inside the grid (trilinear in logs)
    assert grid.rate(300, 1000, 1500) == pytest.approx(1e12 * (300 * 1000 * 1500) ** 0.1)
    # clamped outside: the nearest measured size's rate
    assert grid.rate(64, 50000, 2048) == pytest.approx(grid.rate(128, 2048, 2048))


def test_grid_round_trips_scales_and_rejects_bad_input():
    grid = _grid()
    assert GemmGrid.from_dict(json.loads(json.dumps(grid.to_dict()))) == grid
    assert grid.scaled(0.5).rate(300, 700, 900) == pytest.approx(0.5 * grid.rate(300, 700, 900))
    with pytest.raises(ValueError, match="needs 27 rates"):
        GemmGrid(SIZES, (1.0,) * 26)
    with pytest.raises(ValueError, match="increasing"):
        GemmGrid((512, 128, 2048), (1.0,) * 27)
    with pytest.raises(ValueError, match="positive"):
        GemmGrid(SIZES, (1.0,) * 26 + (0.0,))


def test_measured_points_take_precedence_and_travel_with_the_grid(tmp_path):
    grid = _grid().with_points([("nt", 4096, 768, 768, 1.5e11), ("tn", 300, 700, 900, 2e11)])
    assert grid.rate(4096, 768, 768, "nt") == 1.5e11
    assert grid.rate(4096, 768, 768, "nn") == _grid().rate(4096, 768, 768, "nn")  # a point is of its layout only
    assert grid.rate(4096, 768, 769, "nt") == _grid().rate(4096, 768, 769, "nt")  # and of its exact shape
    assert grid.with_points([("nt", 4096, 768, 768, 3e11)]).rate(4096, 768, 768) == 3e11  # a new one replaces it
    assert GemmGrid.from_dict(json.loads(json.dumps(grid.to_dict()))) == grid
    assert grid.scaled(0.5).rate(300, 700, 900, "tn") == pytest.approx(1e11)
    p = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), gemm={"tf32": grid})
    assert hidup.profiler.load(hidup.profiler.save(p, tmp_path / "p.json")).gemm["tf32"] == grid
    with pytest.raises(ValueError, match="GEMM point"):
        grid.with_points([("xx", 1, 2, 3, 1.0)])
    with pytest.raises(ValueError, match="positive and finite"):
        grid.with_points([("nt", 1, 2, 3, 0.0)])
    d = p.to_dict()
    d["gemm"]["tf32"]["points"] = [["nt", 1, 2]]
    with pytest.raises(hidup.profiler.ProfileError, match="gemm.tf32"):
        Profile.from_dict(d)


def test_gemm_point_measurement_on_the_cpu():
    seconds = gemm_point_seconds("cpu", "fp32", "tn", 64, 48, 32, budget_s=0.02)
    assert 0 < seconds < 1


@pytest.mark.parametrize("rate_key, itemsize", [("tf32", 4), ("bf16", 2)])
def test_compiled_gemm_with_a_misaligned_dim_costs_the_cheaper_of_as_is_and_padded(rate_key, itemsize):
    """A vocabulary of 30522 is not a multiple of 16 bytes: the compiled price is the GEMM as it is or the
    padded GEMM plus copying the padded operand, whichever is cheaper (search/cost.py, "Compiled programs")."""
    m, n, k = 4096, 30522, 768
    align = 16 // itemsize
    pn = -(-n // align) * align
    base = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), memory_bandwidth=4e12, op_overhead=1e-5)
    compiled = dataclasses.replace(base, compiled=True)
    g = _linear_graph()
    copy = 1e-5 + (n * k + pn * k) * itemsize / 4e12  # the weight [n, k] into [pn, k]
    for slow, padded_wins in ((1e13, True), (5e14, False)):  # the misaligned shape measured slow, or fast
        grid = _grid(lambda m_, n_, k_: 4e14).with_points([("nt", m, n, k, slow)])
        cm = CostModel(g, dataclasses.replace(compiled, gemm={"tf32": grid}), precision="tf32")
        as_is, padded = 2.0 * m * n * k / slow, 2.0 * m * pn * k / 4e14 + copy
        assert cm.gemm_seconds(grid, (m, n, k), "nt", rate_key) == pytest.approx(min(as_is, padded))
        assert (padded < as_is) == padded_wins
        eager = CostModel(g, dataclasses.replace(base, gemm={"tf32": grid}), precision="tf32")
        assert eager.gemm_seconds(grid, (m, n, k), "nt", rate_key) == pytest.approx(as_is)  # eager: as it is
    aligned = CostModel(g, dataclasses.replace(compiled, gemm={"tf32": grid}), precision="tf32")
    assert aligned.gemm_seconds(grid, (m, 30528, k), "nt", rate_key) == pytest.approx(2.0 * m * 30528 * k / 4e14)


def test_profile_keeps_the_grid_and_names_a_bad_one(tmp_path):
    p = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), gemm={"bf16": _grid()})
    q = hidup.profiler.load(hidup.profiler.save(p, tmp_path / "p.json"))
    assert q.gemm == p.gemm and q.gemm["bf16"].rate(128, 128, 128) == p.gemm["bf16"].rate(128, 128, 128)
    assert "tf32" not in q.gemm
    # a perturbed profile scales the grid by one draw per dtype
    noisy = p.perturb(0.2, seed=3)
    ratio = noisy.gemm["bf16"].rate(128, 128, 128) / p.gemm["bf16"].rate(128, 128, 128)
    assert 0.8 <= ratio <= 1.2
    assert noisy.gemm["bf16"].rate(2048, 512, 128) / p.gemm["bf16"].rate(2048, 512, 128) == pytest.approx(ratio)
    d = p.to_dict()
    d["gemm"]["bf16"]["rates"] = d["gemm"]["bf16"]["rates"][:-1]
    with pytest.raises(hidup.profiler.ProfileError, match="gemm.bf16"):
        Profile.from_dict(d)


def _linear_graph(m=4096, n=3072, k=768, x_grad=True):
    x = Tensor(0, (m, k), "float32", "x", requires_grad=x_grad)
    w = Tensor(1, (n, k), "float32", "w", requires_grad=True)
    y = Tensor(2, (m, n), "float32", "y", requires_grad=True)
    sig = Signature((FULL, FULL), (FULL,), 2.0 * m * n * k)
    nodes = [
        Node("x", "input", "input", [], [0], [Signature((), (FULL,))]),
        Node("w", "param", "w", [], [1], [Signature((), (FULL,))]),
        Node("lin", "call", "linear", [0, 1], [2], [sig]),
    ]
    return Graph(nodes, {0: x, 1: w, 2: y}, 1)


@pytest.mark.parametrize("x_grad", [True, False])
def test_linear_forward_and_both_gradients_are_priced_at_their_own_shapes(x_grad):
    m, n, k = 4096, 3072, 768
    g = _linear_graph(m, n, k, x_grad)
    grid = GemmGrid(SIZES, tuple(1e12 * m_ / 128 + 1e11 * n_ / 128 + 1e10 * k_ / 128 for m_ in SIZES for n_ in SIZES
                                 for k_ in SIZES))  # fmt: skip
    base = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), memory_bandwidth=0.0, op_overhead=1e-5)
    cm = CostModel(g, dataclasses.replace(base, gemm={"tf32": grid}), precision="tf32")
    node = g.node("lin")
    fwd, bwd = cm.device_compute(node, node.signatures[0])
    flops = 2.0 * m * n * k
    assert fwd == pytest.approx(1e-5 + flops / grid.rate(m, n, k))
    wgrad = 1e-5 + flops / grid.rate(n, k, m)
    dgrad = 1e-5 + flops / grid.rate(m, k, n)
    assert bwd == pytest.approx(wgrad + dgrad if x_grad else wgrad)
    # the grid's dtype only: under fp32 the square-matmul pricing applies as before
    fp32 = CostModel(g, dataclasses.replace(base, gemm={"tf32": grid}), precision="fp32")
    plain = CostModel(g, base, precision="fp32")
    assert fp32.device_compute(node, node.signatures[0]) == plain.device_compute(node, node.signatures[0])


def test_gemm_shape_reads_each_matmul_form():
    def node(target, n_inputs):
        return Node("n", "call", target, list(range(n_inputs)), [9], [])

    assert CostModel.gemm_shape(node("linear", 2), [(8, 16, 64), (32, 64)]) == ((128, 32, 64), (0, 1))
    assert CostModel.gemm_shape(node("mm", 2), [(128, 64), (64, 32)]) == ((128, 32, 64), (0, 1))
    assert CostModel.gemm_shape(node("addmm", 3), [(32,), (128, 64), (64, 32)]) == ((128, 32, 64), (1, 2))
    assert CostModel.gemm_shape(node("matmul", 2), [(4, 8, 64), (64, 32)]) == ((32, 32, 64), (0, 1))
    assert CostModel.gemm_shape(node("bmm", 2), [(4, 8, 64), (4, 64, 32)]) is None  # batched: by FLOPs
    assert CostModel.gemm_shape(node("matmul", 2), [(4, 8, 64), (4, 64, 32)]) is None
    assert CostModel.gemm_shape(node("linear", 2), [(8, 64), (32, 48)]) is None  # inconsistent inner dims


def _layout_grid():
    """nt at the power law of :func:`_grid`, nn 1.25x and tn 2x slower at every point."""
    nt = _grid()
    slower = {"nn": 1.25, "tn": 2.0}
    return GemmGrid(SIZES, nt.rates, tuple((name, tuple(r / f for r in nt.rates)) for name, f in slower.items()))


def test_grid_prices_each_layout_at_its_own_rates():
    grid = _layout_grid()
    for dims in ((128, 512, 2048), (300, 1000, 1500), (64, 50000, 4096)):
        assert grid.rate(*dims, "nn") == pytest.approx(grid.rate(*dims) / 1.25)
        assert grid.rate(*dims, "tn") == pytest.approx(grid.rate(*dims, "nt") / 2)
    assert GemmGrid.from_dict(json.loads(json.dumps(grid.to_dict()))) == grid
    assert grid.scaled(0.5).rate(300, 700, 900, "tn") == pytest.approx(0.5 * grid.rate(300, 700, 900, "tn"))
    # a grid measured in the nt layout only prices every layout at its nt rates
    assert _grid().rate(300, 700, 900, "tn") == _grid().rate(300, 700, 900)
    with pytest.raises(ValueError, match="layout must be one of"):
        grid.rate(128, 128, 128, "tt")
    with pytest.raises(ValueError, match="needs 27 rates \\(tn\\)"):
        GemmGrid(SIZES, grid.rates, (("tn", (1.0,) * 26),))
    with pytest.raises(ValueError, match="distinct ones of"):
        GemmGrid(SIZES, grid.rates, (("nt", grid.rates),))
    bad = grid.to_dict() | {"tn": ["x"]}
    with pytest.raises(ValueError, match="tn must be a list of numbers"):
        GemmGrid.from_dict(bad)


def _matmul_graph(target, w_producer="param", m=4096, n=3072, k=768):
    """``target`` of x[m, k] and a weight giving an [m, n] output: linear's weight [n, k]; mm/addmm's
    [k, n], a parameter or (``w_producer="t"``) the transpose of a parameter [n, k]."""
    x = Tensor(0, (m, k), "float32", "x", requires_grad=True)
    w_shape = (n, k) if target == "linear" or w_producer == "t" else (k, n)
    tensors = {0: x, 1: Tensor(1, w_shape, "float32", "w", requires_grad=True)}
    nodes = [Node("x", "input", "input", [], [0], [Signature((), (FULL,))]),
             Node("w", "param", "w", [], [1], [Signature((), (FULL,))])]  # fmt: skip
    w = 1
    if w_producer == "t":
        tensors[3] = Tensor(3, (k, n), "float32", "wt", requires_grad=True)
        nodes.append(Node("wt", "call", "t.default", [1], [3], [Signature((FULL,), (FULL,))]))
        w = 3
    tensors[2] = Tensor(2, (m, n), "float32", "y", requires_grad=True)
    if target == "addmm":
        tensors[4] = Tensor(4, (n,), "float32", "b", requires_grad=False)
        nodes.append(Node("b", "input", "input", [], [4], [Signature((), (FULL,))]))
        inputs, in_forms = [4, 0, w], (FULL, FULL, FULL)
    else:
        inputs, in_forms = [0, w], (FULL, FULL)
    nodes.append(Node("mm", "call", target, inputs, [2], [Signature(in_forms, (FULL,), 2.0 * m * n * k)]))
    return Graph(nodes, tensors, 1)


@pytest.mark.parametrize(
    "target, w_producer, fwd, dx, dw",
    [
        ("linear", "param", "nt", "nn", ((3072, 768, 4096), "tn")),
        ("addmm", "param", "nn", "nt", ((768, 3072, 4096), "tn")),  # GPT-2's Conv1D: the weight is [k, n]
        ("mm", "param", "nn", "nt", ((768, 3072, 4096), "tn")),
        ("mm", "t", "nt", "nn", ((3072, 768, 4096), "tn")),  # x @ w.t(): stored as a linear's weight
    ],
)
def test_each_gemm_of_a_matmul_is_priced_in_its_layout(target, w_producer, fwd, dx, dw):
    m, n, k = 4096, 3072, 768
    g = _matmul_graph(target, w_producer, m, n, k)
    grid = _layout_grid()
    base = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), memory_bandwidth=0.0, op_overhead=1e-5)
    cm = CostModel(g, dataclasses.replace(base, gemm={"tf32": grid}), precision="tf32")
    node = g.node("mm")
    assert cm.gemm_layouts(node) == (fwd, dx)
    got_fwd, got_bwd = cm.device_compute(node, node.signatures[0])
    flops = 2.0 * m * n * k
    assert got_fwd == pytest.approx(1e-5 + flops / grid.rate(m, n, k, fwd))
    dims, layout = dw
    expected = 2e-5 + flops / grid.rate(m, k, n, dx) + flops / grid.rate(*dims, layout)
    assert got_bwd == pytest.approx(expected)
    if dx != fwd:  # the layouts differ in price, so a swapped layout would fail the checks above
        assert grid.rate(m, n, k, fwd) != pytest.approx(grid.rate(m, n, k, dx))


def test_grid_measurement_on_the_cpu():
    grid = gemm_grid("cpu", "fp32", (8, 32), budget_s=0.2)
    assert grid.sizes == (8, 32) and len(grid.rates) == 8
    assert [name for name, _ in grid.layouts] == ["nn", "tn"]
    assert all(r > 0 for rates in (grid.rates, *(r for _, r in grid.layouts)) for r in rates)
    only_nt = gemm_grid("cpu", "fp32", (8,), budget_s=0.05, layouts=("nt",))
    assert only_nt.layouts == () and len(only_nt.rates) == 1


def test_profile_command_rejects_bad_gemm_sizes(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "hidup", "profile", "--gemm-sizes", "12,x", "--merge", "h200x4-nvlink",
         "--out", str(tmp_path / "p.json"), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    assert "--gemm-sizes '12,x'" in r.stderr and "Traceback" not in r.stderr
