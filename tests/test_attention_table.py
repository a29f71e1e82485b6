"""Attention priced from measured times (profiler/attention.py, imported as hidup.profiler.attention):
the table's interpolation and extrapolation rules, its JSON form and the profile's checks of it, the
variant the trace records on an attention node (hidup.rules.variant), and the cost model pricing an
attention from the table."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
from torch import nn

import hidup
import hidup.profiler
from hidup.ir import Node
from hidup.profiler.attention import VARIANTS, AttentionTable
from hidup.profiler.measure.device import attention_table
from hidup.profiler.profile import Profile, ProfileError
from hidup.search.cost import CostModel

HEAD_DIMS, SEQS, ROWS = (64, 128), (128, 512), (16, 64)


def _seconds(variant: str, d: int, s: int, r: int, backward: bool) -> float:
    """A made-up kernel time: a fixed part plus work quadratic in s, linear in d and rows."""
    scale = {"dense": 1.0, "causal": 0.6, "masked": 1.3}[variant] * (2.5 if backward else 1.0)
    return 1e-5 + scale * 1e-12 * d * s * s * r


def _table(variants=VARIANTS) -> AttentionTable:
    by_variant = {}
    for v in variants:
        pair = tuple(
            [_seconds(v, d, s, r, bwd) for d in HEAD_DIMS for s in SEQS for r in ROWS] for bwd in (False, True)
        )
        by_variant[v] = pair
    return AttentionTable.of(HEAD_DIMS, SEQS, ROWS, by_variant)


def test_the_table_gives_its_measured_times_at_its_grid_points():
    table = _table()
    for v in VARIANTS:
        for d in HEAD_DIMS:
            for s in SEQS:
                for r in ROWS:
                    expect = (_seconds(v, d, s, r, False), _seconds(v, d, s, r, True))
                    assert table.time(v, d, s, s, r) == pytest.approx(expect)


def test_between_and_beyond_the_grid_the_table_follows_its_rules():
    table = _table()
    at = lambda d, s, r: table.time("dense", d, s, s, r)[0]  # noqa: E731
    # rows: linear between measured counts, proportional above the most, clamped below the fewest
    assert at(64, 128, 40) == pytest.approx((at(64, 128, 16) * 24 + at(64, 128, 64) * 24) / 48)
    assert at(64, 128, 256) == pytest.approx(4 * at(64, 128, 64))
    assert at(64, 128, 4) == pytest.approx(at(64, 128, 16))
    # sequences: log-log between measured lengths, quadratic above the longest, clamped below
    mid = math.exp((math.log(at(64, 128, 16)) + math.log(at(64, 512, 16))) / 2)
    assert at(64, 256, 16) == pytest.approx(mid)
    assert at(64, 1024, 16) == pytest.approx(4 * at(64, 512, 16))
    assert at(64, 65, 16) == pytest.approx(at(64, 128, 16))
    # queries and keys of different lengths count as their geometric mean
    assert table.time("dense", 64, 128, 512, 16) == pytest.approx(table.time("dense", 64, 256, 256, 16))
    # head dims: linear between, proportional above, clamped below
    assert at(96, 128, 16) == pytest.approx((at(64, 128, 16) + at(128, 128, 16)) / 2)
    assert at(256, 128, 16) == pytest.approx(2 * at(128, 128, 16))
    assert at(32, 128, 16) == pytest.approx(at(64, 128, 16))
    assert table.time("masked", 64, 128, 128, 16)[0] > at(64, 128, 16) > table.time("causal", 64, 128, 128, 16)[0]
    assert _table(("dense",)).time("causal", 64, 128, 128, 16) is None  # a variant it has no times of


def test_the_table_round_trips_through_json_and_refuses_malformed_ones():
    table = _table()
    assert AttentionTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    assert table.scaled(2.0).time("dense", 64, 128, 128, 16)[0] == pytest.approx(
        table.time("dense", 64, 128, 128, 16)[0] / 2
    )
    bad = table.to_dict()
    bad["variants"]["dense"]["forward"] = bad["variants"]["dense"]["forward"][:-1]
    with pytest.raises(ValueError, match="dense forward: 8 times expected, got 7"):
        AttentionTable.from_dict(bad)
    with pytest.raises(ValueError, match="variants must be distinct ones of"):
        AttentionTable.of(HEAD_DIMS, SEQS, ROWS, {"sliding": ([1.0] * 8, [1.0] * 8)})
    with pytest.raises(ValueError, match="seqs must be distinct positive integers, increasing"):
        AttentionTable.of(HEAD_DIMS, (512, 128), ROWS, {"dense": ([1.0] * 8, [1.0] * 8)})
    with pytest.raises(ValueError, match="must be positive and finite"):
        AttentionTable.of(HEAD_DIMS, SEQS, ROWS, {"dense": ([1.0] * 7 + [0.0], [1.0] * 8)})


def test_a_profile_keeps_its_attention_tables_and_names_a_bad_one():
    base = hidup.profiler.load("h200x4-nvlink")
    profile = dataclasses.replace(base, attention={"fp32": _table(), "bf16": _table(("causal",))})
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.attention == profile.attention
    perturbed = profile.perturb(0.2, seed=3)
    ratio = perturbed.attention["fp32"].times[0][1][0][0] / profile.attention["fp32"].times[0][1][0][0]
    assert ratio != 1.0 and 1 / 1.2 <= ratio <= 1 / 0.8  # drawn like a rate
    data = profile.to_dict()
    data["attention"]["tf32"] = data["attention"].pop("fp32")
    with pytest.raises(ProfileError, match="attention"):
        Profile.from_dict(data)
    data = profile.to_dict()
    del data["attention"]["bf16"]["rows"]
    with pytest.raises(ProfileError, match=r"attention\.bf16"):
        Profile.from_dict(data)


def test_measuring_a_table_times_every_point_of_every_variant():
    table = attention_table("cpu", "fp32", (8,), (16, 32), (8,), budget_s=0.05)
    assert table.variants == VARIANTS
    assert all(len(seconds) == 2 for _, pair in table.times for seconds in pair)


class Attention(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q, k, v):
        s = q.shape[-2]
        if self.how == "masked":
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.how == "causal")
        return out.sum()


def _attention(how: str, shape=(2, 4, 128, 64)):
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(Attention(how), (q, k, v), world_size=2)
    return graph, next(n for n in graph.nodes if n.target == "scaled_dot_product_attention")


@pytest.mark.parametrize("how", ["dense", "causal", "masked"])
def test_the_trace_records_the_attention_variant(how):
    graph, node = _attention(how)
    assert node.variant == how
    assert Node.from_dict(json.loads(json.dumps(node.to_dict()))).variant == how
    assert all(n.variant == "" for n in graph.nodes if n is not node)
    assert "variant" not in next(n for n in graph.nodes if n is not node).to_dict()  # kept out when empty


@pytest.mark.parametrize("precision, dtype", [("tf32", "fp32"), ("bf16", "bf16")])
def test_the_cost_model_prices_attention_from_the_table_of_its_variant(precision, dtype):
    base = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), ops={}, op_overhead=1e-6)
    profile = dataclasses.replace(base, attention={dtype: _table()})
    prices = {}
    for how in VARIANTS:
        graph, node = _attention(how)
        for sig in node.signatures:
            q = sig.inputs[0].local_shape(graph.tensors[node.inputs[0]].shape, graph.mesh)
            expect = _table().time(how, 64, 128, 128, math.prod(q[:-2]))
            fwd, bwd = CostModel(graph, profile, precision).device_compute(node, sig)
            assert (fwd, bwd) == pytest.approx((expect[0] + 1e-6, expect[1] + 1e-6))
        prices[how] = CostModel(graph, profile, precision).device_compute(node, node.signatures[0])
        # without a table of the dtype: the FLOP roofline, whatever the variant
        other = {"fp32": "bf16", "bf16": "fp32"}[dtype]
        roofline = CostModel(graph, dataclasses.replace(base, attention={other: _table()}), precision)
        assert roofline.device_compute(node, node.signatures[0]) == CostModel(graph, base, precision).device_compute(
            node, node.signatures[0]
        )
    assert prices["masked"][0] > prices["dense"][0] > prices["causal"][0]


def test_attention_nodes_of_different_variants_are_not_priced_as_one():
    class Two(nn.Module):
        def forward(self, q, k, v):
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            b = nn.functional.scaled_dot_product_attention(q, k, v)
            return (a + b).sum()

    q, k, v = (torch.randn(2, 4, 128, 64, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(Two(), (q, k, v), world_size=2)
    profile = dataclasses.replace(hidup.profiler.load("h200x4-nvlink"), ops={}, attention={"fp32": _table()})
    cost = CostModel(graph, profile, "fp32")
    causal, dense = (n for n in graph.nodes if n.target == "scaled_dot_product_attention")
    assert (causal.variant, dense.variant) == ("causal", "dense")
    assert cost.twin(dense) is dense
    assert cost.device_compute(causal, causal.signatures[0])[0] < cost.device_compute(dense, dense.signatures[0])[0]
