"""Both duplication modes of the DP, side by side.

:func:`hidup.search.dp.solve` searches one mode; a search with duplication runs it twice, once per
mode, and the two runs are independent.  On a large graph the second runs in a forked child process
beside the first: fork shares the compiled problem (its transition caches included) without copying
or pickling it, and only the answers (lists of signature indices) travel back through a pipe.

A search without duplication has no second mode to run beside it, but it has other searches
independent of the plain one: the DP that hides the gradient all-reduces and, under a budget that
binds, the next search's DP without the budget (:mod:`hidup.search.api`).  :func:`solve_beside` runs
each in a forked child of its own while this process runs the plain one.

Under a memory budget the duplicated search may not be worth finishing (:mod:`hidup.search.api`,
"Duplication under a memory budget"): its plan without the budget comes first, and once the plain
mode's answer is in, ``worth(plain answer, duplicated answer without the budget)`` says whether to
wait for the duplicated mode's budgeted search or to drop it (the child is then stopped).  (The
plain answer does not bar the duplicated search by price: that search's bound is on duplicated times,
and its plan may win run without duplication.)

Once the plain mode's answer is in and the caller's ``meanwhile`` work done, this process only waits for
the duplicated answer (doing at most the caller's short ``idle`` work); the forked duplicated search then
counts this process's core as spare, and its search by price runs its passes two at a time
(:data:`hidup.search.dp.PASSES_BESIDE`: the same prices and plans as one pass after the other).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from hidup.search import dp
from hidup.search.dp import Beam, Beaten, solve
from hidup.search.problem import Problem, SearchError

__all__ = ["solve_modes", "CallerWork", "solve_beside", "spare_core", "PARALLEL_MIN_POSITIONS"]

PARALLEL_MIN_POSITIONS = 1024  # below this a search takes about a second; a second process is not worth it
_live: set = set()  # the children this process has forked and not yet joined
_in_child = False  # whether this process is such a child (its parent searches beside it)
# in the duplicated mode's child of solve_modes: the flag, shared with the parent, nonzero while the parent
# still searches its own mode (None in every other process)
_parent_searching = None


@dataclass(frozen=True)
class CallerWork:
    """The caller's own work, run in this process while :func:`solve_modes`'s duplicated search runs in
    a forked child beside it (never where the searches run one after the other): ``meanwhile()`` once
    the plain search is done, while the child still searches; ``idle(plain answer)`` only while the
    duplicated mode's answer is still to come (so never on the way to an answer already in)."""

    meanwhile: Callable[[], None] | None = None
    idle: Callable[[list[int]], None] | None = None


def solve_modes(
    problem: Problem,
    modes: tuple[bool, ...],
    memory_budget: float | None = None,
    progress_of: Callable[[bool], Callable | None] = lambda mode: None,
    worth: Callable[[list[int], list[int]], bool] | None = None,
    beat: float | None = None,
    work: CallerWork = CallerWork(),
    beam: Beam = dp.DEFAULT_BEAM,
) -> list[list[int]]:
    """:func:`hidup.search.dp.solve`'s signature indices for each duplication mode in ``modes``, searched
    with ``beam``.  The two searches
    are independent, so on a graph of at least ``PARALLEL_MIN_POSITIONS`` positions, where the host
    has two cores and can fork, the duplicated one runs in a forked child process beside the plain
    one (fork shares the problem without copying it; only the answers travel back).  Otherwise, or
    if the child dies, they run one after the other.  With ``worth`` (modes ``(False, True)`` under
    ``memory_budget``), the duplicated mode's answer is left out of the list when ``worth`` says so
    (module docstring), or when its search shows that no plan beats ``beat`` (:class:`~hidup.search.dp.Beaten`).
    ``work`` (:class:`CallerWork`): the caller's own work, run while the child still searches."""
    if (worth is not None or beat is not None) and (tuple(modes) != (False, True) or memory_budget is None):
        raise ValueError("solve_modes: worth and beat need the modes (False, True) and a memory budget")
    if len(modes) != 2 or not _forks(problem):
        return _one_after_the_other(problem, modes, memory_budget, progress_of, worth, beat, beam)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    searching = ctx.RawValue("b", 1)  # this process still searches (spare_core)
    args = (send, problem, modes[1], memory_budget, worth is not None, beat, beam, searching)
    # (not daemonic: a daemonic process may not fork, and the child forks its passes beside; it is
    # stopped and joined below in any case)
    child = ctx.Process(target=_solve_in_child, args=args)
    child.start()
    _live.add(child)
    send.close()
    try:
        first = solve(problem, modes[0], memory_budget, beam, progress_of(modes[0]))[0]
        if work.meanwhile is not None:
            work.meanwhile()
        searching.value = 0
        try:
            if worth is not None and not worth(first, _received(receive)):
                return [first]
            if work.idle is not None and not receive.poll():
                work.idle(first)
            second = _received(receive)
        except Beaten:
            return [first]
        except EOFError:  # the child died (killed, out of memory): search here instead
            return _one_after_the_other(problem, modes, memory_budget, progress_of, worth, beat, beam)
        return [first, second]
    finally:
        receive.close()
        if child.is_alive():
            child.terminate()
        child.join()
        _live.discard(child)


def solve_beside(problem: Problem, here: Callable[[], Any], *there: Callable[[], Any]) -> tuple:
    """``(here(), *(search() for search in there))``, where each of ``there`` is a DP search of ``problem``
    independent of the others: on a graph of at least ``PARALLEL_MIN_POSITIONS`` positions, where the
    host has two cores and can fork, each runs in a forked child process of its own while ``here`` runs
    in this one (only its answer travels back); otherwise, or for a child that dies, one after the
    other.  An error is raised as they would raise it run one after the other (``here``'s first)."""
    if not _forks(problem):
        return here(), *(search() for search in there)
    ctx = multiprocessing.get_context("fork")
    children = []
    try:
        for search in there:
            receive, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_answer_in_child, args=(send, search), daemon=True)
            children.append((child, receive))
            child.start()
            _live.add(child)
            send.close()
        answers = [here()]
        for (_, receive), search in zip(children, there):
            try:
                answers.append(_received(receive))
            except EOFError:  # the child died (killed, out of memory): search here instead
                answers.append(search())
        return tuple(answers)
    finally:
        for child, receive in children:
            receive.close()
            if child.is_alive():
                child.terminate()
            child.join()
            _live.discard(child)


def _passes_beside(problem: Problem, here: Callable[[], Any], there: Callable[[], Any]) -> tuple | None:
    """``solve_beside(problem, here, there)`` where a core is spare (:func:`spare_core`), else None (nothing
    run): the passes of a search by price (:data:`hidup.search.dp.PASSES_BESIDE`)."""
    return solve_beside(problem, here, there) if spare_core(problem) else None


def spare_core(problem: Problem) -> bool:
    """Whether a search of ``problem`` may fork a child beside this process now: it would fork one
    (:func:`solve_beside`), a core is free of the children it has forked (a child that has sent its
    answer may still be running its last instructions: busy), and this process is no forked child
    whose parent still searches: a child of :func:`solve_beside` never forks, the duplicated mode's
    child of :func:`solve_modes` once the parent has the plain mode's answer and has done its
    ``meanwhile`` work (the parent then waits for this child's answer: module docstring)."""
    if not _forks(problem) or (_in_child and (_parent_searching is None or _parent_searching.value)):
        return False
    return (os.cpu_count() or 1) - 1 - sum(child.is_alive() for child in _live) >= 1


def _forks(problem: Problem) -> bool:
    """Whether a second search of ``problem`` runs in a forked child process (:func:`solve_modes`)."""
    return (
        problem.n >= PARALLEL_MIN_POSITIONS
        and (os.cpu_count() or 1) >= 2
        and "fork" in multiprocessing.get_all_start_methods()
    )


def _one_after_the_other(problem, modes, memory_budget, progress_of, worth, beat, beam: Beam) -> list[list[int]]:
    if worth is None:
        return [solve(problem, mode, memory_budget, beam, progress_of(mode))[0] for mode in modes]
    first = solve(problem, False, memory_budget, beam, progress_of(False))[0]
    if not worth(first, solve(problem, True, None, beam)[0]):
        return [first]
    try:
        return [first, solve(problem, True, memory_budget, beam, progress_of(True), beat=beat)[0]]
    except Beaten:
        return [first]


def _received(receive) -> list[int]:
    ok, answer = receive.recv()
    if ok:
        return answer
    try:
        raise answer
    finally:  # the error's traceback holds this frame: a reference from it back to the error is a cycle,
        del answer  # which would keep every frame the error passed through (and their problems) alive


def _become_child(parent_searching=None) -> None:
    """This forked process made a child of the search that forked it (:func:`spare_core`), with
    ``parent_searching`` the flag of a duplicated mode's child.  Such a child may fork passes beside
    it, so a stop (SIGTERM: the parent does not want its answer) unwinds it, stopping them too."""
    global _in_child, _parent_searching
    _in_child, _parent_searching = True, parent_searching
    _live.clear()  # (the parent's children, not this process's)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if parent_searching is None else _unwind)


def _unwind(signum, frame) -> None:
    sys.exit(1)


def _answer_in_child(send, *searches: Callable[[], Any]) -> None:
    """Each of ``searches``' answers in turn (or the first error) sent to the parent
    (:func:`solve_beside`)."""
    _become_child()
    _send_answers(send, *searches)


def _send_answers(send, *searches: Callable[[], Any]) -> None:
    try:
        for search in searches:
            send.send((True, search()))
    except SearchError as e:
        send.send((False, e))
    except (BrokenPipeError, OSError):  # the parent stopped listening: its answer is not wanted
        pass
    finally:
        send.close()


def _solve_in_child(
    send,
    problem: Problem,
    duplication: bool,
    memory_budget,
    free_first: bool,
    beat: float | None,
    beam: Beam,
    parent_searching,
) -> None:
    """The ``duplication`` mode's answer under ``memory_budget`` (``beat`` as :func:`solve` takes it),
    sent to the parent; with ``free_first`` its answer without the budget is sent before it.
    ``parent_searching``: the flag of :func:`spare_core`."""
    _become_child(parent_searching)
    free = [lambda: solve(problem, duplication, None, beam)[0]] if free_first else []
    _send_answers(send, *free, lambda: solve(problem, duplication, memory_budget, beam, beat=beat)[0])


dp.PASSES_BESIDE = _passes_beside  # (dp cannot import this module: it imports dp)
