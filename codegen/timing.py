"""Timing device work, and agreeing on a time across ranks.

Two regimes, one clock each:

- A block of work that may launch kernels on several streams (a training step, a duplicated
  program, a compiling first call): :class:`Stopwatch` synchronizes the whole device before and
  after and reads ``time.perf_counter`` in between, so every stream's work is inside the time.
  :func:`median_seconds` is the median of ``trials`` such blocks.
- A short call repeated many times (a matmul, a copy, one collective): :class:`Timer` brackets
  ``k`` back-to-back calls with CUDA events (on a CPU, ``perf_counter``), which keeps the
  synchronization's own latency (tens of microseconds) out of microsecond-scale samples.
  :func:`time_call` runs ``warmup`` untimed calls first (kernel selection, cuBLAS workspaces, page
  faults), picks ``k`` from one trial call so that a sample lasts about ``sample_s`` seconds, and
  returns the median per-call time over samples taken within ``budget_s``.  :func:`graph_time` does
  the same for calls captured as one CUDA graph (device time without host dispatch).

A synchronous step is as slow as its slowest rank: :func:`max_over_ranks` gives each value's
maximum over a process group (one all-reduce), so that every rank decides from the same numbers.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["sync", "Stopwatch", "median_seconds", "Timer", "time_call", "graph_time", "max_over_ranks"]


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """``with Stopwatch(device) as watch: ...`` then ``watch.seconds``: the wall time of the block,
    the device synchronized on entry and on exit."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.seconds: float | None = None

    def __enter__(self) -> Stopwatch:
        sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.seconds = time.perf_counter() - self._start


def median_seconds(fn: Callable[[], object], device: torch.device | str, trials: int) -> float:
    """Median wall seconds of ``trials`` calls of ``fn``, each timed by a :class:`Stopwatch`."""
    times = []
    for _ in range(trials):
        with Stopwatch(device) as watch:
            fn()
        times.append(watch.seconds)
    return statistics.median(times)


class Timer:
    """Seconds of ``iters`` back-to-back calls: CUDA events on a GPU, ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        sync(self.device)

    def measure(self, fn: Callable[[], object], iters: int) -> float:
        """Seconds for ``iters`` back-to-back calls of ``fn`` (device work included)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - t0


def time_call(
    fn: Callable[[], object],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 2,
    sample_s: float = 0.01,
    budget_s: float = 0.2,
    min_samples: int = 3,
    max_samples: int = 50,
) -> float:
    """Median seconds per call of ``fn``, bounded to about ``budget_s`` seconds of timing.

    One trial call fixes ``k`` (calls per sample, so that a sample lasts ``~sample_s``); samples are
    taken until ``budget_s`` is spent (at least ``min_samples``, at most ``max_samples``).
    """
    timer = Timer(device)
    for _ in range(max(warmup, 0)):
        fn()
    timer.sync()
    trial = max(timer.measure(fn, 1), 1e-7)
    k = max(1, min(int(sample_s / trial), 10_000))
    samples: list[float] = []
    t_start = time.perf_counter()
    while len(samples) < max_samples:
        samples.append(timer.measure(fn, k) / k)
        if len(samples) >= min_samples and time.perf_counter() - t_start >= budget_s:
            break
    return statistics.median(samples)


def max_over_ranks(values: list[float], group, device: torch.device | str) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (None: the world); ``values`` as they are
    without a process group.  Every rank of ``group`` must call this."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    on = device if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def graph_time(fn, device: torch.device, budget_s: float, reps: int) -> float | None:
    """Seconds per call of ``fn`` captured ``reps`` times as one CUDA graph and replayed; None when
    ``fn`` cannot be captured."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a failed capture warns on its way out; the caller falls back
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(reps):
                    fn()
    except Exception:  # noqa: BLE001 - a host sync or an uncapturable kernel: timed eagerly
        torch.cuda.synchronize(device)
        return None
    try:
        return time_call(graph.replay, device, warmup=1, budget_s=budget_s, sample_s=budget_s / 4) / reps
    finally:
        del graph
