"""What the search keeps and reuses to go faster changes no answer: the models shared by a search's
problems, the per-class conversion cache, the transitions shared by the positions of repeated layers,
the memory-aware DP's inlined steps."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import hidup
import hidup.profiler as P
from hidup.search import api, dp
from hidup.search.brute import brute_force
from hidup.search.cost import CostModel
from hidup.search.memory import MemoryModel, Recompute
from hidup.search.problem import Models, Problem
from hidup.search.schedule import evaluate
from hidup.search.synthetic import layered_graph, random_graph
from test_search_speed import meta_gpt_graph

SOCKET = dataclasses.replace(P.load("h200x4-socket"), memory_bandwidth=0.0, op_overhead=0.0, op_overhead_graph=0.0)
CLUSTER = "h100x64-ib400"
EXACT = dict(max_states=None, max_points=None)


class FreshModels(Models):
    """Models that share nothing: every problem prices the graph itself, as before they were shared."""

    def cost(self, profile, precision, zero=0, reduce_dtype="fp32"):
        return CostModel(self.graph, profile, precision, zero=zero, reduce_dtype=reduce_dtype)

    def memory(self, optimizer_factor, precision, recompute=frozenset(), zero=0, offload=False):
        recompute = Recompute.of(recompute)
        return MemoryModel(
            self.graph,
            optimizer_factor,
            precision,
            recompute.whole,
            selective=recompute.selective,
            zero=zero,
            offload=offload,
        )


def _mesh_graph():
    return meta_gpt_graph(16, (2, 8))


@pytest.fixture(scope="module")
def mesh_graph():
    return _mesh_graph()


def _same_prices(a: Problem, b: Problem) -> None:
    assert a.sigs == b.sigs
    assert a.compute == b.compute and a.compute_copy == b.compute_copy and a.device_compute == b.device_compute
    assert a.mem == b.mem and a.mem_parts == b.mem_parts and a.fixed == b.fixed
    for t, src, dst in _form_changes(a):  # (form ids are numbered per search: the same forms in b)
        assert a.conversion(t, src, dst) == b.conversion(t, b.form_id[a.forms[src]], b.form_id[a.forms[dst]])


def _form_changes(pr: Problem) -> set:
    """Every (tensor, produced form id, needed form id) the problem may price."""
    made, needed = {}, {}
    for i, node in enumerate(pr.order):
        for k in range(len(pr.sigs[i])):
            for t, f in zip(node.outputs, pr.out_forms[i][k]):
                made.setdefault(t, set()).add(f)
            for t, f in zip(node.inputs, pr.in_forms[i][k]):
                needed.setdefault(t, set()).add(f)
    return {(t, src, dst) for t in needed for src in made[t] for dst in needed[t]}


def test_problems_sharing_models_price_as_problems_of_their_own(mesh_graph):
    profile = P.load(CLUSTER)
    models = Models(mesh_graph)
    narrow = Problem(mesh_graph, profile, "bf16", api.restrict_per_axis(("data", None)), models=models)
    wide = Problem(mesh_graph, profile, "bf16", models=models)  # reads what `narrow` priced, prices the rest
    layers = api.repeated_layers(mesh_graph)
    again = Problem(mesh_graph, profile, "bf16", recompute=layers, models=models)
    assert wide.cost is narrow.cost and again.cost is narrow.cost and again.memory is not wide.memory
    _same_prices(wide, Problem(mesh_graph, profile, "bf16"))
    _same_prices(narrow, Problem(mesh_graph, profile, "bf16", api.restrict_per_axis(("data", None))))
    _same_prices(again, Problem(mesh_graph, profile, "bf16", recompute=layers))
    with pytest.raises(ValueError, match="another graph"):
        Problem(random_graph(1), SOCKET, models=models)


def test_a_problem_derived_for_other_recomputed_layers_equals_one_built_anew(mesh_graph):
    """:meth:`Problem.derive` shares signatures and liveness and prices recomputation again: its
    prices, transitions and DP answer are those of a problem built from scratch, both ways."""
    profile = P.load(CLUSTER)
    layers = api.repeated_layers(mesh_graph)
    some = frozenset(sorted(layers)[:1])
    plain = Problem(mesh_graph, profile, "bf16", api.restrict_per_axis(("data", None)))
    for base, recompute in ((plain, layers), (plain, some), (plain.derive(layers), frozenset())):
        derived = base.derive(recompute)
        fresh = Problem(mesh_graph, profile, "bf16", api.restrict_per_axis(("data", None)), recompute=recompute)
        assert derived.recompute == fresh.recompute and derived.recomputed == fresh.recomputed
        _same_prices(derived, fresh)
        assert derived.min_mem_suffix == fresh.min_mem_suffix
        for duplication in (False, True):
            assert dp.solve(derived, duplication) == dp.solve(fresh, duplication)
    assert not plain.recompute and not any(plain.recomputed)  # the base is unchanged


def test_conversions_are_shared_by_tensors_of_one_class():
    pr = Problem(layered_graph(4, 5, seed=3), SOCKET)
    classes = {}
    for t, c in pr._conv_class.items():
        classes.setdefault(c, []).append(t)
    shared = [ts for ts in classes.values() if len(ts) > 1]
    assert shared  # repeated layers: tensors of one class
    fresh = CostModel(pr.graph, SOCKET)
    changes = _form_changes(pr)
    assert any(t in ts for ts in shared for t, _, _ in changes)
    for t, src, dst in changes:
        assert pr.conversion(t, src, dst) == fresh.conversion(t, pr.forms[src], pr.forms[dst])


def _unshared(self, kept_idx):
    return [{} for _ in range(self.n)]


def test_positions_of_repeated_layers_share_their_transitions(monkeypatch):
    graph = layered_graph(6, 6, seed=5)
    shared = Problem(graph, SOCKET)
    assert len({id(c) for c in shared._trans_cache}) < shared.n / 3  # the layers after the first reuse
    monkeypatch.setattr(Problem, "_transition_caches", _unshared)
    alone = Problem(graph, SOCKET)
    for duplication in (False, True):
        for budget in (None, 0.9 * sum(max(m) for m in alone.mem)):
            assert dp.solve(shared, duplication, budget) == dp.solve(alone, duplication, budget)
    met = 0
    for i in range(shared.n):
        for key, got in shared._trans_cache[i].items():
            own = alone.transitions(i, key)  # worked out at position i itself
            assert [(k, dataclasses.replace(st, convs=()), nk) for k, st, nk in got] == [
                (k, dataclasses.replace(st, convs=()), nk) for k, st, nk in own
            ]
            met += 1
    assert met > shared.n


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("duplication", [False, True])
def test_memory_aware_dp_equals_enumeration_under_a_budget_that_binds(seed, duplication):
    pr = Problem(random_graph(500 + seed, calls=4, max_sigs=3), SOCKET)
    evs = []
    for ks in itertools.product(*(range(len(s)) for s in pr.sigs)):
        try:
            evs.append(evaluate(pr, list(ks), duplication))
        except hidup.search.SearchError:
            continue
    fastest = min(evs, key=lambda ev: ev.objective)
    # the budget holds the DP's terms (the memory model's sum with the transients' bound: Problem.plan_memory)
    leanest = min(pr.plan_memory(ev.ks) for ev in evs)
    if leanest >= pr.plan_memory(fastest.ks):
        pytest.skip("the fastest plan is also the leanest: no budget binds")
    budget = (leanest + pr.plan_memory(fastest.ks)) / 2
    ks, v = dp.solve(pr, duplication, budget, dp.Beam(**EXACT))
    _, best = brute_force(pr, duplication, budget)
    ev = evaluate(pr, ks, duplication)
    assert pr.plan_memory(ks) <= budget and ev.memory["peak"] <= budget
    assert v == pytest.approx(best, rel=1e-12) and ev.objective == pytest.approx(v, rel=1e-12)
    assert best > fastest.objective * (1 + 1e-12)  # the budget did bind


def _same_plans(a, b) -> None:
    assert a.choices == b.choices
    assert a.predicted == b.predicted and a.memory == b.memory
    assert a.duplication == b.duplication and a.recompute == b.recompute
    assert a.alternatives == b.alternatives and a.conversions == b.conversions


@pytest.mark.parametrize("budgeted", [False, True])
def test_mesh_search_with_shared_models_finds_the_plan_of_unshared_ones(mesh_graph, monkeypatch, budgeted):
    """The mesh search's steps share one graph's models and its positions their transitions; with a
    model per problem and a transition cache per position (as before) it finds the same plan, under a
    budget too."""
    budget = None
    if budgeted:
        fastest = hidup.search(mesh_graph, CLUSTER, duplication=False)
        budget = 0.75 * fastest.memory["bound"]  # the search's terms, above the least a plan needs
    plan = hidup.search(mesh_graph, CLUSTER, memory_budget=budget)
    if budgeted:
        assert plan.memory["peak"] <= budget < fastest.memory["peak"]
    monkeypatch.setattr(api, "Models", FreshModels)
    monkeypatch.setattr(Problem, "_transition_caches", _unshared)
    _same_plans(plan, hidup.search(mesh_graph, CLUSTER, memory_budget=budget))
