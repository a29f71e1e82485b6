"""What makes the search of large graphs faster changes no answer: the caches of states shared by the
problems of one cost model (one form numbering per search), what a node saves kept once for every set
of recomputed layers, the nodes of identical layers priced once, the search that hides the gradient
all-reduces forked beside the plain one, and a search that frees what it made as it goes."""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref

import pytest

import hidup
import hidup.profiler as P
from hidup.frontend.saved import saved_bytes
from hidup.frontend.trace import trace
from hidup.search import api, dp, modes
from hidup.search.cost import CostModel
from hidup.search.memory import MemoryModel
from hidup.search.problem import Models, Problem
from hidup.search.schedule import evaluate

CLUSTER = "h100x64-ib400"


def meta_gpt_graph(world: int, mesh: tuple | None = None):
    """A small GPT built on the meta device and traced for ``world`` ranks (on ``mesh`` if given)."""
    model, inputs = hidup.models.build(
        "gpt", world_size=world, device="meta", layers=2, d_model=256, heads=8, ffn=1024, seq_len=256,
        batch_per_gpu=4, vocab=2048,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, inputs, mesh=mesh) if mesh else trace(model, inputs)


@pytest.fixture(scope="module")
def mesh_graph():
    return meta_gpt_graph(16, (2, 8))


@pytest.fixture(scope="module")
def line_graph():
    return meta_gpt_graph(4)


def _key_in(a: Problem, b: Problem, key: tuple) -> tuple:
    """State ``key`` of problem ``a`` in problem ``b``'s form numbering."""

    def fid(f: int) -> int:
        return b.form_id[a.forms[f]]

    def mask(m: int) -> int:
        return sum(1 << fid(f) for f in range(m.bit_length()) if m >> f & 1)

    return tuple((fid(prod) if prod >= 0 else prod, mask(m)) for prod, m in key)


@pytest.mark.parametrize("reshard, recomputed", [(False, False), (True, True)])
def test_problems_of_one_cost_model_share_their_transitions_and_answer_as_problems_of_their_own(
    mesh_graph, reshard, recomputed
):
    """A problem built after others of the same cost model (another signature filter, resharding on or
    off, other recomputed layers) reads their transitions and penalties; its transitions, penalties and
    DP answers are those of a problem with models of its own (and so its own form numbering)."""
    profile = P.load(CLUSTER)
    models = Models(mesh_graph)
    first = Problem(mesh_graph, profile, "bf16", api.restrict_per_axis(("data", None)), models=models)
    for duplication in (False, True):
        dp.solve(first, duplication, beam=dp.Beam(32))
    recompute = api.repeated_layers(mesh_graph) if recomputed else frozenset()
    shared = Problem(mesh_graph, profile, "bf16", recompute=recompute, reshard=reshard, models=models)
    alone = Problem(mesh_graph, profile, "bf16", recompute=recompute, reshard=reshard)
    assert any(c is d for c, d in zip(shared._trans_cache, first._trans_cache))  # shared, not copied
    asked = {}  # (position, live index, states) -> penalties, as the DP asks them of `shared`

    def penalties(pos, j, states, own=shared.penalties, asked=asked):
        asked[(pos, j, tuple(states))] = out = own(pos, j, states)
        return out

    shared.penalties = penalties
    budget = (alone.min_mem_suffix[0] + alone.plan_memory(dp.solve(alone, False)[0])) / 2  # binds
    for duplication, limit in ((False, None), (True, None), (False, budget)):
        ks, v = dp.solve(shared, duplication, limit, dp.Beam(32))
        assert (ks, v) == dp.solve(alone, duplication, limit, dp.Beam(32))
        assert evaluate(shared, ks, duplication).total == evaluate(alone, ks, duplication).total
    met = 0
    for i in range(shared.n):
        for key, got in list(shared._trans_cache[i].items())[:4]:
            own = alone.transitions(i, _key_in(shared, alone, key))
            assert [(k, dataclasses.replace(st, convs=()), _key_in(shared, alone, nk)) for k, st, nk in got] == [
                (k, dataclasses.replace(st, convs=()), nk) for k, st, nk in own
            ]
            met += 1
    assert met > shared.n
    assert asked
    for (pos, j, states), pen in asked.items():
        assert (pen == alone.penalties(pos, j, [_key_in(shared, alone, (s,))[0] for s in states])).all()


def test_memory_models_sharing_what_nodes_save_price_as_models_of_their_own(mesh_graph):
    """Memory models sharing what nodes save, and the terms of alike nodes (the same op of identical
    layers with the same share of a recomputed family), give every node the terms it has worked out alone."""
    models = Models(mesh_graph)
    layers = sorted(api.repeated_layers(mesh_graph))
    for recompute in (frozenset(), frozenset(layers[:1]), frozenset(layers)):
        shared = models.memory(2.0, "bf16", recompute)
        alone = MemoryModel(mesh_graph, 2.0, "bf16", recompute)
        assert shared.saved_memo is not None and alone.saved_memo is None
        pairs = [(node, sig) for node in mesh_graph.nodes for sig in node.signatures]
        for node, sig in pairs:
            assert shared.breakdown(node, sig) == alone.breakdown(node, sig) == alone._breakdown_of(node, sig)
        assert len(shared._breakdown) < len(pairs) / 1.5  # two layers: most nodes are alike
    assert models.memory(2.0, "bf16").saved_memo is models.memory(2.0, "bf16", frozenset(layers)).saved_memo


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_nodes_of_identical_layers_are_priced_once_and_as_each_alone(mesh_graph, monkeypatch, precision):
    """A problem prices each class of twins once (:meth:`CostModel.twin`, :meth:`SavedRecord.twin`), and
    every node's compute, per-copy compute, saved bytes and kept parameter inputs are what the node
    prices alone."""
    priced = []
    device_compute = CostModel._device_compute

    def counted(self, node, sig):
        priced.append((node.name, id(sig)))
        return device_compute(self, node, sig)

    monkeypatch.setattr(CostModel, "_device_compute", counted)
    profile = P.load(CLUSTER)
    problem = Problem(mesh_graph, profile, precision)
    alone, memory, record = CostModel(mesh_graph, profile, precision), problem.memory, problem.memory.record
    pairs = [(node, sig) for node, sigs in zip(problem.order, problem.sigs) if node.op == "call" for sig in sigs]
    assert len(priced) == len(set(priced)) < len(pairs) / 1.5  # two layers: most ops have a twin
    assert len({memory.twin(node).name for node, _ in pairs}) < len({node.name for node, _ in pairs})
    for i, node in enumerate(problem.order):
        for k, sig in enumerate(problem.sigs[i]):
            device = alone._device_compute(node, sig) if node.op == "call" else (0.0, 0.0)
            assert problem._plain_device[i][k] == device
            assert problem._plain_copy[i][k] == alone.copy_compute(node, sig, device, alone.node_is_batch(node))
            assert problem.saved_in[i][k] == problem._saved_inputs(node, sig, record)
            if node.op == "call":
                assert memory._saved(node, sig) == saved_bytes(mesh_graph, record, node, sig)


@pytest.mark.parametrize("budgeted", [False, True, "by price"])
def test_the_hidden_search_forked_beside_the_plain_one_finds_the_plan_of_one_after_the_other(
    mesh_graph, monkeypatch, budgeted
):
    """Without duplication (a mesh search's seed) the DP hiding the gradient all-reduces runs in a forked
    child beside the plain DP, and under a budget that binds the recomputing search's DP without the
    budget in another; the plan is the one of running them one after the other.  Met by its price, the
    budget's passes run beside each other too (the next price guessed), and the duplicated search by
    price, forked, stops on the plain mode's answer as the searches one after the other would."""
    budget = None
    if budgeted == "by price":
        monkeypatch.setattr(dp, "PRICE_MIN_POSITIONS", 1)
    if budgeted:
        budget = 0.75 * hidup.search(mesh_graph, CLUSTER, duplication=False).memory["bound"]
    forked = []
    beside = modes.solve_beside

    def counted(problem, here, *there):
        forked.append(modes._forks(problem))
        return beside(problem, here, *there)

    monkeypatch.setattr(api, "solve_beside", counted)
    plans = {}
    for forks in (False, True):
        monkeypatch.setattr(modes, "PARALLEL_MIN_POSITIONS", 0 if forks else 10**9)
        forked.clear()
        plans[forks] = hidup.search(mesh_graph, CLUSTER, memory_budget=budget)
        assert forked and all(f == forks for f in forked)
    a, b = plans[False], plans[True]
    assert a.choices == b.choices and a.predicted == b.predicted and a.memory == b.memory
    assert a.duplication == b.duplication and a.recompute == b.recompute and a.conversions == b.conversions


def test_a_budgeted_search_runs_each_dp_pass_without_the_budget_once(mesh_graph, monkeypatch):
    """The recomputing search's plans without the budget, made ahead while the search before it waits,
    are kept on its problem and not searched again: no DP pass without a budget or a price runs twice
    for one problem's signatures and recomputed layers."""
    monkeypatch.setattr(modes, "PARALLEL_MIN_POSITIONS", 10**9)  # every pass in this process, to count them
    budget = 0.75 * hidup.search(mesh_graph, CLUSTER, duplication=False).memory["bound"]
    passes = []
    solve = dp._DP.solve

    def counted(self, reuse, progress):
        if not self.has_mem and not self.price:
            passes.append((id(self.p.sigs), self.p.recompute, self.dup, self.hide, self.max_states))
        return solve(self, reuse, progress)

    monkeypatch.setattr(dp._DP, "solve", counted)
    plan = hidup.search(mesh_graph, CLUSTER, memory_budget=budget)
    assert plan.memory["peak"] <= budget
    assert any(recompute for _, recompute, *_ in passes)  # the recomputing searches ran
    assert len(passes) == len(set(passes))


def test_a_search_frees_the_problems_it_made_without_the_collector(line_graph, monkeypatch):
    """A search whose first try fails (no plan without recomputation fits the budget) keeps that error
    without the frames it was raised through: every problem the search made is freed by reference
    counting once it returns, so no collection has to walk their caches."""
    alive: list[weakref.ref] = []
    init = Problem.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        alive.append(weakref.ref(self))

    monkeypatch.setattr(Problem, "__init__", tracked)
    profile = P.load("h200x4-nvlink")
    budget = 0.999 * Problem(line_graph, profile, "bf16").min_mem_suffix[0]  # no plan without recomputation
    alive.clear()
    was = gc.isenabled()
    gc.disable()
    try:
        plan = hidup.search(line_graph, profile, memory_budget=budget, precision="bf16")
        assert plan.recompute and plan.memory["total"] <= budget
        assert alive and all(ref() is None for ref in alive)
    finally:
        if was:
            gc.enable()


def _prune_before(self, states: dict, pos: int) -> dict:
    """:meth:`dp._DP.prune` as it was, sorting the states by estimate for each cut."""
    if self.dup or self.has_mem:
        states = {k: self.finalize(b) for k, b in states.items() if b}
    elif any(len(b) != 1 for b in states.values()):
        states = {k: [min(b, key=dp._first)] for k, b in states.items() if b}
    beam_cuts = bool(self.max_states) and len(states) > self.max_states
    if not self.has_mem and (len(states) > 8 if not self.dup else beam_cuts):
        if self.max_states and len(states) > dp.CROSS_PRUNE_SPAN * self.max_states:
            ranked = sorted(states.items(), key=dp._first_est)[: dp.CROSS_PRUNE_SPAN * self.max_states]
            keep = {k for k, _ in ranked}
            states = {k: f for k, f in states.items() if k in keep}
        states = self.cross_prune(states, pos)[0]
    if self.max_states and len(states) > self.max_states:
        keep = {k for k, _ in sorted(states.items(), key=dp._first_est)[: self.max_states]}
        states = {k: f for k, f in states.items() if k in keep}
    return states


@pytest.mark.parametrize("max_states", [4, 32])
def test_pruning_ranks_the_states_once_and_keeps_what_ranking_them_for_each_cut_kept(
    mesh_graph, monkeypatch, max_states
):
    """The states a position keeps, and their order (which settles ties later), are those of sorting
    them again for each cut, with every pass of the DP: plain, duplicated, budgeted, priced."""
    pruned = dp._DP.prune
    calls = []

    def both(self, states, pos, single=False):
        want = _prune_before(self, {k: list(b) for k, b in states.items()}, pos)
        got = pruned(self, states, pos, single)
        assert list(got.items()) == list(want.items())
        calls.append(len(states) > max_states)
        return got

    monkeypatch.setattr(dp._DP, "prune", both)
    pr = Problem(mesh_graph, P.load(CLUSTER), "bf16")
    budget = (pr.min_mem_suffix[0] + pr.plan_memory(dp.solve(pr, False, beam=dp.Beam(max_states))[0])) / 2
    for duplication in (False, True):
        dp.solve(pr, duplication, budget, dp.Beam(max_states))
        dp.solve(pr, duplication, budget, dp.Beam(max_states), by_price=True)
    assert any(calls)  # the beam did cut


def test_an_error_a_forked_search_sends_back_keeps_no_frame_alive():
    """A child's error (:class:`hidup.search.dp.Beaten`: its search by price stopped) is raised again in
    the parent; caught there, it is freed by reference counting with the frames it passed through, so
    the problems they hold do not wait for the collector (which, after a large search, walks millions
    of objects)."""
    import multiprocessing

    class Held:
        pass

    receive, send = multiprocessing.Pipe(duplex=False)

    def searched() -> weakref.ref:
        held = Held()  # what a frame the error passes through holds (a search's problem)
        send.send((False, dp.Beaten(1.0, 2.0)))
        try:
            modes._received(receive)
        except dp.Beaten:
            pass
        return weakref.ref(held)

    was = gc.isenabled()
    gc.disable()
    try:
        assert searched()() is None
    finally:
        if was:
            gc.enable()
        receive.close()
        send.close()
