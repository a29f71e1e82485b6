"""Kernel pricing rules of the cost model (search/cost.py, "Compute" and "Compiled programs"): float32
attention at the fp32 rate, the attention backward, a bias's gradient, autocast's casts of float32
parameters, the copies of padded matmul outputs around a conversion, and the kernel kinds a node's
time is reported under."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import hidup
import hidup.profiler
from hidup.ir import FULL, gather
from hidup.search.cost import ATTENTION_BACKWARD, CostModel, kernel_kind

BW, OVERHEAD = 1e12, 1e-6
RATES = {"fp32": 1e13, "tf32": 1e14, "bf16": 2e14, "fp16": 2e14}


def _profile(**changes):
    base = dict(memory_bandwidth=BW, op_overhead=OVERHEAD, flops=dict(RATES), matmul_sizes={}, ops={})
    base.update(changes)
    return dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), **base)


def _trace(module, *inputs, world=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hidup.trace(module, inputs, world_size=world)


def _node(graph, prefix):
    return next(n for n in graph.nodes if n.op == "call" and n.target.startswith(prefix))


def _whole(node):
    """The signature that keeps every tensor whole on each rank."""
    return next(s for s in node.signatures if all(not f.is_gather for f in s.inputs + s.outputs))


class Attention(nn.Module):
    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v).sum()


def _attention_graph():
    q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    return _trace(Attention(), q, k, v)


def test_float32_attention_runs_at_the_fp32_rate_and_its_backward_recomputes():
    g = _attention_graph()
    node = _node(g, "scaled_dot_product_attention")
    sig = _whole(node)
    assert sig.flops == 2.0 * (2 * 4) * 64 * 64 * (32 + 32)
    flops_only = _profile(memory_bandwidth=0.0)
    tf32 = CostModel(g, flops_only, "tf32").device_compute(node, sig)
    fwd = sig.flops / RATES["fp32"] + OVERHEAD  # not the TF32 rate
    assert tf32 == pytest.approx((fwd, ATTENTION_BACKWARD * fwd))
    assert ATTENTION_BACKWARD == 2.5  # 5 matmuls (scores recomputed) against the forward's 2
    bf16 = CostModel(g, flops_only, "bf16").device_compute(node, sig)  # autocast: the bf16 kernels
    fwd = sig.flops / RATES["bf16"] + OVERHEAD
    assert bf16 == pytest.approx((fwd, 2.5 * fwd))


def test_attention_counts_its_sequences_in_whole_blocks():
    q = torch.randn(2, 4, 65, 32, requires_grad=True)  # 65 queries and keys: two blocks of 64 each
    g = _trace(Attention(), q, torch.randn(2, 4, 65, 32), torch.randn(2, 4, 65, 32))
    node = _node(g, "scaled_dot_product_attention")
    sig = _whole(node)
    cm = CostModel(g, _profile(memory_bandwidth=0.0), "bf16")
    assert cm.attention_blocks(node) == pytest.approx((128 / 65) ** 2)
    fwd = sig.flops * (128 / 65) ** 2 / RATES["bf16"] + OVERHEAD
    assert cm.device_compute(node, sig) == pytest.approx((fwd, 2.5 * fwd))
    whole = _attention_graph()  # 64 queries and keys: one block
    assert CostModel(whole, _profile(), "bf16").attention_blocks(_node(whole, "scaled_dot_product_attention")) == 1.0


class Linear(nn.Module):
    def __init__(self, d_in=64, d_out=32, bias=True):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x):
        return self.proj(x).sum()


def test_a_bias_gradient_reads_the_output_gradient_once_more():
    x = torch.randn(128, 64)
    for bias in (True, False):
        g = _trace(Linear(bias=bias), x)
        node = _node(g, "linear")
        sig = _whole(node)
        cm = CostModel(g, _profile(), "fp32")
        moved = sum(g.tensors[t].numel * 4 for t in node.inputs + node.outputs)
        fwd = max(sig.flops / RATES["fp32"], moved / BW) + OVERHEAD
        out = g.tensors[node.outputs[0]].numel * 4
        bias_grad = out / BW + OVERHEAD if bias else 0.0
        assert cm.bias_grad(node, sig) == pytest.approx(bias_grad)
        assert cm.device_compute(node, sig) == pytest.approx((fwd, 2 * fwd + bias_grad))


def test_autocast_casts_each_float32_parameter_of_a_matmul_and_its_gradient_back():
    g = _trace(Linear(bias=False), torch.randn(128, 64))
    node = _node(g, "linear")
    sig = _whole(node)
    weight = 32 * 64
    cast = (4 + 2) * weight / BW + OVERHEAD  # read float32, write bfloat16 (and back for the gradient)
    low = CostModel(g, _profile(), "bf16")
    assert low.autocast_casts(node, sig) == pytest.approx((cast, cast))
    full = CostModel(g, _profile(), "bf16")
    full.autocast_casts = lambda node, sig: (0.0, 0.0)  # the same node priced without the casts
    got, without = low.device_compute(node, sig), full._device_compute(node, sig)
    assert got == pytest.approx((without[0] + cast, without[1] + cast))
    assert CostModel(g, _profile(), "tf32").autocast_casts(node, sig) == (0.0, 0.0)
    # a parameter split over the ranks casts only its local piece
    split = next(s for s in node.signatures if s.inputs[1] == gather(0))
    assert low.autocast_casts(node, split) == pytest.approx(((4 + 2) * weight / 2 / BW + OVERHEAD,) * 2)


def test_each_duplicated_copy_casts_the_whole_weight():
    g = _trace(Linear(bias=False), torch.randn(128, 64))
    node = _node(g, "linear")
    sig = _whole(node)
    cm = CostModel(g, _profile(), "bf16")
    cast = (4 + 2) * 32 * 64 / BW + OVERHEAD
    cf, cb = cm.device_compute(node, sig)
    # half of the rest above the fixed cost, plus the fixed cost and the whole casts, in each copy
    want = ((cf - cast - OVERHEAD) / 2 + OVERHEAD + cast, (cb - cast - 2 * OVERHEAD) / 2 + 2 * OVERHEAD + cast)
    assert cm.copy_device_compute(node, sig, batch=True) == pytest.approx(want)


class Head(nn.Module):
    """A matmul whose output rows are ``d_out`` floats."""

    def __init__(self, d_out):
        super().__init__()
        self.head = nn.Linear(16, d_out, bias=False)

    def forward(self, x):
        return self.head(x).exp().sum()


def test_a_padded_matmul_output_is_copied_to_and_from_its_conversion():
    x = torch.randn(8, 16)
    compiled = _profile().launched(cuda_graphs=False, compiled=True)
    # 1030 floats a row: at least 1024 elements and not a multiple of 128 bytes, so inductor pads it
    g = _trace(Head(1030), x)
    out = _node(g, "linear").outputs[0]
    nbytes = g.tensors[out].numel * 4
    cm = CostModel(g, compiled, "fp32")
    base = CostModel(g, _profile(), "fp32")  # uncompiled: no padding
    for src, dst, local in ((FULL, gather(0), nbytes), (gather(0), FULL, nbytes / 2)):
        copy = OVERHEAD + 2 * local / BW
        assert cm.padded_copies(out, src, "slice") == pytest.approx(copy)
        c, e = cm.conversion(out, src, dst), base.conversion(out, src, dst)
        assert c.fwd_copies == pytest.approx(e.fwd_copies + copy)
        assert c.bwd_copies == pytest.approx(e.bwd_copies + copy)
        half = OVERHEAD + local / BW  # each duplicated copy converts half the rows, one kernel each
        assert c.fwd_copies_a == pytest.approx(e.fwd_copies_a + half)
        assert c.bwd_copies_b == pytest.approx(e.bwd_copies_b + half)
    # rows of 1024 floats are aligned, and rows under 1024 elements are never padded
    for d_out in (1024, 1000):
        g = _trace(Head(d_out), x)
        out = _node(g, "linear").outputs[0]
        cm = CostModel(g, compiled, "fp32")
        assert cm.padded_copies(out, FULL, "slice") == 0.0
    # under bf16 the rows are 1030 * 2 bytes: still not a multiple of 128
    g = _trace(Head(1030), x)
    out = _node(g, "linear").outputs[0]
    assert CostModel(g, compiled, "bf16").padded_copies(out, FULL, "slice") > 0.0


def test_kernel_kinds_name_the_kernels_a_node_runs():
    assert kernel_kind("linear") == kernel_kind("addmm.default") == kernel_kind("einsum") == "matmul"
    assert kernel_kind("scaled_dot_product_attention") == "attention"
    assert kernel_kind("layer_norm") == kernel_kind("add.Tensor") == "generated"
    assert kernel_kind("view") is None and kernel_kind("moe_gating") == "other"
