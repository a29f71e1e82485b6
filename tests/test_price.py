"""A memory budget by its price (:mod:`hidup.search.dp`, "A memory budget by its price"): the DP
with every byte priced is the Lagrangian relaxation of the budget, checked against enumeration."""

import dataclasses
import itertools

import pytest

import hidup.profiler as P
from hidup.search import dp
from hidup.search.problem import Problem, SearchError
from hidup.search.schedule import evaluate
from hidup.search.synthetic import layered_graph, random_graph

SOCKET = dataclasses.replace(P.load("h200x4-socket"), memory_bandwidth=0.0, op_overhead=0.0, op_overhead_graph=0.0)
EXACT = (None, None, True, False)  # max_states, max_points, reuse_blocks, hide_grad_sync


def _plans(pr: Problem, duplication: bool) -> list[tuple[float, float, list[int]]]:
    """(objective, memory, signature indices) of every feasible assignment; memory by the DP's terms (the
    memory model's sum with the bound of its largest transient: ``Problem.plan_memory``)."""
    out = []
    for ks in itertools.product(*(range(len(s)) for s in pr.sigs)):
        try:
            ev = evaluate(pr, list(ks), duplication)
        except SearchError:
            continue
        out.append((ev.objective, pr.plan_memory(ks), list(ks)))
    return out


def _spread(pr: Problem, plans) -> float:
    memories = [m for _, m, _ in plans]
    if min(memories) == max(memories):
        pytest.skip("every plan uses the same memory")
    fastest = min(plans, key=lambda p: p[0])
    return fastest[0] / (fastest[1] - min(memories))  # seconds per byte the fastest plan's memory is worth


@pytest.mark.parametrize("seed", range(8))
def test_priced_dp_finds_the_least_priced_plan(seed):
    """Without duplication and without a beam the priced DP is exact: its value is the least ``time +
    price * memory`` over every assignment, and what it returns is that plan's time and memory."""
    g = random_graph(500 + seed, calls=4, world=(4, 2)[seed % 2], max_sigs=3)
    pr = Problem(g, SOCKET)
    plans = _plans(pr, False)
    scale = _spread(pr, plans)
    for price in (0.0, 0.1 * scale, scale, 10 * scale):
        ks, time, memory, value = dp._priced(pr, False, price, EXACT)
        best = min(t + price * m for t, m, _ in plans)
        assert value == pytest.approx(best, rel=1e-9)
        ev = evaluate(pr, ks, False)
        assert time == pytest.approx(ev.objective, rel=1e-9) and memory == pytest.approx(pr.plan_memory(ks))


@pytest.mark.parametrize("seed", range(4))
def test_priced_dp_with_duplication_prices_its_plan_consistently(seed):
    """With duplication the price enters the forward pass's time (through single positions and through
    a repeated layer's table alike): the value is the plan's duplicated time plus its priced memory."""
    g = layered_graph(layers=3, nodes_per_layer=6, seed=600 + seed, shape=(256, 256))
    pr = Problem(g, SOCKET)
    for price in (1e-12, 1e-10, 1e-8):
        for reuse in (True, False):
            ks, time, memory, value = dp._priced(pr, True, price, (32, 16, reuse, False))
            ev = evaluate(pr, ks, True)
            assert time == pytest.approx(ev.objective, rel=1e-9)
            assert value == pytest.approx(ev.objective + price * pr.plan_memory(ks), rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_met_by_price_fits_and_reaches_the_hull(seed, monkeypatch):
    """``by_price``: the plan fits the budget and is no faster than the fastest plan that fits (found by
    enumeration).  Bisecting the price to the end, it is the fastest corner of the lower convex hull of
    (memory, time) that fits: what pricing can reach."""
    g = random_graph(700 + seed, calls=4, world=(4, 2)[seed % 2], max_sigs=3)
    pr = Problem(g, SOCKET)
    plans = _plans(pr, False)
    _spread(pr, plans)
    lo, hi = min(m for _, m, _ in plans), min(plans, key=lambda p: p[0])[1]
    if hi <= lo * (1 + 1e-9):
        pytest.skip("the fastest plan is also the leanest")
    budget = (lo + hi) / 2
    monkeypatch.setattr(dp, "PRICE_STEPS", 200)
    monkeypatch.setattr(dp, "PRICE_RATIO", 1 + 1e-12)
    monkeypatch.setattr(dp, "PRICE_GAP", 0.0)
    ks, time = dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True)
    ev = evaluate(pr, ks, False)
    assert pr.plan_memory(ks) <= budget and ev.memory["peak"] <= budget
    assert time == pytest.approx(ev.objective, rel=1e-9)
    assert time >= min(t for t, m, _ in plans if m <= budget) * (1 - 1e-9)
    assert time == pytest.approx(min(t for m, t in _lower_hull(plans) if m <= budget), rel=1e-9)


def _lower_hull(plans) -> list[tuple[float, float]]:
    """The corners (memory, time) of the lower convex hull of the plans, from the leanest to the
    fastest: each is the least priced plan at some price >= 0."""
    points = sorted({(m, t) for t, m, _ in plans})
    hull: list[tuple[float, float]] = []
    for m, t in points:
        while len(hull) >= 2:
            (m1, t1), (m2, t2) = hull[-2], hull[-1]
            chord, here = (t - t1) * (m2 - m1), (t2 - t1) * (m - m1)
            if here >= chord - 1e-9 * abs(chord):  # hull[-1] on (a tie at one price only) or above the chord
                hull.pop()
            else:
                break
        hull.append((m, t))
    fastest = min(range(len(hull)), key=lambda j: hull[j][1])
    return hull[: fastest + 1]


def test_a_budget_no_plan_meets_says_so_by_price_too():
    g = random_graph(7, calls=4, max_sigs=3)
    pr = Problem(g, SOCKET)
    least = min(m for _, m, _ in _plans(pr, False))
    with pytest.raises(SearchError) as e:
        dp.solve(pr, False, least * 0.9, dp.Beam(None, None), by_price=True)
    assert f"{least:.6g} bytes" in str(e.value) and "least memory" in str(e.value)


def test_a_large_graph_no_plan_fits_says_the_leanest_terms_without_the_ilp(monkeypatch):
    """Where every node's leanest term already exceeds the budget on a large graph, the message says that
    lower bound of the least memory and solves no ILP (over a large model's graph it outlasts the search)."""
    g = random_graph(7, calls=4, max_sigs=3)
    pr = Problem(g, SOCKET)
    lower = pr.min_mem_suffix[0]
    monkeypatch.setattr(dp, "PRICE_MIN_POSITIONS", pr.n)

    def no_ilp(problem, time_limit=None):
        raise AssertionError("the ILP ran")

    monkeypatch.setattr(dp, "min_memory", no_ilp)
    with pytest.raises(SearchError) as e:
        dp.solve(pr, False, lower * 0.9, dp.Beam(None, None), by_price=True)
    assert f"the least memory any plan needs is at least {lower:.6g} bytes" in str(e.value)


def test_large_beam_searches_use_the_price_and_small_ones_the_memory_aware_dp(monkeypatch):
    """``by_price=None`` prices memory only with a beam on a graph of ``PRICE_MIN_POSITIONS`` or more."""
    g = random_graph(701, calls=4, max_sigs=3)
    pr = Problem(g, SOCKET)
    plans = _plans(pr, False)
    budget = (min(m for _, m, _ in plans) + min(plans, key=lambda p: p[0])[1]) / 2
    calls = []
    monkeypatch.setattr(dp, "_solve_by_price", lambda *a: calls.append(a) or (list(a[4][0]), a[4][1]))
    dp.solve(pr, False, budget, dp.Beam(32))
    assert not calls
    monkeypatch.setattr(dp, "PRICE_MIN_POSITIONS", 1)
    dp.solve(pr, False, budget, dp.Beam(None))
    assert not calls
    dp.solve(pr, False, budget, dp.Beam(32))
    assert len(calls) == 1


def test_the_search_by_price_stops_once_its_bound_beats_the_plan_in_hand():
    """``beat``: the bound is a lower bound of every plan within the budget (exact DP), so a plan in
    hand slower than the answer never stops the search, and one faster than every plan stops it."""
    g = random_graph(702, calls=4, max_sigs=3)
    pr = Problem(g, SOCKET)
    plans = _plans(pr, False)
    budget = (min(m for _, m, _ in plans) + min(plans, key=lambda p: p[0])[1]) / 2
    ks, time = dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True)
    again = dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True, beat=time * 1.001)
    assert again == (ks, time)
    with pytest.raises(dp.Beaten) as e:
        dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True, beat=0.5 * min(t for t, _, _ in plans))
    assert e.value.bound >= e.value.beat


@pytest.mark.parametrize("seed", range(24))
def test_a_guessed_price_is_the_next_one_of_the_outcome_it_guesses(seed):
    """:class:`dp._PriceSearch`: the price guessed after a pass (to run beside it) is the next price of
    the sequence after one of that pass's two outcomes, the one the guess names, or None only where
    no pass follows either outcome; so where the guess is right the sequence is that of one pass after
    the other."""
    import copy
    import random

    rng = random.Random(seed)
    threshold = 10 ** rng.uniform(-4, 4)  # plans fit at prices from here up
    search = dp._PriceSearch(1.0, 10 ** rng.uniform(-2, 2))
    price = search.next_price()
    passes = 0
    while price is not None:
        guess = search.guess_after(price)
        after = {}
        for fits in (True, False):
            other = copy.deepcopy(search)
            # a bound far below every time: no stop on the gap, only on the steps and the ratio
            other.update(price, ([0], 1.0 + rng.random(), 0.5 if fits else 2.0, -1e9))
            after[fits] = other.next_price()
        if guess is None:
            assert after[True] is None or after[False] is None
        else:
            guessed = search.best is None and search.raises == 0 or (search.best is not None and not search.last_fits)
            assert guess == after[guessed]
        search.update(price, ([0], 1.0 + rng.random(), 0.5 if price >= threshold else 2.0, -1e9))
        price = search.next_price()
        passes += 1
    assert passes <= dp.PRICE_RAISES + dp.PRICE_STEPS
    assert (search.best is None) == (search.high < threshold)


def _priced_setup(monkeypatch, duplication: bool):
    """A small random graph, its problem and a budget halfway between the least memory of any plan and
    the memory of the fastest (so the search by price has passes to make), with eight price steps."""
    g = random_graph(703, calls=4, max_sigs=3)
    pr = Problem(g, SOCKET)
    plans = _plans(pr, duplication)
    budget = (min(m for _, m, _ in plans) + min(plans, key=lambda p: p[0])[1]) / 2
    monkeypatch.setattr(dp, "PRICE_STEPS", 8)
    monkeypatch.setattr(dp, "PRICE_GAP", 0.0)
    return g, pr, budget


def test_the_search_by_price_with_a_guessed_pass_beside_finds_the_answer_of_one_pass_after_the_other(monkeypatch):
    """Where a core is spare the search by price runs the pass at the price it guesses comes next in a
    forked child beside the pass at this one: the answer (and the bound that stops it) is that of the
    passes one after the other."""
    import os

    from hidup.search import modes

    g, pr, budget = _priced_setup(monkeypatch, duplication=False)
    alone = dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True)
    forked = []
    beside = modes.solve_beside

    def counted(problem, here, *there):
        forked.append(len(there))
        return beside(problem, here, *there)

    monkeypatch.setattr(modes, "solve_beside", counted)
    monkeypatch.setattr(modes, "PARALLEL_MIN_POSITIONS", 0)
    pr = Problem(g, SOCKET)
    assert dp.solve(pr, False, budget, dp.Beam(None, None), by_price=True) == alone
    assert bool(forked) == ((os.cpu_count() or 1) >= 2)


def test_the_forked_duplicated_search_runs_its_passes_two_at_a_time_once_the_plain_answer_is_in(monkeypatch, tmp_path):
    """Under a budget the duplicated mode's search, forked beside the plain one, counts the parent's
    core as spare once the parent has the plain answer: its search by price then runs the pass it
    guesses comes next beside each pass, and both answers are those of the searches one after the other."""
    import os

    from hidup.search import modes

    g, pr, budget = _priced_setup(monkeypatch, duplication=True)
    monkeypatch.setattr(dp, "PRICE_MIN_POSITIONS", 0)  # by price: a beam that never cuts
    beam = dict(max_states=10**6, max_points=None)
    alone = [dp.solve(pr, mode, budget, dp.Beam(**beam))[0] for mode in (False, True)]
    assert pr.plan_memory(dp.solve(pr, True, None, dp.Beam(**beam))[0]) > budget  # the duplicated search is priced
    log = tmp_path / "beside"
    beside = dp.PASSES_BESIDE

    def logged(problem, here, there):  # (in the forked child: written to a file)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}:{modes.spare_core(problem)}\n")
        return beside(problem, here, there)

    parent, solve = os.getpid(), modes.solve

    def plain_at_once(problem, duplication, *args, **kwargs):  # the parent's answer is in at once
        if not duplication and os.getpid() == parent:
            return list(alone[0]), 0.0
        return solve(problem, duplication, *args, **kwargs)

    monkeypatch.setattr(dp, "PASSES_BESIDE", logged)
    monkeypatch.setattr(modes, "solve", plain_at_once)
    monkeypatch.setattr(modes, "PARALLEL_MIN_POSITIONS", 0)
    assert modes.solve_modes(Problem(g, SOCKET), (False, True), budget, beam=dp.Beam(**beam)) == alone
    calls = [line.split(":") for line in log.read_text().split()]
    assert calls and all(pid != str(parent) for pid, _ in calls)
    assert all(spare == str((os.cpu_count() or 1) >= 2) for _, spare in calls)
