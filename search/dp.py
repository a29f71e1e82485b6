"""HiDup's dynamic program over the nodes in (search) order.

Recurrence
----------
A DP state before position ``i`` is the state of every live tensor, ``(produced form, converted
forms)`` (:mod:`hidup.search.problem`); its key is the tuple of those pairs in the fixed live order
of position ``i`` (canonical: equal situations have equal keys).  Each state holds a Pareto set of
points; a transition picks a signature ``k`` for the node at ``i``, pays the conversions its inputs
need, and maps every point ``p`` to ``apply(p, step)``:

* without duplication a point is ``(time,)`` and ``apply`` adds ``step.fwd + step.bwd``; the set
  has one point (the minimum), so the DP is the exact shortest path over states, equal to
  enumerating every assignment (:func:`hidup.search.brute.brute_force`);
* with duplication a point is ``(T_f, d_f, -s_f, T_b, d_b, -s_b)``: forward and backward
  ``(time, debt, slack)`` of :mod:`hidup.search.schedule`, and ``apply`` runs that recurrence.
  Whatever follows, the final time of a pass is ``T`` plus a function of ``(d, s)`` that grows by at
  most ``x`` when ``d`` grows by ``x`` or ``s`` shrinks by ``x`` (:mod:`hidup.search.schedule`).  So
  ``a`` is never worse than ``b`` in the same state when ``(T_a - T_b) + max(0, d_a - d_b) +
  max(0, s_b - s_a)``, summed over both passes, is at most 0 (implied by componentwise ``a <= b``);
  such dominated points are dropped without loss;
* with a memory budget every point also carries its memory (an additive coordinate), and a point is
  dropped once ``memory + (least memory the remaining positions can use) > budget``.  That DP runs
  only when the budget binds: :func:`solve` first searches without it and keeps the result when it
  fits (the fastest plan that fits is then the fastest plan within the budget).  On large graphs the
  budget is met by pricing memory instead ("A memory budget by its price", below).

The answer is the point at the last position with the least ``time`` (``T_f + d_f + T_b + d_b``).

A memory budget by its price
----------------------------
The memory-aware DP's points carry memory as one more coordinate, so every state keeps a Pareto set
of (time, memory) points, and with duplication of seven-entry points: on the graphs of large models
with a beam it is the dearest search there is (an 8x8 Mixtral under 80 GB: 26-35 s a pass, against
1-5 s without the budget).  Memory is additive over the positions (``problem.mem``), so pricing it
is the Lagrangian relaxation of the budget: the DP without a memory coordinate, every transition's
time raised by ``price * memory``, finds the plan of least ``time + price * memory``; that plan is
the fastest of all plans that use no more memory than it does, and ``value - price * budget`` is a
lower bound of the fastest plan within the budget (exactly so without a beam and without
duplication).  :func:`_solve_by_price` raises the price from ``PRICE_START`` of the plan's time per
excess byte by ``PRICE_FACTOR`` until the plan fits, then bisects it (geometrically) between a price
that misses and one that meets the budget, keeping the fastest plan that fits, until the prices are
within ``PRICE_RATIO`` of each other, the plan is within ``PRICE_GAP`` of the bound, or
``PRICE_STEPS`` bisections are done: about 4-8 passes, each with the transition caches already
filled.  It finds only plans on the lower convex hull of (memory, time), so a plan below the hull
that fits a budget between two of its corners is missed (the budget is met with memory to spare);
the memory-aware DP finds it.  The price is used where the DP already is a beam search on a large
graph (``PRICE_MIN_POSITIONS``); smaller graphs and exact searches keep the memory-aware DP.

Speed
-----
* Transitions are cached per (position, signature, states of the node's inputs), and the list of
  feasible transitions per (position, state) (:meth:`Problem.transitions`), shared by both passes,
  by the positions that transition alike (the same op of identical layers) and by the problems of
  one search priced by one cost model (:meth:`hidup.search.problem.Models.caches`: the mesh search's
  steps, the sets of recomputed layers, resharding on and off).
* Under a memory budget the node step is generated too (one function per pass, the duplicated
  recurrence inlined beside the memory entry and the budget test), and a ``(time, memory)`` Pareto
  set is one pass over the points sorted by time, keeping each that uses less memory than every
  point before it.
* A front stores each point with its predicted time, so sorting and ranking use no Python key.
* The cyclic garbage collector is paused while the DP runs (it allocates no cycles, and full
  collections over a large heap cost as much as the search).
* Cross-state dominance: a state is dropped when a cheaper state stays cheaper even after paying
  every conversion it might need that the other would not, summed over the tensors whose states
  differ (:meth:`_DP.cross_prune`; exact without duplication, where it runs once a position has
  more than 8 states; with duplication a heuristic, run only when the beam would cut anyway).  With a
  beam it compares only the ``CROSS_PRUNE_SPAN`` times the beam's width fastest states (the
  comparison is quadratic in the states; on a mesh a position reaches thousands).
* ``max_points`` caps each Pareto set (keeping the points of least predicted time) and
  ``max_states`` caps the number of states after each position (keeping those whose best point is
  fastest): a beam.  ``None`` means unlimited (exact, as the tests against enumeration use); the
  defaults (16 points; ``"auto"`` states, :func:`beam_width`: 128 on graphs of up to 1024
  positions, fewer on larger ones) trade exactness for speed.  With a memory budget the point of
  least memory of each state is always kept.
* Repeated layers (:mod:`hidup.search.segments`): for an occurrence of a repeated block the DP looks
  up, per state of the block's external inputs, a table of reachable exit states with their
  candidate sub-plans, computed once per (block type, entry state) by running this same DP over
  the first occurrence from that entry.  A candidate carries its additive cost (no duplication; the
  table then holds the exact best per exit) or its compressed stage list (duplication; the Pareto
  points of the block solved from a zero state, re-applied to each incoming point).  Each new entry
  state costs one solve of the block, while running the occurrence position by position costs
  about one pass whatever the entries: an occurrence reached in more than ``NEW_TABLES_PER_PASS``
  entry states without a table is run position by position (ATen graphs reach a block in hundreds
  of states: a 4-layer Llama built 303 tables in 275 s, against 3.6 s for the plain pass, and both
  found the same plan), unless its entry states are those of the block's previous occurrence (the
  layers have reached a steady state, and the tables built now serve every later occurrence) and
  they are no more than the occurrences left.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hidup.search.ilp import CBC_FIX, CbcMissing, min_memory
from hidup.search.problem import LazySearchError, Problem, SearchError
from hidup.search.schedule import compress_steps, dup_apply_stages, generate, recurrence_source
from hidup.search.segments import Occurrence, find_blocks

__all__ = ["solve", "Beam", "Beaten", "DEFAULT_BEAM", "DEFAULT_MAX_STATES", "DEFAULT_MAX_POINTS"]

DEFAULT_MAX_STATES = "auto"  # beam_width(positions)
# with a beam, cross-state pruning compares at most this many times the beam's width of the fastest
# states (the comparison is quadratic; the states beyond are those the beam would drop first)
CROSS_PRUNE_SPAN = 4
DEFAULT_MAX_POINTS = 16  # 4 lost the duplicated optimum of bert-sgmoe on 4 H200s over sockets (3% slower);
# 16 finds it and costs 2-8% more search time on the zoo
BEAM_STATES = 128  # the beam on graphs of up to BEAM_WORK / BEAM_STATES positions
BEAM_WORK = 131072  # states x positions above that size (an 8B-parameter ATen graph: 2455 positions, 53 states)
BEAM_MIN_STATES = 32
NEW_TABLES_PER_PASS = 2  # a repeated block is solved from this many new entry states for the cost of one pass
# a budget by its price (module docstring): where, and how the price is searched
PRICE_MIN_POSITIONS = 1024  # with a beam, graphs of this many positions or more
PRICE_START = 0.05  # the first price: this share of the plan's time for its bytes over the budget
PRICE_FACTOR = 4.0  # the price grows by this factor until the plan fits
PRICE_RAISES = 12  # at most this many raises (4**12: from 5% to 800 000 times the time)
PRICE_STEPS = 4  # then at most this many bisections of the price (geometric)
PRICE_RATIO = 1.2  # ... until the price that fits is within this factor of the one that does not
PRICE_GAP = 0.005  # ... or the plan is within this share of the Lagrangian bound
# ``(problem, here, there) -> (here(), there())`` with ``there`` run in a forked child, or None where no core
# is spare (then nothing has run): set by :mod:`hidup.search.modes`, which forks (and imports this module)
PASSES_BESIDE: Callable[[Problem, Callable, Callable], tuple | None] | None = None


def beam_width(positions: int) -> int:
    """The default beam (``max_states="auto"``): ``BEAM_STATES`` states per position on graphs of
    up to ``BEAM_WORK / BEAM_STATES`` positions, then fewer, so that states x positions, which the
    search time follows, stays about ``BEAM_WORK``; never below ``BEAM_MIN_STATES``.  On the zoo's
    small graphs 48-64 states lose up to 15% of predicted time on the slow-network profile; on the
    2455-2615-position graphs of Llama-3-8B / Mixtral-8x7B shapes 32-128 states find plans within
    0.02% of each other (docs/search_time.md)."""
    return max(BEAM_MIN_STATES, min(BEAM_STATES, BEAM_WORK // max(1, positions)))


@contextmanager
def no_gc():
    """Pause the cyclic garbage collector: the search allocates many small tuples and no cycles,
    and with a large heap (a traced model) the collector's full passes cost as much as the search."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _first(x):
    return x[0]


def _first_est(item):
    """Sort key of a (state key, front) pair: the estimate of the front's best point."""
    return item[1][0][0]


def _dominator(dims: int, duplication: bool):
    """A fast "point ``a`` is never worse than point ``b``" test for tuples of ``dims`` entries.

    Without duplication: ``a <= b`` componentwise.  With duplication (module docstring): the summed
    ``T`` gap of both passes plus every excess of ``a``'s debt and minus-slack over ``b``'s is at most
    zero, and (with a memory coordinate) ``a`` uses no more memory."""
    if not duplication:
        body = " and ".join(f"a[{i}] <= b[{i}]" for i in range(dims))
    else:
        gap = "(a[0] - b[0]) + (a[3] - b[3])" + "".join(f" + max(0.0, a[{i}] - b[{i}])" for i in (1, 2, 4, 5))
        body = f"{gap} <= 0.0" + (" and a[6] <= b[6]" if dims == 7 else "")
    return eval(f"lambda a, b: {body}")  # noqa: S307 -- generated from integers only


# The duplicated recurrence of both passes, inlined from its one statement in
# :mod:`hidup.search.schedule` (a call per point and pass would double the search time).
_dup_apply_both = generate(
    "_dup_apply_both",
    (
        "def _dup_apply_both(v, fwd_item, bwd_item):\n"
        "    T, d, ns, T2, d2, ns2 = v[:6]\n"
        "    mA, mB, cA, cB = fwd_item\n"
        + recurrence_source(4)
        + "    mA, mB, cA, cB = bwd_item\n"
        + recurrence_source(4, "T2", "d2", "ns2")
        + "    return (T, d, ns, T2, d2, ns2)\n"
    ),
)


def _dup_step_source(name: str, memory: bool, priced: bool = False) -> str:
    """Source of node_step with duplication: every point of every state through every transition,
    into ``new`` (buckets of (estimate, point, trace)); the forward and backward items are unpacked
    once per transition.  With ``memory`` every point carries its memory as a seventh entry, and a
    point is dropped once its memory plus ``mem_floor`` (the least the positions after it can use)
    exceeds ``budget``.  With ``priced`` the transition's memory times ``price`` (seconds per byte,
    module docstring, "A memory budget by its price") is added to the forward pass's time."""
    m = ", m" if memory else ""
    T = "T + lm" if priced else "T"
    return (
        f"def {name}(states, trans, i, new"
        + (", mem_floor, budget" if memory else "")
        + (", price" if priced else "")
        + "):\n"
        "    get = new.get\n"
        "    for key, front in states.items():\n"
        "        for k, step, nkey in trans(i, key):\n"
        "            bucket = get(nkey)\n"
        "            if bucket is None:\n"
        "                bucket = new[nkey] = []\n"
        "            app = bucket.append\n"
        "            fmA, fmB, fcA, fcB = step.fwd_item\n"
        "            bmA, bmB, bcA, bcB = step.bwd_item\n"
        "            fcomm = fmA > 0.0 or fmB > 0.0\n"
        "            bcomm = bmA > 0.0 or bmB > 0.0\n"
        + ("            smem = step.mem\n" if memory else "")
        + ("            lm = price * step.mem\n" if priced else "")
        + f"            for _, (T, d, ns, T2, d2, ns2{m}), tr in front:\n"
        + (
            "                m = m + smem\n                if m + mem_floor > budget:\n                    continue\n"
            if memory
            else ""
        )
        + recurrence_source(16, item="fmA fmB fcA fcB", opens="fcomm")
        + recurrence_source(16, "T2", "d2", "ns2", item="bmA bmB bcA bcB", opens="bcomm")
        + f"                app(({T} + d + T2 + d2, ({T}, d, ns, T2, d2, ns2{m}), (tr, i, k)))\n"
    )


_dup_node_step = generate("_dup_node_step", _dup_step_source("_dup_node_step", memory=False))
_dup_mem_node_step = generate("_dup_mem_node_step", _dup_step_source("_dup_mem_node_step", memory=True))
_dup_priced_node_step = generate(
    "_dup_priced_node_step", _dup_step_source("_dup_priced_node_step", memory=False, priced=True)
)


def _mem_node_step(states: dict, trans, i: int, new: dict, mem_floor: float, budget: float, hide: float) -> None:
    """node_step without duplication under a memory budget: points ``(time, memory)``, a point dropped
    once its memory plus ``mem_floor`` exceeds ``budget``; ``hide`` (1 or 0) leaves out the gradient
    all-reduces as :meth:`_DP.apply_step` does."""
    get = new.get
    for key, front in states.items():
        for k, step, nkey in trans(i, key):
            bucket = get(nkey)
            if bucket is None:
                bucket = new[nkey] = []
            app = bucket.append
            fwd, bwd, smem, hidden = step.fwd, step.bwd, step.mem, hide * step.bwd_async
            for _, (t, m), tr in front:
                m = m + smem
                if m + mem_floor > budget:
                    continue
                t = t + fwd + bwd - hidden
                app((t, (t, m), (tr, i, k)))


def _budget_message(problem: Problem, budget: float, i: int, max_states, max_points) -> str:
    """Why the memory-aware DP ran out of plans at position ``i``: no plan fits (and the least memory
    any plan needs), or the beam dropped the plans that do.  The least memory is the ILP's
    (:func:`~hidup.search.ilp.min_memory`), except where every node's leanest term already exceeds the
    budget on a graph of ``PRICE_MIN_POSITIONS`` positions or more: no plan fits, and that sum, a lower
    bound, is said instead (the ILP over a large model's graph takes longer than the search)."""
    node = problem.order[i]
    lower = problem.min_mem_suffix[0]
    if lower > budget and problem.n >= PRICE_MIN_POSITIONS:
        return (
            f"no plan fits the memory budget of {budget:.6g} bytes ({budget / 2**30:.3f} GiB) per rank (the "
            f"search ran out of plans at node {node.name}); the least memory any plan needs is at least "
            f"{lower:.6g} bytes ({lower / 2**30:.3f} GiB), each node's leanest signature. Fix: raise the "
            "budget to at least that, or use more ranks."
        )
    try:
        need = min_memory(problem)
    except CbcMissing:  # no CBC to compute the least memory: say what is known
        return (
            f"no plan the DP kept fits the memory budget of {budget:.6g} bytes "
            f"({budget / 2**30:.3f} GiB) per rank (it ran out of plans at node "
            f"{node.name}); whether any plan fits is unknown, since the least memory "
            f"is found by the ILP solver CBC, which python-mip could not load. Fix: raise "
            f"the budget or use more ranks; to know the least memory, {CBC_FIX}."
        )
    if need <= budget:
        return (
            f"plans within the memory budget of {budget:.6g} bytes exist (the least "
            f"needs {need:.6g} bytes) but the DP's beam (max_states={max_states}, "
            f"max_points={max_points}) dropped them at node {node.name}. Fix: use "
            "algorithm='ilp', or max_states=None / a larger max_points."
        )
    return (
        f"no plan fits the memory budget of {budget:.6g} bytes ({budget / 2**30:.3f} "
        f"GiB) per rank (the search ran out of plans at node {node.name}); the least memory "
        f"any plan needs is {need:.6g} bytes ({need / 2**30:.3f} GiB). Fix: raise the budget "
        "to at least that, or use more ranks."
    )


class _DP:
    def __init__(
        self,
        problem: Problem,
        duplication: bool,
        memory_budget: float | None,
        max_states: int | str | None,
        max_points: int | None,
        hide_grad_sync: bool = False,
        memory_price: float = 0.0,
    ):
        self.p, self.dup, self.budget = problem, duplication, memory_budget
        self.price = memory_price  # seconds per byte added to every transition (module docstring)
        if memory_price and memory_budget is not None:
            raise ValueError("_DP: a memory price and a memory budget are two ways to the same end; pass one")
        self.hide = 1.0 if hide_grad_sync and not duplication else 0.0
        self.max_states = beam_width(problem.n) if max_states == "auto" else max_states
        self.max_points = max_points
        self.has_mem = memory_budget is not None
        self.single = not duplication and not self.has_mem  # node_step keeps one point per state
        self.zero = (0.0,) * ((6 if duplication else 1) + (1 if self.has_mem else 0))
        self.dominates = _dominator(len(self.zero), duplication)
        self.tables: dict[tuple, list] = {}
        self.reps: dict[int, Occurrence] = {}
        self.last_entries: dict[int, frozenset] = {}  # block type -> entry states of its last occurrence

    # ---------------------------------------------------------------------------- point algebra
    # A front is a list of entries ``(est(point), point, trace)``: the estimate is stored so that
    # sorting and ranking need no Python-level key function.
    def est(self, v: tuple) -> float:
        return v[0] + v[1] + v[3] + v[4] if self.dup else v[0]

    def apply_step(self, v: tuple, step) -> tuple:
        if self.dup:
            out = _dup_apply_both(v, step.fwd_item, step.bwd_item)
            if self.price:
                out = (out[0] + self.price * step.mem, *out[1:])
        else:
            out = (v[0] + step.fwd + step.bwd - self.hide * step.bwd_async + self.price * step.mem,)
        return out + (v[-1] + step.mem,) if self.has_mem else out

    def apply_cand(self, v: tuple, cand) -> tuple:
        if self.dup:
            sf, sb, mem = cand
            out = dup_apply_stages(v[0], v[1], v[2], sf) + dup_apply_stages(v[3], v[4], v[5], sb)
            if self.price:  # the stages are the block's plain items: its memory's price comes on top
                out = (out[0] + self.price * mem, *out[1:])
        else:
            cost, mem = cand
            out = (v[0] + cost,)
        return out + (v[-1] + mem,) if self.has_mem else out

    def finalize(self, bucket: list) -> list:
        """The Pareto set of a bucket of (est, point, trace), at most ``max_points`` of least time.

        Sorted by predicted time, a point can only be dominated by one before it (domination
        implies no more time), so one pass keeps exactly the first non-dominated points."""
        if len(bucket) <= 1:
            return bucket
        if len(bucket[0][1]) == 1:
            return [min(bucket, key=_first)]
        bucket.sort(key=_first)
        kept: list = []
        cap = self.max_points or len(bucket)
        if self.dup:  # the dominance test inlined (with a memory coordinate: u[6] <= v[6] too)
            with_mem = self.has_mem
            for x in bucket:
                v0, v1, v2, v3, v4, v5 = x[1][:6]
                v6 = x[1][6] if with_mem else 0.0
                for _, u, _ in kept:  # self.dominates(u, v), inlined
                    if with_mem and u[6] > v6:
                        continue
                    gap = (u[0] - v0) + (u[3] - v3)
                    w = u[1] - v1
                    if w > 0.0:
                        gap += w
                    w = u[2] - v2
                    if w > 0.0:
                        gap += w
                    w = u[4] - v4
                    if w > 0.0:
                        gap += w
                    w = u[5] - v5
                    if w > 0.0:
                        gap += w
                    if gap <= 0.0:
                        break
                else:
                    kept.append(x)
                    if len(kept) >= cap:
                        break
            return self._keep_leanest(bucket, kept, cap)
        if len(bucket[0][1]) == 2:  # (time, memory), sorted by time: dominated iff a kept point uses no more memory
            least = None
            for x in bucket:
                m = x[1][1]
                if least is None or m < least:
                    least = m
                    kept.append(x)
                    if len(kept) >= cap:
                        break
            return self._keep_leanest(bucket, kept, cap)
        dom = self.dominates
        for x in bucket:
            v = x[1]
            for _, u, _ in kept:
                if dom(u, v):
                    break
            else:
                kept.append(x)
                if len(kept) >= cap:
                    break
        return self._keep_leanest(bucket, kept, cap)

    def _keep_leanest(self, bucket: list, kept: list, cap: int) -> list:
        """``kept``, with the point of least memory in place of its last when the cap cut it, so
        that a tight budget is not lost to the cap."""
        if self.has_mem and len(kept) >= cap and len(bucket) > cap:
            lean = min(bucket, key=lambda x: (x[1][-1], x[0]))
            if not any(lean is x for x in kept):
                kept[-1] = lean
        return kept

    def prune(self, states: dict, pos: int, single: bool = False) -> dict:
        """The states after position ``pos``: Pareto sets finalized, cross-state pruning, the beam.
        ``single``: every bucket holds one point already (node_step without duplication or memory).

        The states are ranked by estimate (a stable sort) at most once: the span cut keeps a prefix of
        the ranking, which is then the ranking of what it kept, and a dict cross_prune returns in ranked
        order is its own ranking; each cut keeps the order the states had before it."""
        if self.dup or self.has_mem:
            fin = self.finalize
            states = {k: fin(b) for k, b in states.items() if b}
        # else: node_step keeps one point per state already; block_step's buckets still need it
        elif not single and any(len(b) != 1 for b in states.values()):
            states = {k: [min(b, key=_first)] for k, b in states.items() if b}
        beam_cuts = bool(self.max_states) and len(states) > self.max_states
        ranked = None  # states.items() sorted by estimate, when known
        if not self.has_mem and (len(states) > 8 if not self.dup else beam_cuts):
            if self.max_states and len(states) > CROSS_PRUNE_SPAN * self.max_states:
                # the comparison is quadratic: with a beam, only the fastest states take part
                ranked = sorted(states.items(), key=_first_est)[: CROSS_PRUNE_SPAN * self.max_states]
                keep = {k for k, _ in ranked}
                states = {k: f for k, f in states.items() if k in keep}
            states, ranked = self.cross_prune(states, pos, ranked)
        if self.max_states and len(states) > self.max_states:
            if ranked is None:
                ranked = sorted(states.items(), key=_first_est)
            keep = {k for k, _ in ranked[: self.max_states]}
            states = {k: f for k, f in states.items() if k in keep}
        return states

    def cross_prune(self, states: dict, pos: int, ranked: list | None = None) -> tuple[dict, list]:
        """Drop state B when a cheaper state A reaches every future of B for less:
        ``time(A) + sum_j penalty_j(A_j, B_j) <= time(B)``, the sum over the tensors whose states
        differ, ``penalty_j`` bounding the extra conversions tensor ``j`` in A's state may cost the
        future (:meth:`Problem.penalties`; conversions of different tensors add).  Exact without
        duplication; with duplication a heuristic, used only together with the beam.

        States are ranked by time and each B is compared with every state A ranked before it.  A
        dropped A needs no exception: the penalty obeys the triangle inequality (each form's
        ``max(0, cost_C - cost_B) <= max(0, cost_C - cost_A) + max(0, cost_A - cost_B)``), so the
        kept state that dropped A also drops B.  The penalty sums are one matrix per position,
        assembled from one small matrix per tensor (its distinct states squared).

        ``ranked``: ``states.items()`` sorted by estimate (stable), if known.  Returns the states kept
        (in the order of ``states`` when none is dropped, else in ranked order) and their ranking."""
        if ranked is None:
            ranked = sorted(states.items(), key=_first_est)
        n = len(ranked)
        total = None
        for j, column in enumerate(zip(*(key for key, _ in ranked))):
            if column.count(column[0]) == n:  # every state holds tensor j alike
                continue
            distinct = list(dict.fromkeys(column))  # in order of first appearance
            index = dict(zip(distinct, range(len(distinct))))
            pen = self.p.penalties(pos, j, distinct)
            idx = np.fromiter(map(index.__getitem__, column), np.intp, n)
            part = pen[idx][:, idx]  # (rows, then columns: several times faster than one 2-d fancy index)
            if total is None:
                total = part  # a new array, added to in place below
            else:
                total += part
        if total is None:
            return states, ranked
        time = np.fromiter((front[0][0] for _, front in ranked), float, n)
        beaten = np.triu((time[:, None] + total) <= time[None, :], 1).any(axis=0)
        if not beaten.any():
            return states, ranked
        ranked = [item for item, dead in zip(ranked, beaten.tolist()) if not dead]
        return dict(ranked), ranked

    # ---------------------------------------------------------------------------- transitions
    def node_step(self, states: dict, i: int, mem_floor: float) -> dict:
        trans = self.p.transitions
        new: dict = {}
        get = new.get
        if self.has_mem:
            if self.dup:
                _dup_mem_node_step(states, trans, i, new, mem_floor, self.budget)
            else:
                _mem_node_step(states, trans, i, new, mem_floor, self.budget, self.hide)
        elif not self.dup:  # one point per state: keep the cheapest per new key (the first on ties)
            hide, price = self.hide, self.price
            for key, front in states.items():
                e, _, tr = front[0]
                for k, step, nkey in trans(i, key):
                    t = e + step.fwd + step.bwd - hide * step.bwd_async + price * step.mem
                    old = get(nkey)
                    if old is None or t < old[0][0]:
                        new[nkey] = [(t, (t,), (tr, i, k))]
        elif self.price:
            _dup_priced_node_step(states, trans, i, new, self.price)
        else:
            _dup_node_step(states, trans, i, new)
        return new

    def run_positions(
        self, states: dict, start: int, end: int, mem_floor_of: Callable[[int], float], progress=None
    ) -> dict:
        for i in range(start, end):
            states = self.prune(self.node_step(states, i, mem_floor_of(i + 1)), i + 1, self.single)
            if not states:
                raise self.infeasible(i)
            if progress:
                progress(i)
        return states

    def infeasible(self, i: int) -> SearchError:
        """The error of running out of states at position ``i``; under a budget its message (which
        solves an ILP for the least memory) is worked out only when read, and holds no DP state."""
        p, budget, max_states, max_points = self.p, self.budget, self.max_states, self.max_points
        if self.has_mem:
            p.drop_caches()
            return LazySearchError(lambda: _budget_message(p, budget, i, max_states, max_points))
        node = p.order[i]
        return SearchError(
            f"no feasible signature combination reaches node {node.name} ({node.target}); every "
            "signature needs a form change that cannot be made. Fix: check the node's signatures "
            "or the restriction."
        )

    # ---------------------------------------------------------------------------- blocks
    def table(self, occ: Occurrence, entry: tuple) -> list:
        tkey = (occ.type, entry)
        if tkey in self.tables:
            return self.tables[tkey]
        p = self.p
        rep = self.reps[occ.type]
        key = [(-1, 0)] * len(p.live[rep.start])
        for j, st in zip(rep.ext_idx, entry):
            key[j] = st
        block_min = p.min_mem_suffix[rep.start] - p.min_mem_suffix[rep.end]
        outside_min = p.min_mem_suffix[0] - block_min
        states = {tuple(key): [(0.0, self.zero, None)]}
        states = self.run_positions(
            states, rep.start, rep.end, lambda i: outside_min + p.min_mem_suffix[i] - p.min_mem_suffix[rep.end]
        )
        li = p.live_index[rep.end]
        out = []
        for nkey, front in states.items():
            exit_sub = tuple(nkey[li[t]] for t in rep.exit_tensors)
            cands = []
            for _, v, tr in front:
                ks = []
                while tr is not None:
                    tr, _, k = tr
                    ks.append(k)
                ks.reverse()
                if self.dup:
                    fwd_items, bwd_items, mem = [], [], 0.0
                    skey = tuple(key)
                    for r, k in enumerate(ks):
                        step, skey = p.step(rep.start + r, k, skey)
                        fwd_items.append(step.fwd_item)
                        bwd_items.append(step.bwd_item)
                        mem += step.mem  # the kept copies of parameters included
                    cands.append(((compress_steps(fwd_items), compress_steps(bwd_items), mem), tuple(ks)))
                else:  # the memory is read only with a memory coordinate (the price is in v[0] already)
                    cands.append(((v[0], v[-1] if self.has_mem else 0.0), tuple(ks)))
            out.append((exit_sub, cands))
        self.tables[tkey] = out
        return out

    def tables_pay(self, states: dict, occ: Occurrence, later: int) -> bool:
        """Whether the block's tables cost less than running ``occ`` position by position: at most
        ``NEW_TABLES_PER_PASS`` of the entry states of ``states`` have no table yet; or the entry
        states are those of the previous occurrence of the block (a steady state, in which every
        table built now serves each of the ``later`` occurrences of the block too) and there are no
        more new ones than occurrences left to serve (each new table costs about one pass)."""
        entries = frozenset(tuple(key[j] for j in occ.ext_idx) for key in states)
        steady = self.last_entries.get(occ.type) == entries
        self.last_entries[occ.type] = entries
        new = sum((occ.type, e) not in self.tables for e in entries)
        return new <= NEW_TABLES_PER_PASS or (steady and new <= 1 + later)

    def block_step(self, states: dict, occ_index: int, occ: Occurrence) -> dict:
        new = {}
        floor = self.p.min_mem_suffix[occ.end]
        for key, front in states.items():
            entry = tuple(key[j] for j in occ.ext_idx)
            for exit_sub, cands in self.table(occ, entry):
                nkey = tuple(exit_sub[a] if kind else key[a] for kind, a in occ.exit_src)
                bucket = new.setdefault(nkey, [])
                for cand, ks in cands:
                    for _, v, tr in front:
                        nv = self.apply_cand(v, cand)
                        if self.has_mem and nv[-1] + floor > self.budget:
                            continue
                        bucket.append((self.est(nv), nv, (tr, -1 - occ_index, ks)))
        return new

    # ---------------------------------------------------------------------------- driver
    def solve(self, reuse: bool, progress) -> tuple[list[int], tuple]:
        p = self.p
        if reuse and p.occurrences is None:
            p.occurrences = find_blocks(p)
        occs = p.occurrences if reuse else []
        for o in occs:
            self.reps.setdefault(o.type, o)
        starts = {o.start: (n, o) for n, o in enumerate(occs)}
        later = {n: sum(o2.type == o.type for o2 in occs[n + 1 :]) for n, o in enumerate(occs)}
        states = {p.initial_key(): [(0.0, self.zero, None)]}
        i = 0
        while i < p.n:
            if i in starts and self.tables_pay(states, starts[i][1], later[starts[i][0]]):
                n, occ = starts[i]
                states = self.prune(self.block_step(states, n, occ), occ.end)
                if not states:
                    raise self.infeasible(occ.end - 1)
                i = occ.end
            else:
                states = self.prune(self.node_step(states, i, p.min_mem_suffix[i + 1]), i + 1, self.single)
                if not states:
                    raise self.infeasible(i)
                i += 1
            if progress:
                progress(i, p.n)
        (front,) = states.values()
        _, best_v, best_tr = min(front, key=_first)
        ks = [-1] * p.n
        tr = best_tr
        while tr is not None:
            tr, tag, payload = tr
            if tag >= 0:
                ks[tag] = payload
            else:
                occ = occs[-1 - tag]
                for r, k in enumerate(payload):
                    ks[occ.start + r] = k
        return ks, best_v


@dataclass(frozen=True)
class Beam:
    """How far the DP looks (module docstring, "Speed"): at most ``max_states`` states after each
    position (``"auto"``: :func:`beam_width`) and ``max_points`` points in each state's Pareto set
    (None: unlimited, the exact search); ``reuse_blocks`` solves a repeated layer once per entry state
    (:mod:`hidup.search.segments`)."""

    max_states: int | str | None = DEFAULT_MAX_STATES
    max_points: int | None = DEFAULT_MAX_POINTS
    reuse_blocks: bool = True


DEFAULT_BEAM = Beam()


def solve(
    problem: Problem,
    duplication: bool = True,
    memory_budget: float | None = None,
    beam: Beam = DEFAULT_BEAM,
    progress: Callable[[int, int], None] | None = None,
    hide_grad_sync: bool = False,
    by_price: bool | None = None,
    beat: float | None = None,
) -> tuple[list[int], float]:
    """Best signature index per position and its predicted iteration time (see the module docstring),
    searched with ``beam`` (:class:`Beam`).

    Without duplication the DP adds up both passes; with ``hide_grad_sync`` it leaves out the
    gradient all-reduces of replicated parameters, which overlap the backward (a lower bound of
    the time where the serialized sum is an upper bound; :mod:`hidup.search.schedule` times both
    exactly).

    With ``memory_budget`` the plan is first searched without it: memory is additive over the
    positions (``problem.mem``), so when the fastest plan fits the budget it is the fastest plan
    within it, and the search without a memory coordinate is much cheaper (six-entry points, and
    cross-state pruning stays on).  Only a budget that binds runs a second search: the memory-aware
    DP, or with ``by_price`` the DP with memory priced (module docstring, "A memory budget by its
    price"; ``None``: by price where the DP is a beam search on a graph of at least
    ``PRICE_MIN_POSITIONS`` positions).  The answer without a budget is kept on ``problem``
    (``free_solutions``) and returned when asked again.

    ``beat`` (seconds; a plan in hand): the search by price raises :class:`Beaten` as soon as its
    bound shows that no plan within the budget has a predicted time below it."""
    hide_grad_sync = hide_grad_sync and not duplication
    max_states, max_points, reuse_blocks = beam.max_states, beam.max_points, beam.reuse_blocks
    if memory_budget is not None:
        if by_price is None:
            by_price = max_states is not None and problem.n >= PRICE_MIN_POSITIONS
        if problem.min_mem_suffix[0] > memory_budget:  # even the leanest signature of every node needs more
            # where the search would have run out of plans: by price at the end, the memory-aware DP at once
            at = problem.n - 1 if by_price else 0
            raise LazySearchError(lambda: _budget_message(problem, memory_budget, at, max_states, max_points))
        ks, v = solve(problem, duplication, None, beam, progress, hide_grad_sync)
        if problem.plan_memory(ks) <= memory_budget:
            return ks, v
        if by_price:
            passes = (max_states, max_points, reuse_blocks, hide_grad_sync)
            return _solve_by_price(problem, duplication, memory_budget, passes, (ks, v), beat)
    else:
        known = problem.free_solutions.get((duplication, max_states, max_points, reuse_blocks, hide_grad_sync))
        if known is not None:
            return list(known[0]), known[1]
    dp = _DP(problem, duplication, memory_budget, max_states, max_points, hide_grad_sync)
    with no_gc():
        ks, v = dp.solve(reuse_blocks, progress)
    if memory_budget is None:
        key = (duplication, max_states, max_points, reuse_blocks, hide_grad_sync)
        problem.free_solutions[key] = (tuple(ks), dp.est(v))
    return ks, dp.est(v)


class Beaten(SearchError):
    """No plan within the budget is faster than the plan in hand (``beat`` seconds): the search by
    price stopped at a bound of ``bound`` seconds."""

    def __init__(self, beat: float, bound: float):
        super().__init__(f"no plan within the memory budget beats {beat:.6g} s (bound {bound:.6g} s)")
        self.beat, self.bound = beat, bound

    def __reduce__(self):  # sent from a forked search to its parent
        return Beaten, (self.beat, self.bound)


def _priced(problem: Problem, duplication: bool, price: float, beam: tuple) -> tuple[list[int], float, float, float]:
    """The DP's answer with every byte a rank keeps priced at ``price`` seconds: ``(signature
    indices, predicted time without the price, memory, priced value)``."""
    max_states, max_points, reuse_blocks, hide_grad_sync = beam
    dp = _DP(problem, duplication, None, max_states, max_points, hide_grad_sync, memory_price=price)
    with no_gc():
        ks, v = dp.solve(reuse_blocks, None)
    value = dp.est(v)
    memory = problem.plan_memory(ks)
    return ks, value - price * memory, memory, value


def _solve_by_price(
    problem: Problem,
    duplication: bool,
    budget: float,
    beam: tuple,
    free: tuple[list[int], float],
    beat: float | None = None,
) -> tuple[list[int], float]:
    """The fastest plan found within ``budget`` by pricing memory (module docstring, "A memory budget
    by its price"); ``free`` is the answer without the budget, which does not fit it; :class:`Beaten`
    once the bound reaches ``beat``.

    Each price depends on whether the plan at the one before fits.  Where a core is spare
    (:data:`PASSES_BESIDE`), the pass at the price that would come next runs in a forked child beside
    the pass at this one, on a guess of this one's outcome (its answer is used only where the guess
    was right, which the sequence of prices then shows: the prices and plans are those of one pass
    after the other)."""
    ks0, time0 = free
    search = _PriceSearch(budget, PRICE_START * time0 / (problem.plan_memory(ks0) - budget))
    price = search.next_price()
    while price is not None:
        guess = search.guess_after(price) if PASSES_BESIDE is not None else None
        pair = None
        if guess is not None:
            pair = PASSES_BESIDE(
                problem,
                lambda price=price: _priced(problem, duplication, price, beam),
                lambda guess=guess: _priced(problem, duplication, guess, beam),
            )
        if pair is None:
            results = [(price, _priced(problem, duplication, price, beam))]
        else:
            results = [(price, pair[0]), (guess, pair[1])]
        for n, (at, result) in enumerate(results):
            if n and at != price:
                break  # a wrong guess: its pass is not one the sequence makes
            search.update(at, result)
            if beat is not None and search.bound >= beat:
                raise Beaten(beat, search.bound)
            price = search.next_price()
    if search.best is None:
        max_states, max_points = beam[:2]
        raise LazySearchError(lambda: _budget_message(problem, budget, problem.n - 1, max_states, max_points))
    return search.best


class _PriceSearch:
    """The sequence of prices of :func:`_solve_by_price`: raised by ``PRICE_FACTOR`` from ``start`` until
    the plan fits, then bisected geometrically between a price that misses (``low``, 0 for none) and one
    that fits (``high``) at most ``PRICE_STEPS`` times, until the prices are within ``PRICE_RATIO`` or
    the fastest plan that fits is within ``PRICE_GAP`` of the bound; the fastest plan that fits."""

    def __init__(self, budget: float, start: float):
        self.budget = budget
        self.low, self.high = 0.0, start
        self.raises = self.steps = 0
        self.best: tuple[list[int], float] | None = None
        self.bound = -math.inf  # the greatest Lagrangian lower bound seen: value - price * budget
        self.last_fits: bool | None = None

    def next_price(self) -> float | None:
        """The price of the next pass, or None: done."""
        if self.best is None:
            return self.high if self.raises < PRICE_RAISES else None
        best = self.best[1]
        if self.steps >= PRICE_STEPS or best - self.bound <= PRICE_GAP * best:
            return None
        if self.low and self.high / self.low <= PRICE_RATIO:
            return None
        return math.sqrt(self.low * self.high) if self.low else self.high / PRICE_FACTOR

    def update(self, price: float, result: tuple[list[int], float, float, float]) -> None:
        """Take the pass at ``price``: ``(signature indices, time, memory, priced value)``."""
        ks, time, memory, value = result
        self.bound = max(self.bound, value - price * self.budget)
        fits = self.last_fits = memory <= self.budget
        if self.best is None:  # raising the price until the plan fits
            if fits:
                self.best = (ks, time)
            else:
                self.low, self.high = price, price * PRICE_FACTOR
                self.raises += 1
            return
        self.steps += 1
        if not fits:
            self.low = price
            return
        self.high = price
        if time < self.best[1]:
            self.best = (ks, time)

    def guess_after(self, price: float) -> float | None:
        """The price after the pass at ``price`` (the next one) on a guess of its outcome, ignoring the
        stops that depend on the plans it finds; None where no pass follows either way.  The guess: the
        first pass fits (the price starts high, ``PRICE_START``), and a bisection's outcomes alternate
        (bisecting towards the budget, the plans tend to fall on either side of it in turn)."""
        if self.best is None:
            if self.raises == 0:  # guess that it fits: the bisection starts
                return math.sqrt(self.low * price) if self.low else price / PRICE_FACTOR
            return price * PRICE_FACTOR if self.raises + 1 < PRICE_RAISES else None
        if self.steps + 1 >= PRICE_STEPS:
            return None
        if self.last_fits:  # guess that this one misses
            low, high = price, self.high
        else:
            low, high = self.low, price
        if low and high / low <= PRICE_RATIO:
            return None
        return math.sqrt(low * high) if low else high / PRICE_FACTOR
