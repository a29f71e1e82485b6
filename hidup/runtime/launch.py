"""Start the ranks of a run and join them into one process group.

Two ways to describe the ranks:

* ``NODERANK`` + ``CPN`` (cards per node) and ``NNODES``: run one launcher per node; it spawns
  ``CPN`` processes with ``torch.multiprocessing``; process ``i`` of node ``n`` has global rank
  ``n * CPN + i``, local rank ``i`` and the world is ``NNODES * CPN``.
* torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``: the process already is one rank.

``MASTER_ADDR`` / ``MASTER_PORT`` come from flags or the environment (flags win).  The process
group uses NCCL when CUDA is available and gloo otherwise, with a timeout (120 s by default) so
that a rank that dies makes the others fail instead of hanging.

    from hidup.runtime.launch import launch
    def main(ctx, steps):              # ctx: Distributed (rank, world_size, local_rank, device, ...)
        ...
    launch(main, 100)                  # env NODERANK/CPN/NNODES or torchrun's RANK/WORLD_SIZE
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["Layout", "Distributed", "LaunchError", "layout_from_env", "init_distributed", "launch", "shutdown",
           "add_launch_args", "launch_kwargs", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 120.0


class LaunchError(RuntimeError):
    """The rank layout or rendezvous settings are missing or contradict each other."""


@dataclass(frozen=True)
class Layout:
    """Where this launcher's ranks sit.  ``local_rank`` is ``None`` until a process is spawned."""

    world_size: int
    nnodes: int
    cpn: int
    node_rank: int
    master_addr: str
    master_port: int
    local_rank: int | None = None
    source: str = "noderank"  # "noderank" | "torchrun" | "single"

    @property
    def rank(self) -> int:
        if self.local_rank is None:
            raise LaunchError("Layout.rank: no local rank yet (this launcher still has to spawn its processes)")
        return self.node_rank * self.cpn + self.local_rank


@dataclass(frozen=True)
class Distributed:
    """What a rank's function receives."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    device: torch.device
    backend: str
    layout: Layout


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {key}={value!r} is not an integer") from None


def _pick(flag, env_value):
    """Flags win over the environment."""
    return flag if flag is not None else env_value


def layout_from_env(env: Mapping[str, str] | None = None, *, nnodes: int | None = None, cpn: int | None = None,
                    node_rank: int | None = None, master_addr: str | None = None,
                    master_port: int | None = None) -> Layout:
    """Read the rank layout from ``env`` (default ``os.environ``) and flags (which win).

    Raises :class:`LaunchError` naming the variable when something is missing or contradictory."""
    env = os.environ if env is None else env
    rank, world, local = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"), _int_env(env, "LOCAL_RANK")
    cpn = _pick(cpn, _int_env(env, "CPN"))
    node_rank = _pick(node_rank, _int_env(env, "NODERANK"))
    nnodes = _pick(nnodes, _int_env(env, "NNODES"))
    addr = master_addr or env.get("MASTER_ADDR") or None
    port = master_port if master_port is not None else _int_env(env, "MASTER_PORT")

    torchrun = rank is not None or world is not None or local is not None
    if torchrun:
        missing = [k for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local)) if v is None]
        if missing:
            raise LaunchError(f"torchrun-style launch needs RANK, WORLD_SIZE and LOCAL_RANK; missing: "
                              f"{', '.join(missing)}")
        if not 0 <= rank < world:
            raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
        local_world = _int_env(env, "LOCAL_WORLD_SIZE") or cpn or world
        if not 0 <= local < local_world:
            raise LaunchError(f"LOCAL_RANK={local} is outside the {local_world} processes of a node")
        if cpn is not None:
            node = node_rank if node_rank is not None else rank // cpn
            if node * cpn + local != rank:
                raise LaunchError(f"RANK={rank} contradicts NODERANK={node} * CPN={cpn} + LOCAL_RANK={local}; "
                                  f"unset NODERANK/CPN under torchrun or make them agree")
            if nnodes is not None and nnodes * cpn != world:
                raise LaunchError(f"WORLD_SIZE={world} contradicts NNODES={nnodes} * CPN={cpn}")
        cpn_eff = cpn or local_world
        node_eff = rank // cpn_eff if world % cpn_eff == 0 else 0
        if addr is None or port is None:
            raise LaunchError("torchrun-style launch needs MASTER_ADDR and MASTER_PORT (torchrun sets both; "
                              "otherwise export them or pass --master-addr/--master-port)")
        return Layout(world, max(1, world // cpn_eff), cpn_eff, node_eff, addr, port, local, "torchrun")

    if cpn is None and node_rank is None and nnodes is None:
        return Layout(1, 1, 1, 0, addr or "127.0.0.1", port if port is not None else 29500, None, "single")
    if cpn is None:
        raise LaunchError("NODERANK/NNODES given without CPN (cards per node); export CPN=<processes per node> "
                          "or pass --cpn")
    if cpn < 1:
        raise LaunchError(f"CPN={cpn} must be at least 1")
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise LaunchError(f"NNODES={nnodes} must be at least 1")
    if node_rank is None:
        if nnodes > 1:
            raise LaunchError(f"NNODES={nnodes} needs NODERANK (this node's index, 0..{nnodes - 1}) on every node")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"NODERANK={node_rank} is outside 0..{nnodes - 1} (NNODES={nnodes})")
    if nnodes > 1 and (addr is None or port is None):
        raise LaunchError(f"a run over NNODES={nnodes} nodes needs MASTER_ADDR and MASTER_PORT of node 0 "
                          f"(export them or pass --master-addr/--master-port)")
    return Layout(nnodes * cpn, nnodes, cpn, node_rank, addr or "127.0.0.1", port if port is not None else 29500,
                  None, "noderank")


def init_distributed(layout: Layout, *, backend: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> Distributed:
    """Join this process (``layout.local_rank`` set) into the process group of ``layout``."""
    if layout.local_rank is None:
        raise LaunchError("init_distributed: the layout has no local rank; call it inside a spawned process")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not cuda:
            raise LaunchError("backend nccl needs CUDA, which is not available here; use backend gloo")
        if layout.local_rank >= torch.cuda.device_count():
            raise LaunchError(f"local rank {layout.local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                              f"set CPN to at most the number of GPUs per node")
        device = torch.device("cuda", layout.local_rank)
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail fast on a dead peer
    else:
        device = torch.device("cpu")
    if layout.world_size > 1 and not dist.is_initialized():
        kwargs = {}
        if backend == "nccl" and "device_id" in dist.init_process_group.__code__.co_varnames:
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=f"tcp://{layout.master_addr}:{layout.master_port}",
                                rank=layout.rank, world_size=layout.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Distributed(layout.rank, layout.world_size, layout.local_rank, layout.node_rank, device, backend, layout)


def dump_stacks_on_sigusr2() -> None:
    """``kill -USR2 <pid>`` of a rank prints every thread's Python stack to its stderr (a hung rank)."""
    import faulthandler
    import signal

    sig = getattr(signal, "SIGUSR2", None)
    if sig is not None:
        with contextlib.suppress(Exception):
            faulthandler.register(sig, all_threads=True)


def _child(local_rank: int, layout: Layout, fn, args, results, backend, timeout_s):
    ctx = None
    dump_stacks_on_sigusr2()
    try:
        ctx = init_distributed(replace(layout, local_rank=local_rank), backend=backend, timeout_s=timeout_s)
        out = fn(ctx, *args)
        results.put((local_rank, True, pickle.dumps(out)))
    except BaseException as e:
        user = _user_error(e)
        results.put((local_rank, False, (user, True) if user is not None else (traceback.format_exc(), False)))
        raise
    finally:
        shutdown()


def _user_error(e: BaseException) -> str | None:
    """The message of an error the user can fix (a model that cannot be built, a plan that does not
    fit it, a refused option), reported without the rank's traceback; None for anything else."""
    from hidup.models.source import ModelSourceError
    from hidup.plan import PlanError

    if isinstance(e, SystemExit) and isinstance(e.code, str):
        return e.code
    if isinstance(e, (ModelSourceError, PlanError)):
        return str(e)
    return None


def shutdown() -> None:
    """Leave the process group, if any; a peer that already died must not turn exit into an error."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(fn: Callable, *args, nnodes: int | None = None, cpn: int | None = None, node_rank: int | None = None,
           master_addr: str | None = None, master_port: int | None = None, backend: str | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
           stalled: Callable[[], str | None] | None = None) -> list:
    """Run ``fn(ctx: Distributed, *args)`` on this node's ranks and return their results by local rank.

    Under torchrun the current process is the rank.  With ``NODERANK``/``CPN`` (env or flags) this
    launcher spawns ``CPN`` processes; if one of them fails, the others are terminated and the
    failure is raised here with its traceback -- or with only its message for a user error (a
    ``SystemExit`` message, a model that cannot be built, a plan that does not fit) (a rank that dies while exiting, after every rank
    returned its result, only warns: the results are complete).  With neither, it runs one rank in this process.
    ``stalled`` (spawned ranks only) is polled twice a second: when it returns a reason, the ranks
    print their Python stacks to stderr and are killed, and :class:`LaunchError` is raised with it --
    a watchdog for hangs that no process-group timeout ends."""
    layout = layout_from_env(env, nnodes=nnodes, cpn=cpn, node_rank=node_rank, master_addr=master_addr,
                             master_port=master_port)
    if layout.source in ("torchrun", "single"):
        layout = replace(layout, local_rank=layout.local_rank or 0)
        dump_stacks_on_sigusr2()
        ctx = init_distributed(layout, backend=backend, timeout_s=timeout_s)
        try:
            return [fn(ctx, *args)]
        finally:
            if layout.world_size > 1:
                shutdown()

    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_child, args=(layout, fn, args, results, backend, timeout_s), nprocs=layout.cpn,
                               join=False, start_method="spawn")
    out: dict[int, object] = {}
    forwarded = _forward_signals(procs)
    try:
        while not procs.join(timeout=0.5):
            _drain(results, out)
            reason = stalled() if stalled is not None else None
            if reason:
                _dump_then_kill(procs.processes)
                for p in procs.processes:
                    p.join(timeout=10)
                raise LaunchError(f"the ranks of node {layout.node_rank} were stopped: {reason}")
    except LaunchError:
        raise
    except Exception as e:
        _drain(results, out)
        failures = sorted((v for v in out.values() if isinstance(v, _Failure)), key=lambda f: not f.user)
        if not failures and len(out) == layout.cpn:
            # every rank returned its result; one then died leaving (a library's teardown at exit)
            warnings.warn(f"hidup launch: every rank of node {layout.node_rank} returned its result, then one "
                          f"died on exit ({e}); the results are kept", RuntimeWarning, stacklevel=2)
            for p in procs.processes:
                p.join(timeout=10)
            return [out[r] for r in range(layout.cpn)]
        if failures and failures[0].user:
            raise LaunchError(failures[0].text) from None
        detail = failures[0].text if failures else str(e)
        raise LaunchError(f"a rank of node {layout.node_rank} failed:\n{detail}") from None
    finally:
        _restore_signals(forwarded)
    _drain(results, out)
    missing = [r for r in range(layout.cpn) if r not in out]
    if missing:
        raise LaunchError(f"local ranks {missing} exited without reporting a result")
    failures = sorted((v for v in out.values() if isinstance(v, _Failure)), key=lambda f: not f.user)
    if failures:
        if failures[0].user:
            raise LaunchError(failures[0].text)
        raise LaunchError(f"a rank of node {layout.node_rank} failed:\n{failures[0].text}")
    return [out[r] for r in range(layout.cpn)]


def _dump_then_kill(processes, grace_s: float = 1.0) -> None:
    """Kill stalled ranks, after asking each in turn for its Python stacks (SIGUSR2, printed to its
    stderr under a header naming the rank) so that the report shows where every rank was waiting."""
    import signal
    import sys

    sig = getattr(signal, "SIGUSR2", None)
    alive = [(i, p) for i, p in enumerate(processes) if p.is_alive()]
    if sig is not None:
        for i, p in alive:
            print(f"[hidup launch] stalled: Python stacks of local rank {i} (pid {p.pid}):", file=sys.stderr,
                  flush=True)
            with contextlib.suppress(OSError):
                os.kill(p.pid, sig)
            time.sleep(grace_s)  # one rank's dump at a time: they share the terminal
    for _, p in alive:
        if p.is_alive():
            p.kill()


def _forward_signals(procs) -> dict:
    """Pass SIGTERM / SIGUSR1 received by the launcher on to its ranks (they checkpoint, and on
    SIGTERM stop, at the end of the step), instead of dying and orphaning them."""
    import signal

    def forward(signum, frame):
        for p in procs.processes:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {}
    for name in ("SIGTERM", "SIGUSR1"):
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, forward)
    return previous


def _restore_signals(previous: dict) -> None:
    import signal

    for sig, handler in previous.items():
        signal.signal(sig, handler)


@dataclass
class _Failure:
    text: str
    user: bool = False  # a user error's message (no traceback)


def _drain(results, out: dict) -> None:
    while True:
        try:
            local, ok, payload = results.get_nowait()
        except (queue_mod.Empty, OSError, EOFError):
            return
        out[local] = pickle.loads(payload) if ok else _Failure(*payload)


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--nnodes --cpn --node-rank --master-addr --master-port --backend --dist-timeout``."""
    g = parser.add_argument_group("launch")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (env NNODES; default 1)")
    g.add_argument("--cpn", type=int, default=None, help="processes (cards) per node (env CPN)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's index (env NODERANK)")
    g.add_argument("--master-addr", default=None, help="address of node 0 (env MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (env MASTER_PORT)")
    g.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl with CUDA, else gloo")
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before a collective waiting on a dead rank fails (default {DEFAULT_TIMEOUT_S:g})")


def launch_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`launch` from parsed :func:`add_launch_args` flags."""
    return {"nnodes": args.nnodes, "cpn": args.cpn, "node_rank": args.node_rank, "master_addr": args.master_addr,
            "master_port": args.master_port, "backend": args.backend, "timeout_s": args.dist_timeout}
