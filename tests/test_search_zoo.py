"""Searched plans on the zoo are the plans an expert would pick (paper-sized layers, meta tensors)."""

import warnings

import pytest

import hidup.models
import hidup.profiler
from hidup.frontend.trace import trace
from hidup.ir import gather
from hidup.search import forced, search


@pytest.fixture(scope="module")
def graph():
    model, inputs = hidup.models.build("bert-sgmoe", world_size=8, device="meta", layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the zoo must trace with no replicated fallback
        return trace(model, inputs, world_size=8)


def test_paper_profile_shards_experts_with_all_to_all(graph):
    plan = search(graph, hidup.profiler.load("paper-v100-9.7gbps"), world_size=8)
    experts = [n for n in plan.choices if n.endswith(("moe_w1", "moe_w2"))]
    assert experts and all(plan.choices[n].outputs == (gather(0),) for n in experts), {
        n: str(plan.choices[n]) for n in experts
    }
    assert any(c.forward == "all_to_all" for c in plan.conversions)
    assert any(s.kind == "expert" for s in plan.choices.values())


def test_socket_profile_communicates_less_than_data_parallel(graph):
    profile = hidup.profiler.load("h200x4-socket")
    plan = search(graph, profile, world_size=8)
    data = forced(graph, profile, "data")
    assert plan.predicted["comm"] < data.predicted["comm"]
    assert plan.predicted["total"] < data.predicted["total"]
