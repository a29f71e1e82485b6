"""Run a function on N gloo (or NCCL) ranks in fresh processes and collect what each rank returns.

``run_distributed(fn, world, *args)`` starts ``world`` processes (multiprocessing ``spawn``), joins
them into one gloo process group through a TCP store that this process hosts on a free port (no
port races), calls ``fn(rank, world, *args)`` on each, and returns the list of results by rank.
An exception on any rank is re-raised here with that rank's traceback; the other ranks are
terminated.  Nothing can hang: the process group has a timeout and the whole run a deadline.
Results travel pickled (tensors by value), so they survive the worker's exit.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hidup.runtime.launch import shutdown


class DistributedFailure(RuntimeError):
    """A rank raised; the message carries its traceback."""


def device() -> torch.device:
    """The device of this rank: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(fn, rank, world, port, results, args, pg_timeout, env, backend):
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        store = dist.TCPStore("127.0.0.1", port, world + 1, False,
                              timeout=datetime.timedelta(seconds=pg_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout), **kwargs)
        out = fn(rank, world, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown()


def run_distributed(fn, world: int, *args, timeout: float = 90.0, pg_timeout: float = 30.0,
                    env: dict | None = None, backend: str = "gloo"):
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` computed on ``world`` ranks
    (gloo; or NCCL with ``backend="nccl"``, rank r on GPU ``r``).

    ``fn`` must be importable (a module-level function).  ``timeout`` bounds the whole run,
    ``pg_timeout`` each collective (so a dead rank makes the others fail fast)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=pg_timeout),
                          wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, store.port, results, args, pg_timeout, env or {},
                                                       backend),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run_distributed({fn.__name__}, world={world}) did not finish in {timeout} s; "
                                   f"ranks done: {sorted(out)}")
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in out]
                if dead:
                    time.sleep(0.5)  # let a rank that reported an error get its message through
                    if results.empty():
                        raise DistributedFailure(f"rank(s) {dead} of {fn.__name__} died with exit codes "
                                                 f"{[procs[r].exitcode for r in dead]} and no report") from None
                continue
            if not ok:
                raise DistributedFailure(f"rank {rank} of {fn.__name__} (world {world}) raised:\n{payload}")
            out[rank] = pickle.loads(payload)
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        del store
