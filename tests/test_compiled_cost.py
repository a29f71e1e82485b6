"""The cost model's compiled-program pricing (search/cost.py, "Compiled programs"), the fusion kinds
(hidup/rules/fusion.py), the size-aware matmul rate and the Adam roofline (profiler/profile.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import hidup
import hidup.models
import hidup.profiler
from hidup.profiler.profile import Profile, ProfileError
from hidup.rules.fusion import fusion_kind
from hidup.search import price, search
from hidup.search.cost import CostModel

BW = 1e12  # bytes/s
OVERHEAD = 1e-6


def _profile(**kw) -> Profile:
    p = hidup.profiler.load("h200x4-nvlink")
    p.memory_bandwidth, p.op_overhead, p.op_overhead_graph = BW, OVERHEAD, 0.0
    for k, v in kw.items():
        setattr(p, k, v)
    return p


class Residual(nn.Module):
    """a = 2x (fused); h = gelu(x W1) W2 (kernels around a fused gelu); y = layer_norm(a + h); sum."""

    def __init__(self, d=16):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        a = x * 2.0
        h = self.w2(torch.nn.functional.gelu(self.w1(x))).view(x.shape)
        return self.norm(a + h).sum()


def _graph():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hidup.trace(Residual(), (torch.randn(8, 16),), world_size=2)


def _full(node):
    """The signature that keeps every tensor whole on each rank."""
    return next(s for s in node.signatures if all(not f.is_gather for f in s.inputs + s.outputs))


def _node(graph, prefix):
    return next(n for n in graph.nodes if n.op == "call" and n.target.startswith(prefix))


def _nbytes(graph, tid):
    return graph.tensors[tid].numel * 4


def test_fusion_kinds_name_what_inductor_does():
    assert [fusion_kind(t) for t in ("view", "transpose.int", "detach_", "slice.Tensor")] == ["view"] * 4
    assert [fusion_kind(t) for t in ("add.Tensor", "div_.Tensor", "gelu", "layer_norm", "to.dtype")] == ["fused"] * 5
    assert [fusion_kind(t) for t in ("linear", "scaled_dot_product_attention", "moe_gating", "routed_experts")] == [
        "kernel"
    ] * 4
    assert fusion_kind("an_op_nobody_knows") == "kernel"  # priced as its own op, never as free


def test_zoo_ops_have_a_considered_kind():
    """Every op of the zoo's graphs is listed as a view or fused op, or is one of the ops that run a
    library kernel of their own: a new op gets its kind decided, not defaulted."""
    kernels = {"linear", "einsum", "scaled_dot_product_attention", "moe_gating", "conv2d", "topk", "routed_experts"}
    seen = set()
    for name in hidup.models.names():
        model, inputs = hidup.models.build(name, world_size=2, device="meta", layers=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = hidup.trace(model, inputs, world_size=2)
        seen |= {n.target for n in graph.nodes if n.op == "call" and fusion_kind(n.target) == "kernel"}
    assert seen <= kernels, sorted(seen - kernels)


def test_compiled_program_moves_only_what_crosses_a_kernel():
    g = _graph()
    cm = CostModel(g, _profile().launched(cuda_graphs=False, compiled=True), "fp32")
    gelu, mul, add, norm = (_node(g, p) for p in ("gelu", "mul", "add", "layer_norm"))
    # gelu: reads the first linear's output, writes what the second linear reads
    want = (_nbytes(g, gelu.inputs[0]) + _nbytes(g, gelu.outputs[0])) / BW + OVERHEAD
    assert cm.device_compute(gelu, _full(gelu)) == pytest.approx((want, 2 * want))
    # 2x: reads x; its consumer (the add) sits behind the linears, so it is written too
    want = (_nbytes(g, mul.inputs[0]) + _nbytes(g, mul.outputs[0])) / BW + OVERHEAD
    assert cm.device_compute(mul, _full(mul))[0] == pytest.approx(want)
    # a + h: reads both; the layer norm after it fuses with it, so its output never reaches memory
    want = sum(_nbytes(g, t) for t in add.inputs) / BW
    assert cm.device_compute(add, _full(add))[0] == pytest.approx(want)
    assert cm.fixed(add) == (0.0, 0.0)
    # the layer norm reads only its weight and bias (its input is the add's, in registers)
    weights = [t for t in norm.inputs if g.tensors[t].is_param]
    assert len(weights) == 2
    got = cm.device_compute(norm, _full(norm))[0]
    assert got == pytest.approx(sum(_nbytes(g, t) for t in weights) / BW)
    # views are free, with no fixed cost
    for n in g.nodes:
        if n.op == "call" and fusion_kind(n.target) == "view":
            assert cm.device_compute(n, _full(n)) == (0.0, 0.0) and cm.fixed(n) == (0.0, 0.0)


def test_compiled_prices_less_than_eager_and_kernels_alike():
    g = _graph()
    eager = CostModel(g, _profile().launched(cuda_graphs=False), "fp32")
    compiled = CostModel(g, _profile().launched(cuda_graphs=False, compiled=True), "fp32")
    for n in g.nodes:
        if n.op != "call":
            continue
        e, c = eager.device_compute(n, _full(n)), compiled.device_compute(n, _full(n))
        if fusion_kind(n.target) == "kernel":
            assert c == pytest.approx(e)
        else:
            assert c[0] <= e[0]
    model, inputs = hidup.models.build("gpt", world_size=2, device="meta", layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = hidup.trace(model, inputs, world_size=2)
    plan = search(gpt, _profile(), duplication=False, progress=False)
    on, off = (price(gpt, _profile(), plan, compiled=c)[False].compute for c in (True, False))
    assert 0 < on < off


def test_rate_at_follows_the_measured_sizes():
    p = _profile(flops={**_profile().flops, "bf16": 8e14}, matmul_sizes={"bf16": {1024: 1e14, 4096: 8e14}})
    assert p.rate_at("bf16", 2 * 512**3) == 1e14  # below the smallest size: its rate
    assert p.rate_at("bf16", 2 * 1024**3) == pytest.approx(1e14)
    assert p.rate_at("bf16", 2 * 2048**3) == pytest.approx((1e14 * 8e14) ** 0.5)  # halfway in log n
    assert p.rate_at("bf16", 2 * 8192**3) == 8e14  # above: the peak
    assert p.rate_at("tf32", 2 * 1024**3) == p.rate("tf32")  # no sizes: the peak
    back = Profile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.matmul_sizes == {"bf16": {1024: 1e14, 4096: 8e14}}
    noisy = p.perturb(0.2, seed=3)
    k = noisy.matmul_sizes["bf16"][1024] / 1e14
    assert 0.8 <= k <= 1.2 and noisy.matmul_sizes["bf16"][4096] == pytest.approx(8e14 * k)
    bad = p.to_dict()
    bad["matmul_sizes"] = {"bf16": {"big": 1.0}}
    with pytest.raises(ProfileError, match="matmul_sizes.bf16"):
        Profile.from_dict(bad)


def test_adam_roofline_where_the_profile_has_no_rate():
    p = _profile()
    assert p.optimizer_time(7e9) == pytest.approx(7 * 7e9 / BW)
    p.optimizer_s_per_byte = 1e-12
    assert p.optimizer_time(7e9) == pytest.approx(7e-3)
    p.optimizer_s_per_byte, p.memory_bandwidth = 0.0, 0.0
    assert p.optimizer_time(7e9) == 0.0


def test_search_compiled_flag_prices_the_compiled_program(tmp_path):
    from hidup.cli import main

    common = ["search", "--model", "gpt", "--layers", "1", "--world", "2", "--profile", "h200x4-nvlink", "--quiet"]
    assert main([*common, "--compiled", "--out", str(tmp_path / "c.json")]) == 0
    assert main([*common, "--out", str(tmp_path / "e.json")]) == 0
    compiled, eager = (json.loads((tmp_path / f).read_text()) for f in ("c.json", "e.json"))
    assert compiled["options"]["compiled"] is True and eager["options"]["compiled"] is False
    assert sum(c[0] + c[1] for c in compiled["node_costs"].values()) < sum(
        c[0] + c[1] for c in eager["node_costs"].values()
    )
