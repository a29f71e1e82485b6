"""Plan search: ``hidup.search(graph, profile)`` -> :class:`hidup.plan.Plan`.

Folder search/, imported as ``hidup.search``; layer ``search`` (below codegen, above the plan and the
profile data it reads; docs/design.md, "Map").

Modules: :mod:`~hidup.search.cost` and :mod:`~hidup.search.memory` (the cost model),
:mod:`~hidup.search.problem` (the compiled problem and its transitions),
:mod:`~hidup.search.schedule` (iteration time with and without duplication),
:mod:`~hidup.search.dp` (HiDup's DP), :mod:`~hidup.search.modes` (its two modes side by side),
:mod:`~hidup.search.segments` (repeated layers),
:mod:`~hidup.search.ilp` (ILP with a memory budget), :mod:`~hidup.search.brute` (reference
enumeration), :mod:`~hidup.search.synthetic` (random and layered test graphs),
:mod:`~hidup.plan.record` (the plan a search returns and its JSON form) and
:mod:`~hidup.search.api` (the entry points).
"""

from hidup.search.api import STYLES, SearchOptions, forced, make_plan, plan_indices, price, search
from hidup.search.problem import Problem, SearchError

__all__ = [
    "search",
    "SearchOptions",
    "forced",
    "make_plan",
    "price",
    "plan_indices",
    "Problem",
    "SearchError",
    "STYLES",
]

from hidup._callable import make_callable

make_callable(__name__, "search")
