"""Integer linear program over the same cost model (python-mip, CBC), with a per-rank memory budget.

Variables
---------
* ``x[i,k] in {0,1}``: position ``i`` uses its signature ``k``;  ``sum_k x[i,k] = 1``.
* For a tensor ``t`` produced by position ``p`` (output ``j``): ``P[t,a] = sum_{k: out_j(k) = a}
  x[p,k]`` (linear, not a variable) says ``t`` is produced in form ``a``.
* For each read of ``t`` by position ``c`` (input ``i``): ``Q_c[f] = sum_{k: in_i(k) = f} x[c,k]``
  and a transportation block ``E_c[a,f] >= 0`` with ``sum_f E_c[a,f] = P[t,a]`` and
  ``sum_a E_c[a,f] = Q_c[f]`` (at integer ``x`` exactly ``E_c[a,f] = P[t,a] Q_c[f]``; its LP
  relaxation is much tighter than ``w >= P + Q - 1``).  ``E_c[a,f] = 0`` when ``a -> f`` is
  impossible (``-> replicate``).
* ``z[t,a,f] >= E_c[a,f]`` for every read ``c``: ``t`` is converted from ``a`` to ``f`` once and the
  converted tensor is shared by all its readers, exactly as in the DP.

Objective and constraint
------------------------
``min sum x[i,k] (t_fwd + t_bwd)(i,k) + sum z[t,a,f] (comm_fwd + comm_bwd)(t, a -> f)`` -- the
iteration time without duplication, identical to the DP's no-duplication cost (a prefetched gather's
forward is :meth:`~hidup.search.problem.Problem.forward_charge` of the reader that creates its ``z``, and
a resharded one's gather made again :meth:`~hidup.search.problem.Problem.again_charge`,
the first that may need the form: where a later reader is the first to need it in the plan, the ILP
reads the earlier reader's window, the one approximation it makes of the DP's charge) -- subject to
``sum x[i,k] mem(i,k) <= budget``.  Times enter in microseconds for numerical range.
If the budget is infeasible the same model is solved for ``min sum x mem`` and the error states
that minimum.

Time limit and progress
-----------------------
:func:`optimize` runs under a time limit (``DEFAULT_TIME_LIMIT`` seconds, model building
included) and, with ``progress``, reports every ``PROGRESS_EVERY`` seconds the best plan found so
far (the incumbent, an upper bound on the optimum) and CBC's lower bound, in milliseconds of
iteration time, with the relative gap ``(incumbent - bound) / incumbent``.  It ends in one of:

* ``optimal``: the incumbent is proven optimal (gap within ``max_mip_gap``);
* ``feasible``: the time limit stopped the solver with a plan whose optimality is unproven; the plan
  is returned and :class:`Outcome` records the incumbent, the bound and the gap;
* no plan: :class:`SearchError` -- the budget is infeasible (the message states the least memory
  any plan needs) or the limit ran out before any plan was found.

A ``start`` plan (the DP's answer) seeds CBC; when the limit is spent before CBC can run (building
the model took it all), a start that fits the budget is returned as ``feasible``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hidup.search.problem import Problem, SearchError
from hidup.search.schedule import evaluate

__all__ = ["solve", "optimize", "min_memory", "Outcome", "DEFAULT_TIME_LIMIT", "PROGRESS_EVERY"]

_SCALE = 1e6  # seconds -> microseconds
DEFAULT_TIME_LIMIT = 60.0  # seconds, model building included
PROGRESS_EVERY = 5.0  # seconds between progress lines


CBC_FIX = "install python-mip's CBC binaries (`pip install cbcbox`), or point PMIP_CBC_LIBRARY at a libCbc.so"


class CbcMissing(SearchError):
    """python-mip is installed but its CBC library could not be loaded."""


def cbc_model():
    """A new python-mip model on CBC, or :class:`SearchError` saying how to get CBC when python-mip
    could not load its library (python-mip prints its own reason at import and later fails with a
    ``NameError`` deep inside)."""
    import mip

    try:
        return mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    except NameError as e:
        raise CbcMissing(
            f"the ILP needs the CBC solver, and python-mip could not load its library ({e}). "
            f"Fix: {CBC_FIX}; or search with the DP (algorithm 'dp')."
        ) from None


def _build(problem: Problem, memory_budget: float | None, objective: str):
    import mip

    p = problem
    m = cbc_model()
    m.verbose = 0
    m.threads = 1
    m.max_mip_gap = 1e-9
    m.max_mip_gap_abs = 1e-9
    x = [[m.add_var(var_type=mip.BINARY, name=f"x_{i}_{k}") for k in range(len(p.sigs[i]))] for i in range(p.n)]
    for i in range(p.n):
        m += mip.xsum(x[i]) == 1, f"one_{i}"
    time_terms = [
        x[i][k] * ((p.compute[i][k][0] + p.compute[i][k][1]) * _SCALE)
        for i in range(p.n)
        for k in range(len(p.sigs[i]))
        if sum(p.compute[i][k]) > 0
    ]
    mem_expr = mip.xsum(x[i][k] * p.mem[i][k] for i in range(p.n) for k in range(len(p.sigs[i])) if p.mem[i][k] > 0)

    readers: dict[int, list[tuple[int, int]]] = {}
    for c, cn in enumerate(p.order):
        for inp, tt in enumerate(cn.inputs):
            readers.setdefault(tt, []).append((c, inp))
    for pi, node in enumerate(p.order):
        for j, t in enumerate(node.outputs):
            produced: dict[int, list] = {}
            for k in range(len(p.sigs[pi])):
                produced.setdefault(p.out_forms[pi][k][j], []).append(x[pi][k])
            P = {a: mip.xsum(v) for a, v in produced.items()}
            z: dict[tuple[int, int], object] = {}
            for c, inp in readers.get(t, []):
                Q: dict[int, list] = {}
                for k in range(len(p.sigs[c])):
                    Q.setdefault(p.in_forms[c][k][inp], []).append(x[c][k])
                if len(P) == 1 and len(Q) == 1 and next(iter(P)) == next(iter(Q)):
                    continue  # both sides fixed to the same form: nothing to convert
                E = {}
                for a in P:
                    for f in Q:
                        if a == f:
                            E[a, f] = m.add_var(lb=0.0)
                            continue
                        conv = p.conversion(t, a, f)
                        E[a, f] = m.add_var(lb=0.0, ub=0.0 if conv is None else 1.0)
                        if conv is None:
                            continue
                        # a recomputed reader, a selectively recomputed one of a parameter, or a resharded
                        # parameter's, runs the forward conversion again in its backward
                        again = p.made_again(c, t, a)
                        # a prefetched gather: its forward less the window of this reader's unit (the first
                        # reader that may need the form, where the DP charges the actual first one)
                        made = p.again_charge(c, inp, conv) if again else 0.0
                        cost = (p.forward_charge(c, inp, conv) + made + conv.bwd) * _SCALE
                        if cost <= 0:
                            continue
                        if (a, f) not in z:
                            z[a, f] = m.add_var(lb=0.0, ub=1.0)
                            time_terms.append(cost * z[a, f])
                        m += z[a, f] >= E[a, f]
                for a in P:
                    m += mip.xsum(E[a, f] for f in Q) == P[a]
                for f in Q:
                    m += mip.xsum(E[a, f] for a in P) == mip.xsum(Q[f])
    if memory_budget is not None:
        m += mem_expr <= memory_budget, "memory"
    m.objective = mip.minimize(mip.xsum(time_terms) if objective == "time" else mem_expr)
    return m, x


def _extract(problem: Problem, x) -> list[int]:
    ks = []
    for i in range(problem.n):
        vals = [v.x if v.x is not None else 0.0 for v in x[i]]
        ks.append(max(range(len(vals)), key=lambda k: vals[k]))
    return ks


@dataclass
class Outcome:
    """How the ILP ended: the plan (a signature index per position) and what is known about it.

    ``status`` is ``"optimal"`` (proven) or ``"feasible"`` (stopped by the time limit, unproven);
    ``objective`` and ``bound`` are the incumbent's iteration time without duplication and CBC's
    lower bound on the optimum, in seconds (``bound`` None when the solver never ran)."""

    ks: list[int]
    status: str
    objective: float | None
    bound: float | None
    seconds: float
    time_limit: float | None

    @property
    def proven(self) -> bool:
        return self.status == "optimal"

    @property
    def gap(self) -> float | None:
        """``(objective - bound) / objective``, or None when either is unknown."""
        if self.objective is None or self.bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)

    def info(self) -> dict:
        """The record kept in a plan's options (``plan.options["solver"]``).  The wall time is left out so
        that the same search saves the same plan file; :meth:`describe` reports it."""
        return {
            "solver": "ilp",
            "status": self.status,
            "proven_optimal": self.proven,
            "objective_s": self.objective,
            "bound_s": self.bound,
            "gap": self.gap,
            "time_limit_s": self.time_limit,
        }

    def describe(self) -> str:
        """One line for the user: the status, and for an unproven plan how far from proven it is."""
        if self.proven:
            return f"ILP: optimal plan proven in {self.seconds:.1f} s"
        gap = "unknown" if self.gap is None else f"{100 * self.gap:.3g}%"
        bound = "no bound" if self.bound is None else f"bound {self.bound * 1e3:.6g} ms"
        return (
            f"ILP: stopped by the time limit of {self.time_limit:g} s with a feasible plan whose optimality is "
            f"unproven (incumbent {self.objective * 1e3:.6g} ms, {bound}, gap {gap}); a longer --time-limit "
            "may find a faster plan or prove this one"
        )


def _reporter(progress) -> Callable[[str], None] | None:
    """``progress``: None/False (silent), True (lines on stderr) or a callable taking each line."""
    if progress is None or progress is False:
        return None
    if callable(progress):
        return progress
    return lambda line: print(line, file=sys.stderr, flush=True)


class _Monitor:
    """While CBC runs (it releases the GIL), report its latest incumbent and bound every ``every`` s.

    CBC writes its search log to file descriptor 1; for the duration of the solve that descriptor is
    a pipe read by a thread here, which keeps the latest incumbent and bound from the log's lines
    (CBC's classic ``Cbc0010I After N nodes, ... best solution, best possible ...`` lines, or the
    branch-and-bound table of newer builds: ``Nodes OnTree Depth BestSol ... BestBound Gap% Time``),
    and a second thread prints them.  (python-mip's progress callback is not used: some CBC builds
    crash in it.)"""

    _CLASSIC = re.compile(r"After (\d+) nodes, \d+ on tree, (\S+) best solution, best possible (\S+)")
    _FOUND = re.compile(r"Integer solution of (\S+) found")

    def __init__(self, model, say: Callable[[str], None], label: str, t0: float, every: float | None = None):
        self.model, self.say, self.label, self.t0 = model, say, label, t0
        self.every = PROGRESS_EVERY if every is None else every
        self.incumbent = self.bound = None
        self.nodes = 0
        self.in_table = False
        self.done = threading.Event()

    def __enter__(self):
        sys.stdout.flush()
        self.saved = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self.reader = threading.Thread(target=self._read, args=(read,), name="hidup-ilp-log", daemon=True)
        self.ticker = threading.Thread(target=self._tick, name="hidup-ilp-progress", daemon=True)
        self.reader.start()
        self.ticker.start()
        self.model.verbose = 1
        return self

    def __exit__(self, *exc):
        self.model.verbose = 0
        os.dup2(self.saved, 1)  # closes the pipe's last write end: the reader sees end of file
        os.close(self.saved)
        self.reader.join(timeout=5.0)
        self.done.set()
        self.ticker.join(timeout=1.0)

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                self.parse(line)

    def parse(self, line: str) -> None:
        """Take the incumbent and bound (ILP units) from one line of CBC's log, if it holds them."""
        m = self._CLASSIC.search(line)
        if m:
            self.nodes, self.incumbent, self.bound = int(m.group(1)), _number(m.group(2)), _number(m.group(3))
            return
        m = self._FOUND.search(line)
        if m:
            self.incumbent = _number(m.group(1))
            return
        if "BestSol" in line and "BestBound" in line:
            self.in_table = True
            return
        stripped = line.strip()
        if not stripped or stripped[0] in "\u25b6\u2714\u2500":  # a section's heading or rule ends the table
            self.in_table = stripped.startswith("\u2500") and self.in_table
            return
        if self.in_table:
            tokens = stripped.split()
            if not tokens[0].isdigit():
                tokens = tokens[1:]  # a marker (a new incumbent)
            if len(tokens) >= 6 and all(t.isdigit() for t in tokens[:3]):
                self.nodes = int(tokens[0])
                self.incumbent = _number(tokens[3]) if _number(tokens[3]) is not None else self.incumbent
                self.bound = _number(tokens[-3]) if _number(tokens[-3]) is not None else self.bound

    def _tick(self) -> None:
        while not self.done.wait(self.every):
            elapsed = time.perf_counter() - self.t0
            inc, lb = self.incumbent, self.bound
            if not _finite(inc) and not _finite(lb):
                self.say(f"{self.label}: {elapsed:.0f} s, no plan or bound yet (CBC: root relaxation and cuts)")
                continue
            text = "none yet" if not _finite(inc) else f"{inc / _SCALE * 1e3:.6g} ms"
            bound = "-" if not _finite(lb) else f"{lb / _SCALE * 1e3:.6g} ms"
            gap = f", gap {100 * max(inc - lb, 0.0) / inc:.3g}%" if _finite(inc) and _finite(lb) and inc > 0 else ""
            self.say(f"{self.label}: {elapsed:.0f} s, {self.nodes} nodes, incumbent {text}, bound {bound}{gap}")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _finite(v) -> bool:
    return v is not None and abs(v) < 1e30


def _run(m, max_seconds: float | None):
    return m.optimize(max_seconds=max_seconds) if max_seconds is not None else m.optimize()


def min_memory(problem: Problem, time_limit: float | None = None) -> float:
    """The least per-rank memory (bytes) of any feasible plan (the best found within ``time_limit``)."""
    import mip

    m, x = _build(problem, None, "memory")
    status = _run(m, time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise SearchError(f"the graph has no feasible plan at all (CBC status {status.name}); check its signatures")
    ks = _extract(problem, x)
    return sum(problem.mem[i][k] for i, k in enumerate(ks))


def _time_of(problem: Problem, ks: list[int]) -> float:
    """The ILP objective (seconds, no duplication) of an assignment."""
    return evaluate(problem, ks, False).objective


def optimize(
    problem: Problem,
    memory_budget: float | None = None,
    time_limit: float | None = DEFAULT_TIME_LIMIT,
    start: list[int] | None = None,
    progress=None,
    started: float | None = None,
) -> Outcome:
    """Solve the ILP under ``time_limit`` seconds (None: no limit); see the module docstring.

    ``started`` (a ``time.perf_counter()`` value, default now) is when the limit began: work done
    before, such as computing ``start``, counts against it.  Returns an :class:`Outcome`
    (``optimal`` or ``feasible``); raises :class:`SearchError` when the budget admits no plan or the
    limit ends the solve before any plan is found."""
    import mip

    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
    say = _reporter(progress)
    t0 = time.perf_counter() if started is None else started
    m, x = _build(problem, memory_budget, "time")
    fits = start is not None and (
        memory_budget is None or sum(problem.mem[i][k] for i, k in enumerate(start)) <= memory_budget
    )
    if start is not None:
        m.start = [(x[i][k], 1.0) for i, k in enumerate(start)]
    remaining = None if time_limit is None else time_limit - (time.perf_counter() - t0)
    if remaining is not None and remaining <= 0:
        # the limit went into building the model: nothing is proven; the start is the plan, if it fits
        if fits:
            return Outcome(
                list(start), "feasible", _time_of(problem, start), None, time.perf_counter() - t0, time_limit
            )
        raise SearchError(
            f"the ILP found no plan within its time limit of {time_limit:g} s (its seed and building "
            "the model took it all). Fix: raise the time limit (hidup search --time-limit SECONDS), "
            "or use the DP (--algorithm dp)"
        )
    if say is not None:
        limit = "no time limit" if time_limit is None else f"time limit {time_limit:g} s"
        say(
            f"ilp: {m.num_cols} variables, {m.num_rows} constraints, {limit}"
            + (", seeded with the DP's plan" if fits else "")
        )
        with _Monitor(m, say, "ilp", t0):
            status = _run(m, remaining)
    else:
        status = _run(m, remaining)
    seconds = time.perf_counter() - t0
    S = mip.OptimizationStatus
    if status == S.INFEASIBLE:
        if memory_budget is not None:
            budget = f"{memory_budget:.6g} bytes ({memory_budget / 2**30:.3f} GiB)"
            try:  # the least memory, within what is left of the limit (at least a few seconds)
                need = min_memory(problem, None if time_limit is None else max(time_limit - seconds, 5.0))
            except SearchError:
                raise SearchError(
                    f"no plan fits the memory budget of {budget} per rank (the least memory any plan "
                    "needs was not found in time). Fix: raise the budget, or use more ranks."
                ) from None
            raise SearchError(
                f"no plan fits the memory budget of {budget} per rank; the least memory any plan needs "
                f"is {need:.6g} bytes ({need / 2**30:.3f} GiB). Fix: raise the budget to at least that, "
                "or use more ranks."
            )
        raise SearchError(
            "the ILP is infeasible without a memory budget: some node has no signature whose "
            "inputs can be produced; check the graph's signatures and the restriction"
        )
    if status in (S.OPTIMAL, S.FEASIBLE):
        ks = _extract(problem, x)
        bound = m.objective_bound
        bound = bound / _SCALE if _finite(bound) else None
        value = m.objective_value
        value = value / _SCALE if _finite(value) else _time_of(problem, ks)
        outcome = Outcome(ks, "optimal" if status == S.OPTIMAL else "feasible", value, bound, seconds, time_limit)
    elif fits and status == S.NO_SOLUTION_FOUND:  # CBC kept no solution of its own; the seed still stands
        bound = m.objective_bound
        outcome = Outcome(
            list(start),
            "feasible",
            _time_of(problem, start),
            bound / _SCALE if _finite(bound) else None,
            seconds,
            time_limit,
        )
    elif status == S.NO_SOLUTION_FOUND:
        raise SearchError(
            f"the ILP found no plan within its time limit of {time_limit:g} s. Fix: raise the time "
            "limit (hidup search --time-limit SECONDS), or use the DP (--algorithm dp)"
        )
    else:
        raise SearchError(
            f"CBC found no plan (status {status.name}). Fix: raise the time limit, or use the DP (--algorithm dp)"
        )
    if say is not None and outcome.proven:  # an unproven plan is the caller's to report (a warning)
        say(outcome.describe())
    return outcome


def solve(
    problem: Problem,
    memory_budget: float | None = None,
    time_limit: float | None = None,
    start: list[int] | None = None,
) -> list[int]:
    """Optimal signature index per position without duplication, under the memory budget.

    ``start`` (a signature index per position, e.g. the DP's answer) seeds CBC with a feasible plan;
    with ``time_limit`` the best plan found by then is returned (:func:`optimize` says whether it is
    proven optimal)."""
    return optimize(problem, memory_budget, time_limit, start).ks
