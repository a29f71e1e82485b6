"""The one way every benchmarked method is timed: the baselines (harness.py) and hidup's own runs
(exp/benchrun.py) call :func:`time_steps` with the same warm-up count and the same best-of allowance.

A *window* is ``N`` training steps issued back to back between two device synchronizations (no
sync per step: the host queues step after step, as a training loop does, so a method whose host
work hides behind the device's is not charged for it).  Per rank and window

    t_r(window) = (t_end - t_start) / N,

the window's time is ``t(window) = max_r t_r(window)`` (the slowest rank sets the pace), and the
reported step time is the best of ``best_of`` windows, ``min_window t(window)``.  A barrier (a
collective, then a device sync) opens each window, so that no rank's window includes another rank's
lag from before it.

Before the windows, ``warmup`` untimed steps run (each between syncs, so that compilation and
first-step allocations are over); then the ranks agree on ``N``: without a time cap ``N = iters``;
with one, ``N = clamp(floor((cap - e) / (best_of * t_w)), 1, iters)`` with ``t_w`` the last warm-up
step's time and ``e`` the elapsed time (both max over ranks), so that a run takes about ``cap``
seconds and every rank runs the same number of steps.

Losses stay on the device (one detached tensor per step, in order, warm-up included) and are read
after the last window.  Peak memory is ``max_r`` of ``torch.cuda.max_memory_allocated`` over the
windows (``None`` on a CPU).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from hidup.codegen.timing import max_over_ranks, sync


def barrier(device: torch.device, group=None) -> None:
    """Every rank of ``group`` reaches this point, with its device idle."""
    sync(device)
    max_over_ranks([0.0], group, device)
    sync(device)


def time_steps(
    step: Callable[[], torch.Tensor],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    best_of: int = 1,
    cap_s: float | None = None,
    group=None,
    phase: Callable[[str], None] | None = None,
) -> dict:
    """Time ``step()`` (one training step; returns its loss as a detached tensor) as the module
    docstring says.  ``phase(name)`` is told ``warmup`` and ``timing`` as they start.

    Returns ``iter_time_s`` (the best window's time per step), ``window_times_s`` (each window's,
    max over ranks), ``iters`` (``N``), ``best_of``, ``warmup``, ``warmup_times_s`` (this rank's),
    ``warmup_s`` (elapsed, max over ranks), ``capped`` (``N < iters`` for the time cap), ``losses``
    (a list of tensors, one per step) and ``peak_memory_bytes``."""
    if iters < 1 or best_of < 1 or warmup < 0:
        raise ValueError(
            f"time_steps needs iters >= 1, best_of >= 1, warmup >= 0; got iters={iters}, "
            f"best_of={best_of}, warmup={warmup}"
        )
    phase = phase or (lambda name: None)
    device = torch.device(device)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    phase("warmup")
    warm_times = []
    for _ in range(warmup):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step())
        sync(device)
        warm_times.append(time.perf_counter() - t0)
    last = warm_times[-1] if warm_times else 0.0
    t_w, elapsed = max_over_ranks([last, time.perf_counter() - start], group, device)
    n = iters
    if cap_s is not None and t_w > 0:
        n = int(max(1, min(iters, math.floor((cap_s - elapsed) / (best_of * t_w)))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phase("timing")
    mine = []
    for _ in range(best_of):
        barrier(device, group)
        t0 = time.perf_counter()
        for _ in range(n):
            losses.append(step())
        sync(device)
        mine.append((time.perf_counter() - t0) / n)
    windows = max_over_ranks(mine, group, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peak_all = max_over_ranks([float(peak or 0)], group, device)[0]
    return {
        "iter_time_s": min(windows),
        "window_times_s": windows,
        "iters": n,
        "best_of": best_of,
        "warmup": warmup,
        "warmup_times_s": warm_times,
        "warmup_s": elapsed,
        "capped": n < iters,
        "losses": losses,
        "peak_memory_bytes": int(peak_all) if peak is not None else None,
    }
