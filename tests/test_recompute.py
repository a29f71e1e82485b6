"""Recomputation of repeated layers: exact results, the memory it saves, and the search's choice of it.

* Parity: on two gloo ranks, rank programs with every repeated layer recomputed give the loss and
  gradients of the same plan without recomputation and of the single-device model -- zoo models and
  a ``transformers`` Llama, data / tensor / expert / FSDP-style (weights stored split, gathered for use:
  the gathered copy is freed and gathered again) plans, duplication off and on.  Float64
  throughout (the Llama's loss is float32: its tolerance is the float32 one of
  :mod:`test_thirdparty`).
* Each region's forward runs twice (once in the forward, once in the backward).
* Memory: what autograd keeps -- outside the recomputed layers, and the layers' inputs -- is exactly the
  memory model's ``kept`` and ``layer_inputs`` parts (rank 0's program on torch's fake process group,
  ``saved_tensors_hooks``), and the plan keeps less in all than without recomputation.
* Search: under a budget the fastest plain plan misses, ``recompute="auto"`` recomputes the fewest
  layers that fit; without a budget it recomputes nothing; bad layer names fail clearly.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hidup.models as M
import hidup.profiler
import thirdparty
from dist_util import run_distributed
from hidup.codegen import CompileError
from hidup.frontend.trace import trace
from hidup.ir import block_label
from hidup.plan import Plan, summary
from hidup.search import SearchError, forced, price, search
from hidup.search.api import repeated_layers
from hidup.search.memory import MemoryModel
from test_memory import _saved_bytes

PROFILE = "h200x4-nvlink"
SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, seq_len=8, batch_per_gpu=4, vocab=64)
# (model, plan style, duplication); "fsdp": data parallel with every weight stored split
JOBS = [
    ("gpt", "data", False),
    ("gpt", "tensor", True),
    ("gpt", "fsdp", False),
    ("gpt", "fsdp", True),
    ("bert-sgmoe", "expert", False),
    ("bert-sgmoe", "tensor", True),
    ("llama", "data", True),
    ("llama", "tensor", False),
]


def _build(name: str, world: int):
    if name in thirdparty.NAMES:
        return thirdparty.build(name)
    return M.build(name, world_size=world, dtype=torch.float64, **SMALL)


def _plan(graph, style: str, dup: bool):
    return forced(graph, hidup.profiler.load(PROFILE), style, duplication=dup)


def _graph(graphs: dict, name: str, world: int):
    """The trace of model ``name``, made once per rank (the plans read it, never change it)."""
    if name not in graphs:
        graphs[name] = trace(*_build(name, world), world_size=world)
    return graphs[name]


def _rank_parity(rank, world, jobs, graphs):
    from hidup.codegen import compile as hidup_compile
    from hidup.codegen.params import full_grad_dict
    from hidup.codegen.recompute import Recomputed

    warnings.simplefilter("ignore")
    out = []
    for name, style, dup in jobs:
        graph = _graph(graphs, name, world)
        plan = _plan(graph, style, dup)
        runs = {}
        for recompute in (False, True):
            model, inputs = _build(name, world)
            module = hidup_compile(
                model,
                plan,
                rank,
                world,
                inputs,
                duplication=dup,
                recompute=sorted(repeated_layers(graph)) if recompute else [],
            )
            calls = []
            for m in module.modules():
                if isinstance(m, Recomputed):
                    m.region.register_forward_pre_hook(lambda mod, args, calls=calls: calls.append(id(mod)))
            loss = module(*inputs)
            loss.backward()
            regions = sum(isinstance(m, Recomputed) for m in module.modules())
            runs[recompute] = (
                float(module.global_loss(loss)),
                full_grad_dict(module),
                regions,
                len(calls),
                module.duplication,
            )
        if rank:
            continue
        ref, ref_inputs = _build(name, world)
        ref_loss = ref(*ref_inputs)
        ref_loss.backward()
        ref_grads = dict(ref.named_parameters())
        plain, again = runs[False], runs[True]

        # relative to the largest gradient of the model where a gradient is zero in exact arithmetic
        # (attention's key bias holds only rounding noise)
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())

        worst = max(
            float((again[1][k] - ref_grads[k].grad).abs().max())
            / max(float(ref_grads[k].grad.abs().max()), 1e-2 * scale)
            for k in again[1]
        )
        out.append(
            {
                "job": (name, style, dup),
                "loss": (plain[0], again[0], float(ref_loss)),
                "grad_vs_plain": max(float((again[1][k] - plain[1][k]).abs().max()) for k in plain[1]),
                "grad_vs_ref": worst,
                "regions": (plain[2], again[2]),
                "calls": again[3],
                "duplication": again[4],
                "kinds": sorted({s.kind for s in plan.choices.values()}),
                "gathered_weights": any(
                    f.is_gather for n in graph.nodes if n.op == "param" for f in plan.choices[n.name].outputs
                ),
            }
        )
    return out


# (plan style, duplication) of the programs also run under torch.compile
COMPILED = [("tensor", True), ("fsdp", False)]


def _rank_all(rank, world):
    """Every parity job and every compiled program, in one process group (one spawn)."""
    graphs: dict = {}
    return {
        "parity": {r["job"]: r for r in _rank_parity(rank, world, JOBS, graphs)},
        "compiled": {case: _rank_compiled(rank, world, *case, graphs) for case in COMPILED},
    }


_RESULTS: dict = {}


def _results() -> dict:
    if not _RESULTS:
        _RESULTS.update(run_distributed(_rank_all, 2, timeout=900)[0])
    return _RESULTS


def _tol(name: str) -> float:
    return thirdparty.sum_tolerance(name, 2 * SMALL["batch_per_gpu"] * SMALL["seq_len"])


@pytest.mark.parametrize("job", JOBS, ids=["-".join(map(str, j)) for j in JOBS])
def test_recomputed_program_is_exact(job):
    r = _results()["parity"][job]
    name, style, dup = job
    plain_loss, loss, ref = r["loss"], r["loss"][1], r["loss"][2]
    assert r["regions"][0] == 0 and r["regions"][1] >= 2, r["regions"]
    # per copy every region runs forward once, and again in the backward when something it saved is
    # needed (a region whose outputs need no gradient is not run again)
    copies = 2 if r["duplication"] else 1
    assert r["regions"][1] * copies * 3 // 2 <= r["calls"] <= 2 * r["regions"][1] * copies, (
        f"{r['calls']} region runs for {r['regions'][1]} regions, {copies} copies"
    )
    assert r["duplication"] == dup
    assert abs(loss - plain_loss[0]) <= _tol(name) * abs(ref) and abs(loss - ref) <= _tol(name) * abs(ref), r["loss"]
    assert r["grad_vs_plain"] <= _tol(name), r["grad_vs_plain"]
    assert r["grad_vs_ref"] <= _tol(name), r["grad_vs_ref"]
    if style == "fsdp":
        assert r["gathered_weights"]
    elif style in ("tensor", "expert"):
        assert style in r["kinds"]


# ------------------------------------------------------------------------------------------------ memory


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("style", ["data", "tensor", "fsdp"])
def test_memory_model_counts_what_is_kept(fake_group, style):
    from hidup.codegen import compile as hidup_compile

    warnings.simplefilter("ignore")
    model, inputs = M.build("gpt", world_size=2, dtype=torch.float64, **SMALL)
    graph = trace(model, inputs, world_size=2)
    plan = _plan(graph, style, False)
    layers = repeated_layers(graph)
    module = hidup_compile(model, plan, 0, 2, inputs, duplication=False, recompute=sorted(layers))
    # a region packs what its ops save into hooks of its own: what is counted is what the ops outside the
    # regions save, and each region's inputs
    measured = _saved_bytes(module, inputs, autocast=False)
    plain = MemoryModel(graph).plan_activations(plan.choices)
    parts = MemoryModel(graph, recompute=layers).plan_activation_parts(plan.choices)
    assert parts["kept"] + parts["layer_inputs"] == measured, (parts, measured)
    assert parts["layer_inputs"] > 0 and parts["recomputed"] > 0
    assert sum(parts.values()) < plain, (parts, plain)


# ------------------------------------------------------------------------------------------------ search


@pytest.fixture(scope="module")
def gpt_graph():
    warnings.simplefilter("ignore")
    model, inputs = M.build(
        "gpt", world_size=4, layers=4, d_model=64, heads=4, ffn=256, seq_len=64, batch_per_gpu=8, vocab=64
    )
    return trace(model, inputs, world_size=4)


def test_search_recomputes_only_under_a_budget_that_needs_it(gpt_graph):
    profile = hidup.profiler.load(PROFILE)
    off = search(gpt_graph, profile, recompute="off")
    assert off.recompute == []
    assert search(gpt_graph, profile).recompute == []  # auto without a budget
    on = search(gpt_graph, profile, recompute="on")
    assert on.recompute == [f"trunk.layers.{i}" for i in range(4)]
    assert on.memory["activations"] < off.memory["activations"]
    assert on.predicted["total"] > off.predicted["total"]  # the forward runs twice
    # budgets on the search's terms (plan.memory["bound"]: the sum with the transients' bound)
    assert search(gpt_graph, profile, memory_budget=off.memory["bound"]).recompute == []
    budget = 0.9 * off.memory["bound"]  # (at 0.95 weights stored split fit it without recomputing)
    fit = search(gpt_graph, profile, memory_budget=budget, zero="off")  # ZeRO-2 might fit it without
    assert 0 < len(fit.recompute) < 4, fit.recompute  # the fewest layers that fit
    assert fit.memory["peak"] <= budget
    assert off.predicted["total"] < fit.predicted["total"] < on.predicted["total"]
    assert Plan.from_dict(fit.to_dict()).recompute == fit.recompute
    priced = price(gpt_graph, profile, fit)[fit.duplication]
    assert priced.total == pytest.approx(fit.predicted["total"], rel=1e-12)
    assert priced.memory["total"] == pytest.approx(fit.memory["total"], rel=1e-12)
    assert f"recomputed in the backward: {len(fit.recompute)} layers (trunk.layers.0" in summary(fit, gpt_graph)


def test_bad_layer_names_fail_clearly(gpt_graph):
    profile = hidup.profiler.load(PROFILE)
    with pytest.raises(SearchError, match="recompute names layers the model does not have: trunk.layers.9"):
        search(gpt_graph, profile, recompute=["trunk.layers.9"])
    with pytest.raises(ValueError, match="recompute must be one of auto, on, selective, off"):
        search(gpt_graph, profile, recompute="always")
    plan = search(gpt_graph, profile, recompute=["trunk.layers.1"])
    assert plan.recompute == ["trunk.layers.1"]
    model, inputs = M.build("gpt", world_size=1, **dict(SMALL, batch_per_gpu=2))
    from hidup.codegen import compile as hidup_compile

    g1 = trace(model, inputs, world_size=1)
    p1 = search(g1, profile)
    p1.recompute = ["blocks.7"]
    with pytest.raises(CompileError, match="recompute names layers the model does not have: blocks.7"):
        hidup_compile(model, p1, 0, 1, inputs)
    assert {block_label(n.module) for n in g1.nodes} - {""} == {"trunk.layers.0", "trunk.layers.1"}


def test_ilp_prices_recomputation(gpt_graph):
    """The ILP optimizes with the recomputed layers' extra forward (compute and conversions) in its
    objective: its plan under recompute="on" is priced like the DP's, never faster than without."""
    pytest.importorskip("mip")
    profile = hidup.profiler.load(PROFILE)
    off = search(gpt_graph, profile, algorithm="ilp", duplication=False, recompute="off")
    on = search(gpt_graph, profile, algorithm="ilp", duplication=False, recompute="on")
    dp_on = search(gpt_graph, profile, duplication=False, recompute="on")
    assert on.recompute == dp_on.recompute == [f"trunk.layers.{i}" for i in range(4)]
    assert on.predicted["total"] > off.predicted["total"]
    assert on.memory["activations"] < off.memory["activations"]
    assert abs(on.predicted["total"] - dp_on.predicted["total"]) <= 0.02 * dp_on.predicted["total"]


def _rank_compiled(rank, world, style, dup, graphs):
    import torch._dynamo

    from hidup.codegen import compile as hidup_compile
    from hidup.codegen.params import full_grad_dict

    warnings.simplefilter("ignore")
    torch._dynamo.reset()  # each case compiles from empty caches, as in a process of its own
    graph = _graph(graphs, "gpt", world)
    plan = _plan(graph, style, dup)
    layers = sorted(repeated_layers(graph))
    out = {}
    for backend in (False, "aot_eager"):
        model, inputs = _build("gpt", world)
        module = hidup_compile(
            model, plan, rank, world, inputs, duplication=dup, streams=dup, recompute=layers, compile=backend
        )
        loss = module(*inputs)
        loss.backward()
        out[backend] = (float(module.global_loss(loss)), full_grad_dict(module))
    eager, compiled = out[False], out["aot_eager"]
    return abs(eager[0] - compiled[0]), max(float((eager[1][k] - compiled[1][k]).abs().max()) for k in eager[1])


@pytest.mark.parametrize("style,dup", COMPILED)
def test_recomputed_program_compiles(style, dup):
    """Under torch.compile (dynamo capture and AOTAutograd, ``aot_eager``) the recomputed regions, their
    collectives and, with duplication, the two-stream stage schedule give the eager program's loss and
    gradients (float64)."""
    loss_diff, grad_diff = _results()["compiled"][(style, dup)]
    assert loss_diff <= _tol("gpt") and grad_diff <= _tol("gpt"), (loss_diff, grad_diff)


def test_ilp_time_limit_covers_the_search_with_recomputation(gpt_graph, monkeypatch):
    """Under a budget the fastest plan misses, recompute="auto" would run the ILP a second time; one
    time limit covers both, so once it is spent the second ILP does not start (resharding and ZeRO off:
    each would search again, under the same limit, tests/test_reshard.py and tests/test_zero.py)."""
    pytest.importorskip("mip")
    from hidup.search import api

    profile = hidup.profiler.load(PROFILE)
    budget = 0.9 * search(gpt_graph, profile, recompute="off").memory["bound"]  # the search's terms
    calls = []
    real = api.ilp.optimize
    monkeypatch.setattr(api.ilp, "optimize", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        search(
            gpt_graph,
            profile,
            algorithm="ilp",
            memory_budget=budget,
            time_limit=1e-9,
            reshard="off",
            zero="off",
            offload="off",
        )
    except SearchError as e:
        assert "time limit" in str(e)
    assert len(calls) == 1
    calls.clear()
    fit = search(
        gpt_graph,
        profile,
        algorithm="ilp",
        memory_budget=budget,
        time_limit=60,
        reshard="off",
        zero="off",
        offload="off",
    )
    # the recomputing ILP ran too (its plan need not win: weights stored split may fit without recomputing)
    assert len(calls) >= 2 and fit.memory["peak"] <= budget
