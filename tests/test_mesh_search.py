"""The search on a device mesh of two axes: pricing per axis and link level, plans, files, commands."""

from __future__ import annotations

import json
import math
import warnings

import pytest

import hidup
from hidup.cli import main
from hidup.frontend.trace import trace
from hidup.ir import FULL, REPLICATE, Layout, gather, layout_conversions
from hidup.plan import Plan, PlanError
from hidup.profiler import load
from hidup.search import SearchError
from hidup.search.api import forced, price
from hidup.search.cost import CostModel

CLUSTER = "h100x64-ib400"  # 8 GPUs per node: on a 2x8 mesh axis 0 crosses nodes, axis 1 does not


def _gpt(world: int, **kw):
    cfg = dict(layers=1, d_model=64, heads=4, ffn=128, seq_len=16, batch_per_gpu=2, vocab=64)
    cfg.update(kw)
    return hidup.models.build("gpt", world_size=world, device="meta", **cfg)


@pytest.fixture(scope="module")
def small():
    model, inputs = _gpt(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, inputs, mesh=(2, 2))
    return graph


@pytest.fixture(scope="module")
def small_plan(small):
    return hidup.search(small, "h200x4-nvlink", duplication=False)


def test_graph_carries_the_mesh(small):
    assert small.mesh == (2, 2) and small.world_size == 4
    every = [s for n in small.nodes for s in n.signatures]
    assert all(isinstance(f, Layout) for s in every for f in s.inputs + s.outputs)
    assert all(len(s.axes) == 2 for n in small.nodes if n.op != "output" for s in n.signatures)
    one_axis = trace(*_gpt(4), 4)
    assert small.fingerprint() != one_axis.fingerprint()  # a plan for one cannot pass for the other


def test_a_mesh_must_hold_the_world():
    model, inputs = _gpt(4)
    with pytest.raises(ValueError, match="holds 6 ranks but world_size=4"):
        trace(model, inputs, 4, mesh=(2, 3))


def test_plan_round_trips_and_prices_as_predicted(small, small_plan, tmp_path):
    plan = small_plan
    assert plan.mesh == [2, 2] and plan.mesh_shape == (2, 2)
    plan.check(small)
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back.choices == plan.choices and back.conversions == plan.conversions
    assert any(c.steps for c in back.conversions)  # the layout changes keep their one-axis steps
    for c in back.conversions:
        if c.steps:
            assert c.steps[0].before == c.src and c.steps[-1].after == c.dst
    ev = price(small, "h200x4-nvlink", plan)[plan.duplication]
    assert ev.total == pytest.approx(plan.predicted["total"], rel=1e-9)


def test_a_plan_for_a_mesh_refuses_a_graph_of_one_axis(small_plan):
    one_axis = trace(*_gpt(4), 4)
    with pytest.raises(PlanError, match="graph fingerprint"):
        small_plan.check(one_axis)


def test_each_axis_is_priced_at_its_link():
    """On 8-GPU nodes a 2x8 mesh's axis 0 runs over the network, axis 1 over NVLink: the same
    all-gather of the same bytes costs more on axis 0, by the profile's two tables."""
    model, inputs = _gpt(16)
    graph = trace(model, inputs, mesh=(2, 8))
    cost = CostModel(graph, load(CLUSTER).fitted())
    assert cost.group(0) == (2, "network") and cost.group(1) == (8, "node")
    nbytes = 64 * 2**20
    assert cost.comm("all_gather", nbytes, 0) > 3 * cost.comm("all_gather", nbytes, 1)
    profile = load(CLUSTER).fitted()
    assert cost.comm("all_gather", nbytes, 0) == profile.comm_time("all_gather", 2, nbytes, level="network")
    # a 1-D world of 16 spans two nodes: priced at the network's pace
    flat = CostModel(trace(model, inputs, 16), load(CLUSTER).fitted())
    assert flat.group(None) == (16, "network")


def test_a_layout_change_costs_its_cheapest_path(small):
    cost = CostModel(small, load("h200x4-nvlink"))
    tid = next(n.outputs[0] for n in small.nodes if n.op == "input")
    src, dst = Layout((gather(0), FULL)), Layout((FULL, gather(1)))
    paths = layout_conversions(src, dst)
    assert len(paths) >= 2
    best = cost.conversion(tid, src, dst)
    priced = [cost._path_cost(small.tensors[tid], tid, cost.batch[tid], p) for p in paths]
    assert best.fwd + best.bwd == min(c.fwd + c.bwd for c in priced)
    # a replicated parameter's gradient is summed over every axis it is replicated on
    param = next(n for n in small.nodes if n.op == "param" and small.tensors[n.outputs[0]].requires_grad)
    sync = cost.conversion(param.outputs[0], Layout((REPLICATE, REPLICATE)), Layout((FULL, FULL)))
    assert sync.grad_sync and sync.bwd_async > 0 and sync.bwd_block == 0
    assert cost.conversion(param.outputs[0], Layout((FULL, FULL)), Layout((REPLICATE, FULL))) is None


def test_tensor_parallelism_stays_inside_nodes():
    """A wide layer at one sequence per GPU: tensor parallelism pays over NVLink, not over the network;
    the plan shards on axis 1 (inside nodes) and keeps axis 0 (across nodes) data-parallel."""
    model, inputs = _gpt(16, d_model=2048, heads=16, ffn=8192, seq_len=256, batch_per_gpu=1, vocab=256)
    graph = trace(model, inputs, mesh=(2, 8))
    plan = hidup.search(graph, CLUSTER, precision="bf16", duplication=False)
    calls = [(n, plan.choices[n.name]) for n in graph.nodes if n.op == "call"]
    inner_tensor = [n.name for n, s in calls if s.axes[1].kind == "tensor"]
    outer_tensor = [n.name for n, s in calls if s.axes[0].kind == "tensor"]
    assert inner_tensor and not outer_tensor
    network = [
        c for c in plan.conversions for st in c.steps if st.axis == 0 and st.forward in ("all_reduce", "all_to_all")
    ]
    assert not network  # no activation is summed or exchanged across nodes


def test_the_mesh_search_is_no_worse_than_the_data_parallel_plan(small, small_plan):
    data = forced(small, "h200x4-nvlink", "data", duplication=False)
    assert small_plan.predicted["total"] <= data.predicted["total"] * (1 + 1e-9)


def test_under_a_budget_the_mesh_search_beats_the_forced_styles_that_fit():
    """A budget the fastest plan does not fit: the search must find a plan that fits and is no slower
    than any fitting fixed style per axis; a budget nothing fits is one message with the least memory
    a plan needs, not a plan over the budget."""
    model, inputs = _gpt(16, layers=2, d_model=256, heads=8, ffn=1024, seq_len=256, batch_per_gpu=4, vocab=2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, inputs, mesh=(2, 8))
        fastest = hidup.search(graph, CLUSTER, duplication=False)
        budget = 0.75 * fastest.memory["bound"]  # the search's terms: the sum with the transients' bound
        plan = hidup.search(graph, CLUSTER, memory_budget=budget)
        assert plan.memory["peak"] <= budget < fastest.memory["peak"]
        fitting = 0
        for styles in (("fsdp", "fsdp"), ("tensor", "fsdp"), ("fsdp", "tensor")):
            try:
                fixed = forced(graph, CLUSTER, styles, memory_budget=budget)
            except SearchError:  # that style does not fit the budget with its transients
                continue
            fitting += 1
            assert plan.predicted["total"] <= fixed.predicted["total"] * (1 + 1e-9), styles
        assert fitting
        with pytest.raises(SearchError, match="no plan fits the memory budget .* the least memory any plan needs"):
            hidup.search(graph, CLUSTER, memory_budget=0.02 * fastest.memory["bound"])


def test_cli_search_on_a_mesh(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--model", "gpt", "--layers", "1", "--d-model", "64", "--heads", "4", "--ffn", "128"]
    args += ["--seq-len", "16", "--batch-per-gpu", "2", "--vocab", "64", "--no-duplication"]
    assert main(["search", *args, "--mesh", "2x2", "--out", str(out), "--quiet"]) == 0
    saved = json.loads(out.read_text())
    assert saved["mesh"] == [2, 2] and saved["world_size"] == 4
    assert main(["show", str(out)]) == 0
    assert "(a 2x2 mesh)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="mesh 2x2, not --mesh 4x1"):
        main(["show", str(out), "--mesh", "4x1"])
    with pytest.raises(SystemExit, match="holds 6 ranks, not --world 4"):
        main(["search", *args, "--mesh", "2x3", "--world", "4", "--out", str(out)])
    with pytest.raises(SystemExit):
        main(["search", *args, "--mesh", "2x", "--out", str(out)])
    assert "sizes joined by 'x'" in capsys.readouterr().err


def test_mesh_sizes_multiply_to_the_world(small):
    assert math.prod(small.mesh) == small.world_size
