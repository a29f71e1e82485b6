"""Fitted collective tables (profile.fit_ring_tables) and the DP's Pareto cap: robustness of the
search to a wrong profile (docs/robustness.md)."""

import copy
import math
from pathlib import Path

import pytest

import hidup.models
import hidup.profiler as P
from hidup.frontend.trace import trace
from hidup.profiler.profile import (
    A2A_TOLERANCE,
    RING_LINK,
    RING_TOLERANCE,
    CommTable,
    Profile,
    fit_all_to_all,
    fit_ring_tables,
)
from hidup.search import dp
from hidup.search.problem import Problem
from hidup.search.schedule import evaluate

MB = 2**20
SIZES = [4096.0, 64 * 1024.0, 1.0 * MB, 16.0 * MB, 256.0 * MB]
# A sockets profile measured on 4 x H200 (kept here so that re-measuring exp/records/ changes no test)
SOCKETS = Path(__file__).resolve().parent / "data" / "h200x4-sockets-measured.json"


def _link_tables(link_bw=(5e8, 2e9, 4e9, 6e9, 6.5e9), alpha=4e-5, skew=None):
    """Ring tables of one 4-rank link: all-reduce moves twice the link time of all-gather and
    reduce-scatter; ``skew[c][i]`` multiplies collective ``c``'s bandwidth at size ``i``."""
    tabs = {}
    for c, k in RING_LINK.items():
        bws = [bw / k * (skew or {}).get(c, [1.0] * len(SIZES))[i] for i, bw in enumerate(link_bw)]
        tabs[c] = {4: CommTable(alpha, list(SIZES), bws)}
    tabs["all_to_all"] = {4: CommTable(alpha, list(SIZES), [3 * b for b in link_bw])}
    return tabs


def test_fit_keeps_consistent_tables_and_small_deviations():
    tabs = _link_tables(skew={"all_gather": [1.0, 1.05, 0.95, 1.1, 0.92]})
    fit = fit_ring_tables(tabs)
    for c in tabs:
        assert fit[c][4].algbw == pytest.approx(tabs[c][4].algbw, rel=1e-12)


def test_fit_pulls_a_wrong_entry_back_to_its_link():
    """One all-reduce point measured 4x too slow: the fit brings it within the tolerance of the link
    time that all-gather and reduce-scatter agree on; the other entries stay put; all-to-all is untouched."""
    clean = _link_tables()
    bad = _link_tables(skew={"all_reduce": [1.0, 1.0, 1.0, 0.25, 1.0]})
    fit = fit_ring_tables(bad)
    i = 3
    true_t = SIZES[i] / clean["all_reduce"][4].algbw[i]
    raw_t = SIZES[i] / bad["all_reduce"][4].algbw[i]
    fit_t = SIZES[i] / fit["all_reduce"][4].algbw[i]
    assert raw_t == pytest.approx(4 * true_t)
    assert fit_t == pytest.approx(true_t * math.exp(RING_TOLERANCE))  # from 4x to the tolerance
    for c in ("all_gather", "reduce_scatter"):  # the two that agree are not dragged by the wrong one
        assert fit[c][4].algbw[i] == pytest.approx(clean[c][4].algbw[i])
    for j in (0, 1, 2, 4):
        assert fit["all_reduce"][4].algbw[j] == pytest.approx(clean["all_reduce"][4].algbw[j])
    assert fit["all_to_all"][4].algbw == bad["all_to_all"][4].algbw


def test_alpha_dominated_points_carry_no_weight():
    """At a size where the time is all latency, a wildly high bandwidth of one collective does not
    move the others (its own weight, its share of the time, is nil)."""
    tabs = _link_tables(link_bw=(1e12, 2e9, 4e9, 6e9, 6.5e9), skew={"all_gather": [1e3, 1, 1, 1, 1]})
    fit = fit_ring_tables(tabs)
    for c in ("reduce_scatter", "all_reduce"):
        t_raw = tabs[c][4].time(SIZES[0])
        assert tabs[c][4].alpha + SIZES[0] / fit[c][4].algbw[0] == pytest.approx(t_raw, rel=1e-3)


def test_fit_skips_groups_with_different_sizes():
    tabs = _link_tables()
    tabs["all_reduce"][4] = CommTable(4e-5, SIZES[:-1], tabs["all_reduce"][4].algbw[:-1])
    fit = fit_ring_tables(copy.deepcopy(tabs))
    for c in tabs:
        assert fit[c][4].algbw == tabs[c][4].algbw


@pytest.mark.parametrize("noise", [0.4, 0.8])
def test_fitted_perturbed_profile_stays_closer_to_the_clean_one(noise):
    """Over 10 seeds, the fitted tables of a perturbed measured profile err less (time-weighted, in
    log time) than its raw tables, and the worst ring entry errs less too."""
    clean = P.load(SOCKETS)

    def err(prof):
        out = []
        for c in RING_LINK:
            ref = clean.collectives[c][4]
            for s in ref.sizes[1:]:  # 4 KiB is all latency
                out.append(abs(math.log(prof.comm_time(c, 4, s) / clean.comm_time(c, 4, s))))
        return out

    raw, fit = [], []
    for seed in range(10):
        q = clean.perturb(noise, seed)
        raw += err(q)
        fit += err(q.fitted())
    assert sum(fit) < 0.85 * sum(raw)  # 0.80 at 40 % noise, 0.70 at 80 %
    assert max(fit) < max(raw)


def test_fit_keeps_measured_profiles():
    """The measured sockets profile is consistent: fitting it moves no time by more than 1 %
    (alpha-dominated points aside, where the table's bandwidth means nothing)."""
    prof = P.load(SOCKETS)
    fit = prof.fitted()
    for c in RING_LINK:
        for s in prof.collectives[c][4].sizes:
            assert fit.comm_time(c, 4, s) == pytest.approx(prof.comm_time(c, 4, s), rel=0.25)
        for s in prof.collectives[c][4].sizes[3:]:
            assert fit.comm_time(c, 4, s) == pytest.approx(prof.comm_time(c, 4, s), rel=0.01)


def test_cost_model_reads_fitted_tables():
    from hidup.search.cost import CostModel

    prof = P.load(SOCKETS).perturb(0.8, 6)
    model, inputs = hidup.models.build("bert-sgmoe", world_size=4, device="meta", layers=1)
    cm = CostModel(trace(model, inputs, world_size=4), prof)
    nb = 9437184.0
    assert cm.comm("all_reduce", nb) == pytest.approx(prof.fitted().comm_time("all_reduce", 4, nb))
    assert cm.comm("all_reduce", nb) != pytest.approx(prof.comm_time("all_reduce", 4, nb), rel=0.05)


def test_duplicated_dp_finds_the_duplicated_optimum():
    """BERT-SGMoE on 4 H200s over sockets: the duplicated DP alone reaches the plan that the
    no-duplication choices give with duplication (a Pareto cap of 4 points per state lost it)."""
    model, inputs = hidup.models.build("bert-sgmoe", world_size=4, device="meta")
    problem = Problem(trace(model, inputs, world_size=4), P.load(SOCKETS), "fp32")
    ks_plain, _ = dp.solve(problem, False)
    ks_dup, est = dp.solve(problem, True)
    assert evaluate(problem, ks_dup, True).objective == pytest.approx(est)
    assert est <= evaluate(problem, ks_plain, True).objective * (1 + 1e-9)


# ------------------------------------------------------------------------------------------ all-to-all
def _a2a_times(tabs, fit, i):
    """(measured, fitted) net all-to-all time at size index i."""
    return SIZES[i] / tabs["all_to_all"][4].algbw[i], SIZES[i] / fit["all_to_all"][4].algbw[i]


def test_all_to_all_that_follows_its_link_is_unchanged():
    """An all-to-all whose shape along the sizes follows the ring link (a monotone curve here), or
    departs from it by less than the all-to-all tolerance, is kept exactly as measured."""
    tabs = _link_tables()
    assert fit_ring_tables(tabs)["all_to_all"][4].algbw == tabs["all_to_all"][4].algbw
    a2a = tabs["all_to_all"][4]
    wobble = [1.0, 1.5, 1.25, 0.8, 1.05]  # 1 MiB to 256 MiB within exp(0.3) of their median ratio
    tabs["all_to_all"][4] = CommTable(a2a.alpha, list(SIZES), [b * w for b, w in zip(a2a.algbw, wobble)])
    assert fit_ring_tables(tabs)["all_to_all"][4].algbw == tabs["all_to_all"][4].algbw


@pytest.mark.parametrize("i,factor", [(2, 0.25), (3, 0.25), (4, 0.25), (3, 4.0), (4, 4.0)])
def test_single_wrong_all_to_all_entry_is_pulled_back(i, factor):
    """One all-to-all entry 4x too slow or too fast, at any bandwidth-bound size (1, 16, 256 MiB):
    the fit brings it to the all-to-all tolerance of what the link's shape predicts; the other
    entries stay as measured; the ring tables are not touched by it."""
    clean = _link_tables()
    bad = _link_tables()
    a2a = bad["all_to_all"][4]
    bad["all_to_all"][4] = CommTable(
        a2a.alpha, list(SIZES), [b * (factor if j == i else 1.0) for j, b in enumerate(a2a.algbw)]
    )
    fit = fit_ring_tables(bad)
    true_t, _ = _a2a_times(clean, clean, i)
    raw_t, fit_t = _a2a_times(bad, fit, i)
    assert raw_t == pytest.approx(true_t / factor)
    assert fit_t == pytest.approx(true_t * math.exp(math.copysign(A2A_TOLERANCE, raw_t - true_t)))
    for j in set(range(len(SIZES))) - {i}:
        assert fit["all_to_all"][4].algbw[j] == bad["all_to_all"][4].algbw[j]
    for c in RING_LINK:
        assert fit[c][4].algbw == fit_ring_tables(clean)[c][4].algbw
    # turned off: as measured
    assert fit_ring_tables(bad, a2a_tolerance=math.inf)["all_to_all"][4].algbw == bad["all_to_all"][4].algbw


def test_all_to_all_check_needs_three_bandwidth_bound_sizes():
    """With only 16 and 256 MiB bandwidth-bound (a large latency, as on NVLink), two entries cannot
    say which of them is wrong: the all-to-all stays as measured."""
    tabs = _link_tables(alpha=2e-3)
    a2a = tabs["all_to_all"][4]
    tabs["all_to_all"][4] = CommTable(
        a2a.alpha, list(SIZES), [b * (0.25 if j == 3 else 1.0) for j, b in enumerate(a2a.algbw)]
    )
    assert fit_ring_tables(tabs)["all_to_all"][4].algbw == tabs["all_to_all"][4].algbw
    with pytest.raises(ValueError):
        fit_ring_tables(tabs, a2a_tolerance=-0.1)
    with pytest.raises(ValueError):
        fit_all_to_all(a2a, [0.0] * len(SIZES), [1.0] * len(SIZES), tolerance=-1.0)


def _ring_only(monkeypatch):
    """Make Profile.fitted leave all-to-all as measured (the fit before the all-to-all check)."""
    fitted = Profile.fitted
    monkeypatch.setattr(
        Profile,
        "fitted",
        lambda self, tolerance=RING_TOLERANCE, a2a_tolerance=math.inf: fitted(self, tolerance, math.inf),
    )


def _moe_graph():
    model, inputs = hidup.models.build("bert-sgmoe", world_size=4, device="meta", layers=2)
    return trace(model, inputs, world_size=4)


@pytest.mark.parametrize("name", [str(SOCKETS), "h200x4-socket", "h200x4-nvlink"])
def test_measured_profiles_keep_all_to_all_and_the_clean_plan(name, monkeypatch):
    """On the measured sockets profile and the builtins, the all-to-all check moves no entry, and the
    clean plan and its prediction are those of the ring-only fit (well under 1 %)."""
    from hidup.search import search

    prof = P.load(name)
    for g, tab in prof.collectives["all_to_all"].items():
        assert prof.fitted().collectives["all_to_all"][g].algbw == tab.algbw
    graph = _moe_graph()
    plan = search(graph, prof, world_size=4, algorithm="dp", duplication=True)
    problem = Problem(graph, prof)
    ks = [problem.sigs[i].index(plan.choices[n.name]) for i, n in enumerate(problem.order)]
    t_new = evaluate(problem, ks, True).total
    _ring_only(monkeypatch)
    assert search(graph, prof, world_size=4, algorithm="dp", duplication=True).choices == plan.choices
    assert evaluate(Problem(graph, prof), ks, True).total == pytest.approx(t_new, rel=0.01)


def test_one_wrong_all_to_all_entry_no_longer_changes_the_moe_plan(monkeypatch):
    """BERT-SGMoE (2 layers) on the measured sockets profile with its 256 MiB all-to-all entry 4x too
    slow: the ring-only fit takes it at its word and changes the plan (the MoE dispatch); with the
    all-to-all checked against the link the search keeps the clean plan."""
    from hidup.search import search

    prof = P.load(SOCKETS)
    a2a = prof.collectives["all_to_all"][4]
    bad = copy.copy(prof)
    bad.collectives = {c: dict(t) for c, t in prof.collectives.items()}
    bad.collectives["all_to_all"][4] = CommTable(a2a.alpha, list(a2a.sizes), a2a.algbw[:-1] + [a2a.algbw[-1] / 4])
    graph = _moe_graph()
    clean_plan = search(graph, prof, world_size=4, algorithm="dp", duplication=True)
    assert search(graph, bad, world_size=4, algorithm="dp", duplication=True).choices == clean_plan.choices
    _ring_only(monkeypatch)
    assert search(graph, prof, world_size=4, algorithm="dp", duplication=True).choices == clean_plan.choices
    assert search(graph, bad, world_size=4, algorithm="dp", duplication=True).choices != clean_plan.choices


def _table_of_times(alpha, times):
    """A table whose measured call times at SIZES are ``times`` (algbw net of alpha)."""
    return CommTable(alpha, list(SIZES), [s / max(t - alpha, 1e-12) for s, t in zip(SIZES, times)])


def test_interpolated_time_stays_between_measured_neighbours():
    # NVLink all-to-all over 4 ranks as measured: every size up to 16 MiB is all latency, so the
    # net bandwidth at 16 MiB is near infinite; 256 MiB took 209 us.
    alpha = 33.9e-6
    tab = _table_of_times(alpha, [alpha, alpha, alpha, alpha + 0.07e-6, 209.2e-6])
    s = 120e6
    raw = alpha + s / tab.bandwidth(s)  # the log-size interpolation of the net bandwidth alone
    assert raw < 40e-6
    t = tab.time(s)
    assert t == pytest.approx(209.2e-6 * s / SIZES[-1])  # no less time per byte than 256 MiB took
    assert tab.time(SIZES[3]) <= t <= tab.time(SIZES[4])
    # the profile prices it the same way, and its bandwidth agrees with its time
    prof = Profile(name="t", flops={"fp32": 1e12}, collectives={"all_to_all": {4: tab}})
    assert prof.comm_time("all_to_all", 4, s) == pytest.approx(t)
    assert prof.comm_time("all_to_all", 4, s) == pytest.approx(alpha + s / prof.bandwidth("all_to_all", 4, s))
    # monotone over the whole range
    grid = [2 ** (k / 4) for k in range(40, 116)]
    times = [tab.time(x) for x in grid]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:]))


def test_well_conditioned_tables_interpolate_as_before():
    alpha, link = 4e-5, (5e8, 2e9, 4e9, 6e9, 6.5e9)  # bandwidth ramping up with size
    tab = CommTable(alpha, list(SIZES), list(link))
    for s in [10e3, 300e3, 4e6, 100e6]:
        assert tab.time(s) == pytest.approx(alpha + s / tab.bandwidth(s), rel=1e-12)


def test_a_dipping_curve_keeps_only_the_bound_it_obeys():
    # 256 MiB is slower per byte than 16 MiB (measured: NVLink all-reduce over 2 ranks); only the
    # monotone-time bound applies between them, so the interpolation is kept as long as it lies in it
    alpha = 23.6e-6
    tab = _table_of_times(alpha, [23.7e-6, 23.7e-6, 26.8e-6, 74.8e-6, 2259.5e-6])
    for s in [20e6, 64e6, 200e6]:
        t = tab.time(s)
        assert tab.time(SIZES[3]) <= t <= tab.time(SIZES[4])
        assert t == pytest.approx(alpha + s / tab.bandwidth(s), rel=1e-12)
