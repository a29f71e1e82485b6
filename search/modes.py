"""Both duplication modes of the DP, side by side.

:func:`hidup.search.dp.solve` searches one mode; a search with duplication runs it twice, once per
mode, and the two runs are independent.  On a large graph the second runs in a forked child process
beside the first: fork shares the compiled problem (its transition caches included) without copying
or pickling it, and only the answer (a list of signature indices) travels back through a pipe.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable

from hidup.search.dp import solve
from hidup.search.problem import Problem, SearchError

__all__ = ["solve_modes", "PARALLEL_MIN_POSITIONS"]

PARALLEL_MIN_POSITIONS = 1024  # below this a search takes about a second; a second process is not worth it


def solve_modes(
    problem: Problem,
    modes: tuple[bool, ...],
    memory_budget: float | None = None,
    progress_of: Callable[[bool], Callable | None] = lambda mode: None,
    **beam,
) -> list[list[int]]:
    """:func:`hidup.search.dp.solve`'s signature indices for each duplication mode in ``modes``.  The two searches
    are independent, so on a graph of at least ``PARALLEL_MIN_POSITIONS`` positions, where the host
    has two cores and can fork, the duplicated one runs in a forked child process beside the plain
    one (fork shares the problem without copying it; only the answer travels back).  Otherwise, or
    if the child dies, they run one after the other."""
    if (
        len(modes) != 2
        or problem.n < PARALLEL_MIN_POSITIONS
        or (os.cpu_count() or 1) < 2
        or "fork" not in multiprocessing.get_all_start_methods()
    ):
        return [solve(problem, mode, memory_budget, progress=progress_of(mode), **beam)[0] for mode in modes]
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_solve_in_child, args=(send, problem, modes[1], memory_budget, beam), daemon=True)
    child.start()
    send.close()
    try:
        first = solve(problem, modes[0], memory_budget, progress=progress_of(modes[0]), **beam)[0]
        try:
            ok, second = receive.recv()
        except EOFError:  # the child died (killed, out of memory): search here instead
            ok, second = True, solve(problem, modes[1], memory_budget, progress=progress_of(modes[1]), **beam)[0]
        if not ok:
            raise second
        return [first, second]
    finally:
        receive.close()
        if child.is_alive():
            child.terminate()
        child.join()


def _solve_in_child(send, problem: Problem, duplication: bool, memory_budget, beam: dict) -> None:
    try:
        send.send((True, solve(problem, duplication, memory_budget, **beam)[0]))
    except SearchError as e:
        send.send((False, e))
    finally:
        send.close()
