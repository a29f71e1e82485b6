"""Inductor's sums over rows priced from their own measurements: the profile's ``reduction_bandwidth`` and
``kernel_floor_graph`` (profiler/profile.py, "Generated kernels"; profiler/measure/device.py, "Sums over rows") and the
cost model's use of them (search/cost.py, "Compiled programs")."""

import dataclasses
import json
import math

import pytest

import hidup.profiler
from hidup.ir import FULL, Graph, Node, Signature, Tensor
from hidup.profiler.measure.device import kernel_floor, reduction_bandwidth
from hidup.profiler.profile import Profile
from hidup.search.cost import CostModel

MEMBW, OVERHEAD, RED, FLOOR = 4e12, 1e-6, 2e12, 3e-6


def _profile(measured: bool, compiled: bool = True) -> Profile:
    base = dataclasses.replace(
        hidup.profiler.load("h200x4-nvlink"), memory_bandwidth=MEMBW, op_overhead=OVERHEAD, compiled=compiled
    )
    if not measured:
        return base
    return dataclasses.replace(base, reduction_bandwidth={"fp32": RED}, kernel_floor_graph=FLOOR)


def test_profile_keeps_the_sums_measurements_and_names_a_bad_one(tmp_path):
    p = _profile(True, compiled=False)
    q = hidup.profiler.load(hidup.profiler.save(p, tmp_path / "p.json"))
    assert q.reduction_bandwidth == {"fp32": RED} and q.kernel_floor_graph == FLOOR
    assert "reduction_bandwidth" not in _profile(False, compiled=False).to_dict()  # absent when not measured
    noisy = p.perturb(0.2, seed=5)
    assert 0.8 * RED <= noisy.reduction_bandwidth["fp32"] <= 1.2 * RED
    assert 0.8 * FLOOR <= noisy.kernel_floor_graph <= 1.2 * FLOOR
    # the draws of every other field are those of a profile without the new ones
    plain = _profile(False, compiled=False).perturb(0.2, seed=5)
    assert noisy.memory_bandwidth == plain.memory_bandwidth and noisy.gemm == plain.gemm
    for bad in ({"tf32": RED}, {"fp32": -1.0}, {"fp32": "fast"}):
        d = json.loads(json.dumps(p.to_dict()))
        d["reduction_bandwidth"] = bad
        with pytest.raises(hidup.profiler.ProfileError, match="reduction_bandwidth"):
            Profile.from_dict(d)


def _graph(target: str, inputs: list[Tensor], out_shape: tuple) -> Graph:
    out = Tensor(len(inputs), out_shape, "float32", "op", requires_grad=True)
    nodes = [
        Node(t.producer, "param" if t.is_param else "input", t.producer, [], [t.id], [Signature((), (FULL,))])
        for t in inputs
    ]
    sig = Signature(tuple(FULL for _ in inputs), (FULL,), 0.0)
    nodes.append(Node("op", "call", target, [t.id for t in inputs], [out.id], [sig]))
    return Graph(nodes, {**{t.id: t for t in inputs}, out.id: out}, 1)


def _priced(graph: Graph, profile: Profile) -> tuple[float, float]:
    node = graph.node("op")
    return CostModel(graph, profile, precision="fp32").device_compute(node, node.signatures[0])


def test_a_linear_bias_gradient_is_a_compiled_sum_over_rows():
    m, n, k = 4096, 1024, 512
    x = Tensor(0, (m, k), "float32", "x", requires_grad=True)
    w = Tensor(1, (n, k), "float32", "w", requires_grad=True, is_param=True)
    b = Tensor(2, (n,), "float32", "b", requires_grad=True, is_param=True)
    g = _graph("linear", [x, w, b], (m, n))
    node, out_bytes = g.node("op"), m * n * 4
    sums = {
        (measured, compiled): CostModel(g, _profile(measured, compiled), precision="fp32").bias_grad(
            node, node.signatures[0]
        )
        for measured in (False, True)
        for compiled in (False, True)
    }
    assert sums[(False, True)] == sums[(False, False)] == pytest.approx(OVERHEAD + out_bytes / MEMBW)
    assert sums[(True, False)] == pytest.approx(OVERHEAD + out_bytes / MEMBW)  # eager: one read, one kernel
    assert sums[(True, True)] == pytest.approx(OVERHEAD + out_bytes / RED + FLOOR)
    # the linear's backward carries it (the bias's own bytes aside)
    no_bias = _graph("linear", [x, w], (m, n))
    extra = _priced(g, _profile(True))[1] - _priced(no_bias, _profile(True))[1]
    assert extra == pytest.approx(sums[(True, True)], rel=1e-3)


@pytest.mark.parametrize("param_grad", [True, False])
def test_a_fused_node_sums_the_gradient_of_each_parameter_it_broadcasts(param_grad):
    rows, cols = 8192, 768
    x = Tensor(0, (rows, cols), "float32", "x", requires_grad=True)
    weight = Tensor(1, (cols,), "float32", "weight", requires_grad=param_grad, is_param=True)
    bias = Tensor(2, (cols,), "float32", "bias", requires_grad=param_grad, is_param=True)
    g = _graph("layer_norm", [x, weight, bias], (rows, cols))
    fwd, bwd = _priced(g, _profile(False))
    assert bwd == pytest.approx(2 * fwd)  # not measured: the backward twice the forward, as before
    fwd_m, bwd_m = _priced(g, _profile(True))
    row_sum = OVERHEAD + rows * cols * 4 / RED + FLOOR
    assert fwd_m == fwd
    assert bwd_m == pytest.approx(2 * fwd + (2 * row_sum if param_grad else 0.0))
    # a parameter as large as the output is not broadcast: nothing to sum
    full = Tensor(1, (rows, cols), "float32", "full", requires_grad=True, is_param=True)
    same = _graph("add.Tensor", [x, full], (rows, cols))
    assert _priced(same, _profile(True))[1] == pytest.approx(2 * _priced(same, _profile(True))[0])


def test_sum_measurements_on_the_cpu():
    # inductor is what a profile compiles with on a GPU; here the eager backend exercises the same timing
    rate = reduction_bandwidth("cpu", "fp32", 1 << 20, budget_s=0.05, backend="eager")
    floor = kernel_floor("cpu", budget_s=0.05, backend="eager")
    assert rate > 0 and math.isfinite(rate) and 0 < floor < 1
