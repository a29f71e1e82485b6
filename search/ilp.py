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
iteration time without duplication, identical to the DP's no-duplication cost -- subject to
``sum x[i,k] mem(i,k) <= budget``.  Times enter in microseconds for numerical range.
If the budget is infeasible the same model is solved for ``min sum x mem`` and the error states
that minimum.
"""

from __future__ import annotations

from hidup.search.problem import Problem, SearchError

__all__ = ["solve", "min_memory"]

_SCALE = 1e6  # seconds -> microseconds


def _build(problem: Problem, memory_budget: float | None, objective: str):
    import mip

    p = problem
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    m.threads = 1
    m.max_mip_gap = 1e-9
    m.max_mip_gap_abs = 1e-9
    x = [[m.add_var(var_type=mip.BINARY, name=f"x_{i}_{k}") for k in range(len(p.sigs[i]))] for i in range(p.n)]
    for i in range(p.n):
        m += mip.xsum(x[i]) == 1, f"one_{i}"
    time_terms = [x[i][k] * ((p.compute[i][k][0] + p.compute[i][k][1]) * _SCALE)
                  for i in range(p.n) for k in range(len(p.sigs[i])) if sum(p.compute[i][k]) > 0]
    mem_expr = mip.xsum(x[i][k] * p.mem[i][k] for i in range(p.n) for k in range(len(p.sigs[i]))
                        if p.mem[i][k] > 0)

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
                        conv = p.cost.conversion(t, p.forms[a], p.forms[f])
                        E[a, f] = m.add_var(lb=0.0, ub=0.0 if conv is None else 1.0)
                        if conv is None:
                            continue
                        cost = (conv.fwd + conv.bwd) * _SCALE
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


def min_memory(problem: Problem, time_limit: float | None = None) -> float:
    """The least per-rank memory (bytes) of any feasible plan."""
    import mip

    m, x = _build(problem, None, "memory")
    status = m.optimize(max_seconds=time_limit) if time_limit else m.optimize()
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise SearchError(f"the graph has no feasible plan at all (CBC status {status.name}); check its signatures")
    ks = _extract(problem, x)
    return sum(problem.mem[i][k] for i, k in enumerate(ks))


def solve(problem: Problem, memory_budget: float | None = None, time_limit: float | None = None,
          start: list[int] | None = None) -> list[int]:
    """Optimal signature index per position without duplication, under the memory budget.

    ``start`` (a signature index per position, e.g. the DP's answer) seeds CBC with a feasible plan;
    with ``time_limit`` the best plan found by then is returned."""
    import mip

    m, x = _build(problem, memory_budget, "time")
    if start is not None:
        m.start = [(x[i][k], 1.0) for i, k in enumerate(start)]
    status = m.optimize(max_seconds=time_limit) if time_limit else m.optimize()
    if status == mip.OptimizationStatus.INFEASIBLE:
        if memory_budget is not None:
            need = min_memory(problem, time_limit)
            raise SearchError(f"no plan fits the memory budget of {memory_budget:.6g} bytes "
                              f"({memory_budget / 2**30:.3f} GiB) per rank; the least memory any plan needs is "
                              f"{need:.6g} bytes ({need / 2**30:.3f} GiB). Fix: raise the budget to at least that, "
                              "or use more ranks.")
        raise SearchError("the ILP is infeasible without a memory budget: some node has no signature whose "
                          "inputs can be produced; check the graph's signatures and the restriction")
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise SearchError(f"CBC found no plan (status {status.name}); raise time_limit")
    return _extract(problem, x)
