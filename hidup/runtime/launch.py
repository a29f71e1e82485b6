"""Start the ranks of a run and join them into one process group.

Two ways to describe the ranks:

* ``NODERANK`` + ``CPN`` (cards per node) and ``NNODES``: run one launcher per node; it spawns
  ``CPN`` processes with ``torch.multiprocessing``; process ``i`` of node ``n`` has global rank
  ``n * CPN + i``, local rank ``i`` and the world is ``NNODES * CPN``.
* torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``: the process already is one rank.

``MASTER_ADDR`` / ``MASTER_PORT`` come from :class:`LaunchOptions` (the command line's launch flags,
:mod:`hidup.cli.launch_flags`) or the environment (the options win).  On one node,
``MASTER_PORT=0`` -- the default there when neither names a port -- makes the launcher host the
rendezvous store itself on a free port that the OS picks, so two jobs on one machine never collide
on a port; a run over several nodes needs the port of node 0 named.  The process group uses NCCL
when CUDA is available and gloo otherwise, with a timeout (120 s by default) so that a rank that
dies makes the others fail instead of hanging.

:func:`run_ranks` is the one process launcher: it spawns a node's ranks, joins them into one
process group, collects each rank's pickled result or failure, stops the others when one fails,
forwards SIGTERM/SIGUSR1 to them, and kills them (after dumping their stacks) when a watchdog says
they stalled.  Each rank follows its launcher (:func:`follow_launcher`): a launcher killed outright
(SIGKILL, which it cannot forward) takes its ranks with it within a second.  :func:`launch`
(``hidup train``, ``hidup verify``) and the tests' ``run_distributed``
both run on it.

How ranks start: on Linux from a fork server (``multiprocessing``'s ``forkserver``) that imported
torch and hidup once (:data:`PRELOAD`): a rank forked from it starts at once, where a spawned rank
spends seconds importing them.  The server lives as long as the launching process and keeps the
standard output and error it started with: ranks print where that process printed when it first
launched.  Each rank runs its ``atexit`` handlers as it ends, as a spawned one would.
``HIDUP_START_METHOD=spawn`` spawns every rank afresh instead (the default on other platforms).

Temporary files: a launching process keeps the ones it makes for its ranks (``multiprocessing``'s
``pymp-*`` folder, torch's error files) in a folder of its own, ``<tmp>/hidup-<pid>`` (under
``/tmp`` where ``<tmp>`` is too deep for the fork server's socket; :func:`job_temp_dir`), removed at
exit.  A launcher killed outright (SIGKILL) cannot remove it, so each launch first removes the
folders of launchers that are no longer alive.

When spawned ranks fail, the report names the cause, not its echoes: a rank that died without
reporting (killed by a signal, ``os._exit``, a crash in native code) is named with its global rank,
node, pid and signal or exit code -- the "connection reset" its peers then raise is left out -- and
otherwise a user error's message (:func:`user_error`: one line, no traceback) comes before another
rank's traceback.  ``HIDUP_DEBUG=1`` (``hidup --debug``) reports user errors with their tracebacks.

    from hidup.runtime.launch import launch
    def main(ctx, steps):              # ctx: Distributed (rank, world_size, local_rank, device, ...)
        ...
    launch(main, 100)                  # env NODERANK/CPN/NNODES or torchrun's RANK/WORLD_SIZE
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import faulthandler
import multiprocessing.connection as mp_connection
import multiprocessing.util as mp_util
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hidup.errors import UserError
from hidup.optionset import OptionSet

__all__ = [
    "Layout",
    "LaunchOptions",
    "Distributed",
    "LaunchError",
    "layout_from_env",
    "init_distributed",
    "launch",
    "run_ranks",
    "shutdown",
    "user_error",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 120.0
LAUNCHER_POLL_S = 1.0  # how often a rank checks that its launcher still runs (follow_launcher)
HUNG_GRACE_S = 3.0  # after a peer's timeout, how long a rank may still report before it counts as hung


class LaunchError(UserError, RuntimeError):
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
class LaunchOptions(OptionSet):
    """How :func:`launch` lays out and joins the ranks (it takes them as keywords too): ``nnodes``,
    ``cpn`` (processes per node), ``node_rank``, ``master_addr`` and ``master_port`` win over the
    environment's ``NNODES``, ``CPN``, ``NODERANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``backend``
    (None: nccl with CUDA, else gloo); ``timeout_s`` seconds before a collective waiting on a dead rank
    fails; ``announce`` prints a line on stderr as the ranks start.  The command line's launch flags
    (:mod:`hidup.cli.launch_flags`) make one."""

    nnodes: int | None = None
    cpn: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    announce: bool = False
    WHAT = "launch"


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


def layout_from_env(
    env: Mapping[str, str] | None = None,
    *,
    nnodes: int | None = None,
    cpn: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Layout:
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
            raise LaunchError(
                f"torchrun-style launch needs RANK, WORLD_SIZE and LOCAL_RANK; missing: {', '.join(missing)}"
            )
        if not 0 <= rank < world:
            raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
        local_world = _int_env(env, "LOCAL_WORLD_SIZE") or cpn or world
        if not 0 <= local < local_world:
            raise LaunchError(f"LOCAL_RANK={local} is outside the {local_world} processes of a node")
        if cpn is not None:
            node = node_rank if node_rank is not None else rank // cpn
            if node * cpn + local != rank:
                raise LaunchError(
                    f"RANK={rank} contradicts NODERANK={node} * CPN={cpn} + LOCAL_RANK={local}; "
                    f"unset NODERANK/CPN under torchrun or make them agree"
                )
            if nnodes is not None and nnodes * cpn != world:
                raise LaunchError(f"WORLD_SIZE={world} contradicts NNODES={nnodes} * CPN={cpn}")
        cpn_eff = cpn or local_world
        node_eff = rank // cpn_eff if world % cpn_eff == 0 else 0
        if addr is None or port is None:
            raise LaunchError(
                "torchrun-style launch needs MASTER_ADDR and MASTER_PORT (torchrun sets both; "
                "otherwise export them or pass --master-addr/--master-port)"
            )
        return Layout(world, max(1, world // cpn_eff), cpn_eff, node_eff, addr, port, local, "torchrun")

    if cpn is None and node_rank is None and nnodes is None:
        return Layout(1, 1, 1, 0, addr or "127.0.0.1", port if port is not None else 0, None, "single")
    if cpn is None:
        raise LaunchError(
            "NODERANK/NNODES given without CPN (cards per node); export CPN=<processes per node> or pass --cpn"
        )
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
        raise LaunchError(
            f"a run over NNODES={nnodes} nodes needs MASTER_ADDR and MASTER_PORT of node 0 "
            f"(export them or pass --master-addr/--master-port)"
        )
    if nnodes > 1 and port == 0:
        raise LaunchError(
            f"MASTER_PORT=0 (a free port picked by this launcher) works on one node only; a run over "
            f"NNODES={nnodes} nodes needs the port of node 0 that every node can be told"
        )
    return Layout(
        nnodes * cpn, nnodes, cpn, node_rank, addr or "127.0.0.1", port if port is not None else 0, None, "noderank"
    )


def init_distributed(
    layout: Layout, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, hosted_store: bool = False
) -> Distributed:
    """Join this process (``layout.local_rank`` set) into the process group of ``layout``.

    ``hosted_store``: the launcher hosts the rendezvous store at ``master_addr:master_port`` and
    every rank joins it as a client (otherwise rank 0 hosts it)."""
    if layout.local_rank is None:
        raise LaunchError("init_distributed: the layout has no local rank; call it inside a spawned process")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not cuda:
            raise LaunchError("backend nccl needs CUDA, which is not available here; use backend gloo")
        if layout.local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"local rank {layout.local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                f"set CPN to at most the number of GPUs per node"
            )
        device = torch.device("cuda", layout.local_rank)
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail fast on a dead peer
    else:
        device = torch.device("cpu")
    if layout.world_size > 1 and not dist.is_initialized():
        kwargs = {}
        if backend == "nccl" and "device_id" in dist.init_process_group.__code__.co_varnames:
            kwargs["device_id"] = device
        timeout = datetime.timedelta(seconds=timeout_s)
        if hosted_store:
            kwargs["store"] = dist.TCPStore(
                layout.master_addr, layout.master_port, layout.world_size + 1, False, timeout=timeout
            )
        else:
            kwargs["init_method"] = f"tcp://{layout.master_addr}:{layout.master_port}"
        dist.init_process_group(backend, rank=layout.rank, world_size=layout.world_size, timeout=timeout, **kwargs)
    return Distributed(layout.rank, layout.world_size, layout.local_rank, layout.node_rank, device, backend, layout)


def dump_stacks_on_sigusr2() -> None:
    """``kill -USR2 <pid>`` of a rank prints every thread's Python stack to its stderr (a hung rank)."""
    sig = getattr(signal, "SIGUSR2", None)
    if sig is not None:
        with contextlib.suppress(Exception):
            faulthandler.register(sig, all_threads=True)


def _launcher_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):  # no procfs: kill(pid, 0) answered
        return True


def follow_launcher(pid: int, poll_s: float = LAUNCHER_POLL_S) -> None:
    """End this rank when its launcher ``pid`` is gone: a launcher killed by SIGKILL forwards nothing,
    and a rank forked by the fork server would live on, training and checkpointing beside a job
    started again.  A daemon thread polls the launcher every ``poll_s`` seconds and, once it is gone,
    sends this rank SIGTERM, which a training run answers as a scheduler's preemption (it saves its
    checkpoint and exits 143); any other rank ends at once."""

    def watch() -> None:
        while _launcher_alive(pid):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="hidup-launcher-watch", daemon=True).start()


def _child(
    local_rank: int, layout: Layout, fn, args, results, backend, timeout_s, hosted_store, env, user_errors, launcher
):
    os.environ.update(env)
    follow_launcher(launcher)
    dump_stacks_on_sigusr2()
    try:
        ctx = init_distributed(
            replace(layout, local_rank=local_rank), backend=backend, timeout_s=timeout_s, hosted_store=hosted_store
        )
        if ctx.rank != 0:  # every rank traces the same model: rank 0 alone says which ops run replicated
            from hidup.frontend.trace import FallbackWarning

            warnings.filterwarnings("ignore", category=FallbackWarning)
        out = fn(ctx, *args)
        results.put((local_rank, True, pickle.dumps(out)))
    except BaseException as e:
        user = user_error(e) if user_errors and not os.environ.get("HIDUP_DEBUG") else None
        results.put((local_rank, False, (user, True) if user is not None else (traceback.format_exc(), False)))
        if isinstance(e, SystemExit):  # reported above; exiting with its message would print it again
            raise SystemExit(1) from None
        raise
    finally:
        shutdown()
        # a rank forked by the fork server ends in os._exit, which runs no atexit handler (a spawned
        # rank's interpreter runs them as it exits): run them here, once the report is in the pipe
        results.close()
        results.join_thread()
        atexit._run_exitfuncs()


_PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def user_error(e: BaseException) -> str | None:
    """The message of an error the user can fix, reported without a traceback; None for anything
    else (a bug keeps its traceback).  User errors: a ``SystemExit`` message (a refused option), every
    :class:`hidup.errors.UserError` (a model that cannot be built or traced, a plan that does not fit,
    a search with no plan, a malformed profile, a compile or CUDA-graph capture that cannot work, a
    launch setting), a path that cannot be read or written, and a checkpoint that cannot be loaded
    into the run's model."""
    if isinstance(e, SystemExit) and isinstance(e.code, str):
        return e.code
    if isinstance(e, UserError):
        return str(e)
    checkpoint = _checkpoint_error(e)
    if checkpoint is not None:
        return checkpoint
    if isinstance(e, _PATH_ERRORS) or (isinstance(e, OSError) and e.errno == errno.ENOSPC):
        return str(e)
    return None


def _checkpoint_error(e: BaseException) -> str | None:
    """The message of an error raised while :func:`hidup.runtime.checkpoint.load` reads a checkpoint
    into the run's model: a file that is not a checkpoint, of another format version, or of another
    model (its tensors do not match the model's names or shapes)."""
    from hidup.runtime import checkpoint

    if not isinstance(e, (ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError)):
        return None
    tb, path, unreadable = e.__traceback__, None, False
    while tb is not None:
        if tb.tb_frame.f_code is checkpoint.load.__code__:
            path = tb.tb_frame.f_locals.get("path")
        elif path is not None and tb.tb_frame.f_globals.get("__name__") == "torch.serialization":
            unreadable = True  # torch.load itself failed: not a file torch.save wrote
        tb = tb.tb_next
    if path is None:
        return None
    if isinstance(e, checkpoint.CheckpointDamaged):
        return (
            f"cannot resume: {e}. Fix: resume from an intact copy of the checkpoint, or start afresh "
            "(--overwrite, or another --checkpoint-dir)"
        )
    detail = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    detail = detail.strip().splitlines()[0] if detail.strip() else type(e).__name__
    if unreadable:
        detail = f"it is not a checkpoint torch.load can read ({type(e).__name__}: {detail})"
    return (
        f"cannot resume from checkpoint {path}: {detail}. Fix: resume with the model, plan options and "
        "optimizer that wrote it, or start afresh without --resume (or with another --checkpoint-dir)"
    )


def shutdown() -> None:
    """Leave the process group, if any; a peer that already died must not turn exit into an error."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(
    fn: Callable,
    *args,
    options: LaunchOptions | None = None,
    env: Mapping[str, str] | None = None,
    stalled: Callable[[], str | None] | None = None,
    **changes,
) -> list:
    """Run ``fn(ctx: Distributed, *args)`` on this node's ranks and return their results by local rank,
    laid out by ``options`` (:class:`LaunchOptions`) updated by the keyword ``changes``
    (``launch(fn, cpn=2, backend="gloo")``); ``env`` stands for ``os.environ``.

    Under torchrun the current process is the rank.  With ``NODERANK``/``CPN`` (env or options) this
    launcher spawns ``CPN`` processes; if one of them fails, the others are stopped and
    :class:`LaunchError` names the cause (module docstring): a rank that died, with its signal or
    exit code; else a user error's message (:func:`user_error`); else the failing rank's traceback.
    A rank that dies while exiting, after every rank returned its result, only warns: the results
    are complete.  With neither, it runs one rank in this process.
    ``stalled`` (spawned ranks only) is polled twice a second: when it returns a reason, the ranks
    print their Python stacks to stderr and are killed, and :class:`LaunchError` is raised with it --
    a watchdog for hangs that no process-group timeout ends.  ``announce`` prints a line on stderr as
    the ranks start (they take seconds to import torch)."""
    opts = LaunchOptions.of(options, **changes)
    backend, timeout_s = opts.backend, opts.timeout_s
    layout = layout_from_env(
        env,
        nnodes=opts.nnodes,
        cpn=opts.cpn,
        node_rank=opts.node_rank,
        master_addr=opts.master_addr,
        master_port=opts.master_port,
    )
    if layout.source in ("torchrun", "single"):
        layout = replace(layout, local_rank=layout.local_rank or 0)
        dump_stacks_on_sigusr2()
        ctx = init_distributed(layout, backend=backend, timeout_s=timeout_s)
        try:
            return [fn(ctx, *args)]
        finally:
            if layout.world_size > 1:
                shutdown()

    if opts.announce:
        print(
            f"hidup: starting {layout.cpn} ranks on node {layout.node_rank} ({backend or 'nccl if CUDA, else gloo'}"
            f"; world {layout.world_size}) ...",
            file=sys.stderr,
            flush=True,
        )
    return run_ranks(fn, args, layout, backend=backend, timeout_s=timeout_s, stalled=stalled)


# what the fork server imports once for every rank it starts (module docstring, "How ranks start")
PRELOAD = ("torch", "torch.distributed", "hidup.codegen", "hidup.runtime.train")
# imported too when the launching process has them: a rank of a model built from them imports them again
PRELOAD_IF_LOADED = ("transformers",)


def start_method() -> str:
    """How :func:`run_ranks` starts ranks: ``"forkserver"`` where the platform has it, with
    :data:`PRELOAD` (and those of :data:`PRELOAD_IF_LOADED` this process has imported) imported by
    the server before its first fork; ``"spawn"`` elsewhere, or with ``HIDUP_START_METHOD=spawn``."""
    wanted = os.environ.get("HIDUP_START_METHOD", "forkserver")
    if wanted not in ("forkserver", "spawn"):
        raise LaunchError(f"HIDUP_START_METHOD={wanted!r}: expected forkserver or spawn")
    if wanted == "spawn" or sys.platform != "linux":
        return "spawn"
    preload = [*PRELOAD, *(m for m in PRELOAD_IF_LOADED if m in sys.modules)]
    mp.get_context("forkserver").set_forkserver_preload(preload)  # no effect once the server runs
    return "forkserver"


def run_ranks(
    fn: Callable,
    args: tuple,
    layout: Layout,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    stalled: Callable[[], str | None] | None = None,
    user_errors: bool = True,
) -> list:
    """Spawn the ``layout.cpn`` ranks of this node, each running ``fn(ctx: Distributed, *args)`` in a
    process group (``backend``, collectives timing out after ``timeout_s``), and return their
    results by local rank.

    ``layout.master_port == 0``: this process hosts the rendezvous store on a free port.  ``env`` is
    set in each rank before it joins.  ``stalled`` is polled twice a second (see :func:`launch`).
    On a failure the surviving ranks are stopped and :class:`LaunchError` names the cause (module
    docstring); ``user_errors=False`` reports every rank's exception with its traceback, user error
    or not.  SIGTERM and SIGUSR1 sent to this process go on to the ranks while they run."""
    hosted = None  # the store, when this process hosts it: held until the ranks are done
    if layout.master_port == 0:
        hosted = dist.TCPStore(
            layout.master_addr,
            0,
            layout.world_size + 1,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        layout = replace(layout, master_port=hosted.port)
    job_temp_dir()
    method = start_method()
    results = mp.get_context(method).Queue()
    procs = mp.start_processes(
        _child,
        args=(
            layout,
            fn,
            args,
            results,
            backend,
            timeout_s,
            hosted is not None,
            dict(env or {}),
            user_errors,
            os.getpid(),
        ),
        nprocs=layout.cpn,
        join=False,
        start_method=method,
    )
    out: dict[int, object] = {}
    forwarded = _forward_signals(procs)
    try:
        failed = _wait(procs.processes, results, out, layout, stalled)
    except BaseException:
        _kill(procs.processes)  # an interrupt, or a stall: nothing may outlive the launcher
        _remove_error_files(procs)
        raise
    finally:
        _restore_signals(forwarded)
    try:
        return _results(procs, results, out, layout, failed)
    finally:
        _remove_error_files(procs)


_JOB_TEMP: list[str] = []  # this process's temporary folder, once made
JOB_TEMP_PREFIX = "hidup-"
# a Unix socket's path holds 107 bytes; multiprocessing puts the fork server's at
# <tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX, 32 bytes after the folder
_SOCKET_PATH_MAX, _SOCKET_TAIL = 107, 32


def job_temp_dir() -> str:
    """This launching process's temporary folder (module docstring, "Temporary files"): made on the
    first launch, with ``tempfile`` writing there from then on, after the folders of launchers no
    longer alive are removed.  Where the temporary root is so deep that the fork server's socket would
    not fit in the folder (a socket path holds at most 107 bytes), the folder is made under ``/tmp``
    instead, and where even that does not fit, the root itself.  ``multiprocessing`` keeps the folder
    it makes first for the process's lifetime, so a fork server started before the first launch keeps
    its own."""
    if _JOB_TEMP:
        return _JOB_TEMP[0]
    name = f"{JOB_TEMP_PREFIX}{os.getpid()}"
    roots = [tempfile.gettempdir()] + (["/tmp"] if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else [])
    root = next((r for r in roots if _socket_fits(os.path.join(r, name))), None)
    _remove_stale_job_dirs(root or roots[0])
    if root is None:
        _JOB_TEMP.append(roots[0])
        return roots[0]
    path = os.path.join(root, name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    tempfile.tempdir = path  # this process only: the ranks keep theirs (inductor's cache lives there)
    _JOB_TEMP.append(path)
    # after multiprocessing's own exit finalizers (exitpriority -100 removes its pymp folder in here)
    mp_util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-101)
    return path


def _socket_fits(folder: str) -> bool:
    """Whether the fork server's socket (``pymp-XXXXXXXX/listener-XXXXXXXX`` under ``folder``) fits
    the 107 bytes of a Unix socket path."""
    return len(os.fsencode(folder)) + _SOCKET_TAIL <= _SOCKET_PATH_MAX


def _remove_stale_job_dirs(root: str) -> None:
    """Remove ``<root>/hidup-<pid>`` folders whose launcher ``pid`` is no longer alive."""
    for name in os.listdir(root):
        if not name.startswith(JOB_TEMP_PREFIX):
            continue
        pid = name[len(JOB_TEMP_PREFIX) :]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_error_files(procs) -> None:
    """Delete the files torch's process starter gives each rank for its traceback
    (``/tmp/pytorch-errorfile-*``): a rank that failed wrote one, and nothing else removes it (the
    failure was reported through the results queue)."""
    for path in getattr(procs, "error_files", ()) or ():
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _results(procs, results, out: dict, layout: Layout, failed: list[int]) -> list:
    """The ranks' results by local rank, or :class:`LaunchError` naming why there are none."""
    if failed:
        exited = {i: p.exitcode for i, p in enumerate(procs.processes) if p.exitcode is not None}
        hung = _hung(procs.processes, results, out, failed)
        _stop(procs.processes)
        _drain(results, out, wait_s=0.2)  # every rank has exited: what it put is in the pipe
        raise LaunchError(_failure_report(procs.processes, out, layout, failed, exited, hung))
    missing = [r for r in range(layout.cpn) if r not in out]
    if missing:
        _drain(results, out, wait_s=2.0)
        missing = [r for r in range(layout.cpn) if r not in out]
    if missing:
        exited = {i: p.exitcode for i, p in enumerate(procs.processes)}
        raise LaunchError(_failure_report(procs.processes, out, layout, missing, exited))
    return [out[r] for r in range(layout.cpn)]


def _wait(processes, results, out: dict, layout: Layout, stalled) -> list[int]:
    """Wait for the ranks; the local ranks that failed (reported a failure, or exited non-zero), in
    the order they were seen to fail (reports in the order they came), or ``[]`` when every rank
    finished.  A rank that exits non-zero after reporting its result (a library's teardown at exit)
    only warns: its result is complete."""
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    reader = getattr(results, "_reader", None)  # wakes the loop as soon as a rank reports
    failed: list[int] = []
    died_after_result: list[int] = []
    while pending:
        ready = mp_connection.wait([*pending, *([reader] if reader is not None else [])], timeout=0.5)
        _drain(results, out)
        failed += [i for i, v in out.items() if isinstance(v, _Failure) and i not in failed]
        for sentinel in ready:
            if sentinel not in pending:
                continue
            i = pending.pop(sentinel)
            processes[i].join()
            if processes[i].exitcode == 0:
                continue
            if i not in out:
                _drain(results, out, wait_s=0.2)  # what it put before exiting may still be in the pipe
            if i in out and not isinstance(out[i], _Failure):
                died_after_result.append(i)
            elif i not in failed:
                failed.append(i)
        if failed:
            return failed
        reason = stalled() if stalled is not None and pending else None
        if reason:
            _dump_then_kill(processes)
            for p in processes:
                p.join(timeout=10)
            raise LaunchError(f"the ranks of node {layout.node_rank} were stopped: {reason}")
    if died_after_result:
        i = died_after_result[0]
        warnings.warn(
            f"hidup launch: every rank of node {layout.node_rank} returned its result, then one died on "
            f"exit (local rank {i}, {_exit_text(processes[i].exitcode)}); the results are kept",
            RuntimeWarning,
            stacklevel=3,
        )
    return failed


def _stop(processes, grace_s: float = 3.0) -> None:
    """Give the surviving ranks ``grace_s`` to fail on their own (and report), then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _exit_text(code: int | None) -> str:
    """``with exit code 3`` or ``from signal SIGKILL`` (a negative exit code)."""
    if code is None:
        return "without an exit code"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = ", often the out-of-memory killer" if name == "SIGKILL" else ""
        return f"from signal {name}{hint}"
    return f"with exit code {code}"


_TIMEOUT_WORDS = ("timed out", "timeout")


def _timed_out(failure: object) -> bool:
    """Whether a rank's reported failure is a collective that waited too long (gloo's "Timed out
    waiting", NCCL's watchdog "timeout")."""
    return isinstance(failure, _Failure) and any(w in failure.text.lower() for w in _TIMEOUT_WORDS)


def _hung(processes, results, out: dict, failed: list[int], grace_s: float = HUNG_GRACE_S) -> list[int]:
    """The local ranks that hung: where every failure is a collective's timeout, those that after
    ``grace_s`` more seconds have neither reported nor exited (a peer timed out waiting for them);
    each prints its Python stacks first (SIGUSR2), so the report shows where it was stuck."""
    if not failed or not all(_timed_out(out.get(i)) for i in failed):
        return []
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    _drain(results, out)
    hung = [i for i, p in enumerate(processes) if p.is_alive() and i not in out]
    _dump_stacks(processes, hung, "hung", grace_s=0.5)
    return hung


def _failure_report(
    processes, out: dict, layout: Layout, failed: list[int], exited: dict[int, int], hung: list[int] = ()
) -> str:
    """The cause of a failed launch, named: first a rank that exited without reporting (its peers'
    errors -- a connection reset, a timeout -- are consequences), then a rank that hung while its
    peers timed out waiting for it, then a user error, then a traceback.  ``failed``: the local ranks
    seen failing, in order; ``exited``: the exit codes of the ranks that had exited before the
    survivors were stopped; ``hung``: :func:`_hung`'s ranks."""

    def who(i: int) -> str:
        return (
            f"rank {layout.node_rank * layout.cpn + i} (node {layout.node_rank}, local rank {i}, "
            f"pid {processes[i].pid})"
        )

    dead = [i for i in failed if i not in out] + sorted(i for i in exited if i not in out and i not in failed)
    if dead:
        i = dead[0]
        others = [j for j in range(layout.cpn) if j != i]
        tail = (
            f"; the other ranks of this node ({', '.join(str(layout.node_rank * layout.cpn + j) for j in others)})"
            " were stopped (their errors follow from it)"
            if others
            else ""
        )
        return (
            f"{who(i)} died {_exit_text(exited.get(i, processes[i].exitcode))}, before reporting a result"
            f"{tail}. Its own output above, if any, says why"
        )
    if hung:
        waiting = ", ".join(str(layout.node_rank * layout.cpn + i) for i in failed)
        return (
            f"{who(hung[0])} hung: it neither finished nor failed while rank(s) {waiting} timed out in a "
            f"collective waiting for it{' (so did ' + ', '.join(who(i) for i in hung[1:]) + ')' if hung[1:] else ''}. "
            "Its Python stacks are printed above (SIGUSR2); every rank was stopped. Fix: see where it was "
            "stuck; --dist-timeout sets how long the others wait"
        )
    reported = [(i, out[i]) for i in failed if isinstance(out.get(i), _Failure)]
    reported += [(i, v) for i, v in sorted(out.items()) if isinstance(v, _Failure) and i not in failed]
    users = [(i, f) for i, f in reported if f.user]
    if users:
        return users[0][1].text
    if reported:
        i, f = reported[0]
        return f"{who(i)} failed:\n{f.text}"
    i = failed[0]
    return f"{who(i)} exited {_exit_text(processes[i].exitcode)} without reporting a result"


def _kill(processes) -> None:
    """SIGKILL the ranks still alive, and reap them."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=5)


def _dump_then_kill(processes, grace_s: float = 1.0) -> None:
    """Kill stalled ranks, after asking each in turn for its Python stacks (SIGUSR2, printed to its
    stderr under a header naming the rank) so that the report shows where every rank was waiting."""
    alive = [i for i, p in enumerate(processes) if p.is_alive()]
    _dump_stacks(processes, alive, "stalled", grace_s)
    for i in alive:
        if processes[i].is_alive():
            processes[i].kill()


def _dump_stacks(processes, ranks: list[int], why: str, grace_s: float) -> None:
    """Ask each local rank of ``ranks`` in turn for its Python stacks (SIGUSR2, printed to its stderr
    under a header naming the rank and ``why``), ``grace_s`` apart: they share the terminal."""
    sig = getattr(signal, "SIGUSR2", None)
    for i in ranks if sig is not None else ():
        print(f"[hidup launch] {why}: Python stacks of local rank {i} (pid {processes[i].pid}):", file=sys.stderr)
        sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.kill(processes[i].pid, sig)
        time.sleep(grace_s)


def _forward_signals(procs) -> dict:
    """Pass SIGTERM / SIGUSR1 received by the launcher on to its ranks (they checkpoint, and on
    SIGTERM stop, at the end of the step), instead of dying and orphaning them."""

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
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@dataclass
class _Failure:
    text: str
    user: bool = False  # a user error's message (no traceback)


def _drain(results, out: dict, wait_s: float = 0.0) -> None:
    """Move what the ranks reported into ``out``; with ``wait_s``, wait that long for the first item
    (what an exited process put may still be in the pipe)."""
    block = wait_s > 0
    while True:
        try:
            local, ok, payload = results.get(timeout=wait_s) if block else results.get_nowait()
        except (queue_mod.Empty, OSError, EOFError, ValueError):
            return
        block = False
        out[local] = pickle.loads(payload) if ok else _Failure(*payload)
