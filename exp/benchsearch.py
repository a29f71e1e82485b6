"""Plan searches for the benchmark drivers, in a pool of CPU worker processes beside the GPU ranks.

A search *job* is (model, world, precision, model overrides, ``compiled``: whether its runs are
compiled, which sets the pricing[, profile perturbation]).  A job traces
the model on the meta device, runs ``hidup.search(graph, profile, algorithm="dp", duplication=True,
precision=...)`` and writes ``<plan dir>/<name>.json``::

    {"name", "status": "ok" | "failed", "plan": Plan.to_dict(), "error",
     "predicted": {"hidup": s, "hidup-nodup": s,    # the plan's choices priced with / without duplication,
                   "hidup-eager": s, "hidup-nodup-eager": s},  # as one CUDA graph / dispatched eagerly
     "search_s", "trace_s", "profile": {"name", "path", "sha256", "note"}}

``predicted`` uses the search's own cost model (:func:`hidup.search.schedule.evaluate`) on the
profile the plan was searched with (perturbed when the job perturbs it).  A result file whose
profile digest, job and source digest (:func:`code_digest`) match is reused, so a rerun on the same
profile with the same code searches nothing.

:class:`Searcher` waits (in a thread) until the profile file exists -- the launched ranks measure it
-- and then submits every job to a ``spawn`` process pool; ``<profile>.error`` next to the profile
(the measurement failed) makes it use the builtin fallback profile and say so in ``note``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from pathlib import Path

from exp.report import ROOT, load_json, save_json

# torch and hidup (which loads torch) are imported inside the functions: a pool worker imports this
# module before its initializer sets OMP_NUM_THREADS, which OpenMP reads once, as torch loads.

__all__ = [
    "Searcher",
    "search_job",
    "predict",
    "job_name",
    "overrides_of",
    "resolve_profile",
    "plan_identity",
]


def overrides_of(args) -> dict:
    """The model overrides given as flags (``--layers`` ...) of ``hidup.cli.model_flags.MODEL_FLAGS``."""
    from hidup.cli.model_flags import MODEL_FLAGS

    out = {}
    for flag in MODEL_FLAGS:
        v = getattr(args, flag.replace("-", "_"), None)
        if v is not None:
            out[flag.replace("-", "_")] = v
    return out


def job_name(model: str, world: int, precision: str, overrides: dict, extra: str = "") -> str:
    tag = ""
    if overrides:
        tag = "-" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    return f"{model.replace(':', '-')}-w{world}-{precision}{tag}{extra}"


def resolve_profile(text: str) -> Path:
    """The file of a builtin profile name or a profile path (checked to exist)."""
    from hidup.profiler.profile import DEFAULTS_DIR, builtin_names

    builtin = DEFAULTS_DIR / f"{text}.json"
    if "/" not in text and builtin.is_file():
        return builtin
    path = Path(text)
    if not path.is_file():
        raise SystemExit(f"--profile {text}: not a builtin profile ({', '.join(builtin_names())}) and no such file")
    return path.resolve()


def file_sha(path: Path) -> str:
    """The sha256 of a file's bytes (a profile's identity in a plan's record)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def code_digest() -> str:
    """A digest of the sources a searched plan depends on (tracer, rules, zoo, profile format and
    collective tables, cost model, search): a cached plan is reused only when they are unchanged."""
    return _digest_of(ROOT)


def _digest_of(root: Path) -> str:
    h = hashlib.sha256()
    files = [root / "hidup" / "ir.py"]
    for folder in ("hidup/frontend", "hidup/plan", "search", "profiler", "hidup/rules", "hidup/models"):
        files += sorted((root / folder).rglob("*.py"))
    for f in files:
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def plan_identity(plan_dict: dict) -> str:
    """A short digest of a plan's decisions: every node's signature and the execution mode."""
    items = sorted((k, json.dumps(v, sort_keys=True)) for k, v in plan_dict["choices"].items())
    text = json.dumps([items, bool(plan_dict["duplication"])])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def predict(graph, profile, plan, precision: str, compiled: bool) -> dict:
    """Predicted seconds per iteration of ``plan`` (its levers included: :func:`hidup.search.price`)
    under ``profile``: captured as one CUDA graph, ``compiled`` by inductor or not, with duplication
    (``hidup``) and without (``hidup-nodup``); and dispatched eagerly op by op (``-eager``)."""
    from hidup.search import price

    graphed = price(graph, profile, plan, precision, cuda_graphs=True, compiled=compiled)
    eager = price(graph, profile, plan, precision, cuda_graphs=False, compiled=False)
    return {
        "hidup": graphed[True].total,
        "hidup-nodup": graphed[False].total,
        "hidup-eager": eager[True].total,
        "hidup-nodup-eager": eager[False].total,
    }


def load_profile(job: dict):
    """The job's profile (perturbed when the job says so)."""
    from hidup.profiler import load

    profile = load(job["profile_path"])
    pert = job.get("perturb")
    if pert:
        profile = profile.perturb(
            noise=pert.get("noise", 0.0), seed=pert.get("seed", 0), comm_scale=pert.get("comm_scale", 1.0)
        )
    return profile


def search_job(job: dict) -> str:
    """Run one job and write its result file (see the module docstring); returns the job's name."""
    import torch

    import hidup.models
    from hidup.frontend.trace import trace
    from hidup.search import search

    torch.set_num_threads(1)
    prof_info = {"path": job["profile_path"], "sha256": job["profile_sha"], "note": job.get("note", "")}
    doc = {"name": job["name"], "job": {k: v for k, v in job.items() if k not in ("plan_dir",)}}
    try:
        t0 = time.perf_counter()
        model, inputs = hidup.models.build(job["model"], world_size=job["world"], device="meta", **job["overrides"])
        graph = trace(model, inputs, world_size=job["world"], half_batch=True)
        t1 = time.perf_counter()
        profile = load_profile(job)
        prof_info["name"] = profile.name
        prof_info["calibration_models"] = profile.corrections.calibration_models()  # predictions there are in-sample
        compiled = job["compiled"]  # every job says how its runs execute (benchplan, noise)
        plan = search(
            graph,
            profile,
            world_size=job["world"],
            algorithm="dp",
            duplication=True,
            precision=job["precision"],
            compiled=compiled,
        )
        t2 = time.perf_counter()
        predicted = predict(graph, profile, plan, job["precision"], compiled)
        doc.update(
            status="ok",
            plan=plan.to_dict(),
            predicted=predicted,
            search_s=t2 - t1,
            trace_s=t1 - t0,
            identity=plan_identity(plan.to_dict()),
        )
    except Exception as e:  # noqa: BLE001 - recorded in the result file
        doc.update(status="failed", error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
    doc["profile"] = prof_info
    save_json(Path(job["plan_dir"]) / f"{job['name']}.json", doc)
    return job["name"]


def _stale(old: dict | None, job: dict, profile_sha: str, code: str) -> str:
    """Why the result file ``old`` does not answer ``job`` (empty when it does)."""
    if not old or old.get("status") != "ok":
        return "no result" if not old else "it failed"
    for what, got, want in (
        ("profile", old.get("profile", {}).get("sha256"), profile_sha),
        ("code", old.get("job", {}).get("code"), code),
        ("perturbation", old.get("job", {}).get("perturb"), job.get("perturb")),
        ("overrides", old.get("job", {}).get("overrides"), job.get("overrides")),
        ("pricing", old.get("job", {}).get("compiled"), job["compiled"]),
    ):
        if got != want:
            return f"its {what} differs: {got!r} != {want!r}"
    return ""


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class Searcher:
    """Runs search jobs in a process pool once the profile file exists (see the module docstring)."""

    def __init__(
        self,
        plan_dir: Path,
        jobs: dict[str, dict],
        profile_path: Path,
        fallback: str,
        deadline: float,
        workers: int | None = None,
        reserve_cpus: int = 0,
    ):
        self.plan_dir, self.jobs, self.profile_path = Path(plan_dir), jobs, Path(profile_path)
        self.fallback, self.deadline = fallback, deadline
        cpus = os.cpu_count() or 1
        self.workers = workers if workers is not None else max(1, min(len(jobs), cpus - reserve_cpus, 16))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = None
        self._thread = threading.Thread(target=self._run_or_fail, name="hidup-bench-search", daemon=True)
        self.note = ""

    def start(self) -> None:
        self.plan_dir.mkdir(parents=True, exist_ok=True)
        if self.jobs:
            self._thread.start()

    def _profile(self) -> tuple[Path, str] | None:
        error = self.profile_path.with_name(self.profile_path.name + ".error")
        while not self._stop.is_set():
            if self.profile_path.is_file():
                return self.profile_path, ""
            if error.is_file() or time.time() > self.deadline:
                why = error.read_text().strip().splitlines()[0] if error.is_file() else "not measured in time"
                return resolve_profile(self.fallback), (
                    f"profile measurement failed ({why}); searched with the builtin profile {self.fallback}"
                )
            time.sleep(0.3)
        return None

    def _run_or_fail(self) -> None:
        """:meth:`_run`; an error of the search thread itself fails every job still without a result, so
        the ranks waiting for their plans fail with it instead of waiting out the time budget."""
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported in each job's result file
            for name, job in self.jobs.items():
                if not (self.plan_dir / f"{name}.json").is_file():
                    where = dict(plan_dir=str(self.plan_dir), profile_path=str(self.profile_path), profile_sha="")
                    self._failed(dict(job, name=name, note=self.note, **where), e)

    def _run(self) -> None:
        got = self._profile()
        if got is None:
            return
        path, self.note = got
        sha = file_sha(path)
        code = code_digest()
        todo = []
        for name, job in self.jobs.items():
            job = dict(
                job, profile_path=str(path), profile_sha=sha, note=self.note, plan_dir=str(self.plan_dir), code=code
            )
            old = load_json(self.plan_dir / f"{name}.json")
            stale = _stale(old, job, sha, code)
            if not stale:
                continue  # cached result of the same job on the same profile
            if old:
                print(f"[search] {name}: searched again ({stale})", flush=True)
            (self.plan_dir / f"{name}.json").unlink(missing_ok=True)
            todo.append(job)

        if self.workers == 0:  # in this process, one after the other (no worker start-up cost)
            for job in todo:
                if self._stop.is_set():
                    return
                search_job(job)
            return
        with self._lock:
            if not todo or self._stop.is_set():
                return
            self._pool = mp.get_context("spawn").Pool(min(self.workers, len(todo)), initializer=_init_worker)
            for job in todo:
                self._pool.apply_async(search_job, (job,), error_callback=lambda e, j=job: self._failed(j, e))
            self._pool.close()

    def _failed(self, job: dict, error: BaseException) -> None:
        save_json(
            Path(job["plan_dir"]) / f"{job['name']}.json",
            {
                "name": job["name"],
                "status": "failed",
                "error": f"search worker died: {error!r}",
                "profile": {"path": job["profile_path"], "sha256": job["profile_sha"], "note": job["note"]},
            },
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every job has finished (or ``timeout`` seconds); True when all did."""
        end = None if timeout is None else time.time() + timeout
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout)
        while self._pool is not None:
            if all((self.plan_dir / f"{n}.json").is_file() for n in self.jobs):
                return True
            if end is not None and time.time() > end:
                return False
            time.sleep(0.3)
        return all((self.plan_dir / f"{n}.json").is_file() for n in self.jobs)

    def stop(self) -> None:
        """Stop waiting and end the worker processes (searches still running are abandoned)."""
        self._stop.set()
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None
        if self._thread.is_alive():
            self._thread.join(timeout=5)
