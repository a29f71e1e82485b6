"""Exhaustive enumeration of every signature assignment: the reference the DP is tested against.

``brute_force`` evaluates ``prod_i |signatures(i)|`` assignments with
:func:`hidup.search.schedule.evaluate` and returns the first one of least DP objective
(:attr:`~hidup.search.schedule.Evaluation.objective`: the predicted time with duplication, the
serialized sum without) within the memory budget by the DP's terms (:meth:`Problem.plan_memory`), if
any.  Only for small graphs.
"""

from __future__ import annotations

import itertools
import math

from hidup.search.problem import Problem, SearchError
from hidup.search.schedule import evaluate

__all__ = ["brute_force"]


def brute_force(
    problem: Problem, duplication: bool = False, memory_budget: float | None = None, limit: int = 200_000
) -> tuple[list[int], float]:
    count = math.prod(len(s) for s in problem.sigs)
    if count > limit:
        raise ValueError(f"brute_force: {count} assignments exceed the limit {limit}; use a smaller graph")
    best, best_t = None, math.inf
    for ks in itertools.product(*(range(len(s)) for s in problem.sigs)):
        try:
            ev = evaluate(problem, list(ks), duplication)
        except SearchError:
            continue
        if memory_budget is not None and problem.plan_memory(ks) > memory_budget:  # the DP's budget terms
            continue
        if ev.objective < best_t:
            best, best_t = list(ks), ev.objective
    if best is None:
        raise SearchError("brute_force: no feasible assignment")
    return best, best_t
