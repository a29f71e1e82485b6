"""The runs of one ``exp/bench.py`` invocation: which to make, in which order, and how the records of a
run's rounds become one.

A *run* is one (world, model, precision, method); with ``--repeats R`` it is made in ``R`` rounds, each
round one record keyed ``<key>#<round>`` (``id``).  :func:`plan_runs` lists them with the search jobs
they need, :func:`resume_runs` leaves out what a results file already records as ok, :func:`pick` is
rank 0's choice of the next run inside a process group (with the run's time cap, per timed loop: a
baseline times each of its variants), and :func:`merge_rounds` makes one record per
run from its rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from exp import benchsearch
from exp.benchrun import VARIANT_METHODS
from exp.benchsearch import job_name
from exp.report import load_json


def run_key(world: int, model: str, precision: str, method: str) -> str:
    return f"w{world}/{model}/{precision}/{method}"


def _group(run: dict) -> tuple:
    return run["world"], run["model"], run["precision"]


def pick(pending: list[dict], cfg: dict) -> dict:
    """Rank 0's choice of the next run: a hidup run whose plan is ready, else the next baseline, else
    the first hidup run (which then waits for its plan); with the time cap of each of its timed
    loops (the time left shared over the timed loops left, :func:`timed_parts`)."""
    left = cfg["deadline"] - time.time() - cfg["reserve_s"]
    if left < cfg["min_run_s"]:
        return {
            "skip": "time budget exhausted before this run could start (raise --time-budget or run fewer "
            "models/worlds per command)"
        }
    runs_left = sum(timed_parts(r, cfg) for r in pending) + cfg["future_runs"]
    cap = min(cfg["run_cap"], max(cfg["min_run_s"], 0.7 * left / runs_left))  # per timed part
    plan_dir = Path(cfg["plan_dir"])
    # with --repeats, a run waits for the earlier rounds of its (world, model, precision): each round
    # runs every method once, so slow drift of the host or network reaches every method alike
    first_round: dict[tuple, int] = {}
    for r in pending:
        first_round[_group(r)] = min(first_round.get(_group(r), r["round"]), r["round"])
    due = [i for i, r in enumerate(pending) if r["round"] == first_round[_group(r)]]
    ready = [i for i in due if pending[i].get("plan") and (plan_dir / f"{pending[i]['plan']}.json").is_file()]
    base = [i for i in due if not pending[i].get("plan")]
    index = (ready or base or due)[0]
    return {"skip": "", "index": index, "cap": cap}


def timed_parts(run: dict, cfg: dict) -> int:
    """How many timed loops ``run`` makes: a baseline one per variant it can run here
    (``cfg["variant_units"]``), any other method one."""
    return cfg.get("variant_units", 1) if run["method"] in VARIANT_METHODS else 1


def plan_runs(args) -> tuple[dict[int, list[dict]], dict[str, dict]]:
    """Runs per world (in order) and the search jobs they need."""
    overrides = benchsearch.overrides_of(args)
    per_world, jobs = {}, {}
    on_gpu = torch.cuda.is_available() or getattr(args, "search_only", False)  # a search-only call plans for GPUs
    prec_search = {p: (p if on_gpu else "fp32") for p in args.precisions}
    for world in sorted(set(args.worlds), reverse=True):
        runs = []
        for model in args.models:
            for precision in args.precisions:
                name = job_name(model, world, prec_search[precision], overrides)
                for rnd in range(args.repeats):
                    for method in args.methods:
                        key = run_key(world, model, precision, method)
                        r = {
                            "key": key,
                            "id": key if args.repeats == 1 else f"{key}#{rnd}",
                            "round": rnd,
                            "world": world,
                            "model": model,
                            "precision": precision,
                            "method": method,
                        }
                        if method.startswith("hidup"):
                            r["plan"] = name
                            jobs[name] = {
                                "name": name,
                                "model": model,
                                "world": world,
                                "precision": prec_search[precision],
                                "overrides": overrides,
                                "compiled": on_gpu,  # hidup's captured methods run compiled on GPUs only
                            }
                        runs.append(r)
        per_world[world] = runs
    return per_world, jobs


def resume_runs(per_world: dict[int, list[dict]], jobs: dict[str, dict], results: Path):
    """``per_world`` without the runs ``results`` already records as ok, and the search jobs the
    remaining runs need (``--resume``)."""
    done = {r["key"] for r in (load_json(results, {}) or {}).get("runs", []) if r.get("status") == "ok"}
    left = {w: [r for r in runs if r["key"] not in done] for w, runs in per_world.items()}
    kept = sum(len(runs) for runs in per_world.values()) - sum(len(runs) for runs in left.values())
    print(
        f"[bench] --resume: {kept} runs already recorded as ok in {results}, "
        f"{sum(len(runs) for runs in left.values())} to run",
        flush=True,
    )
    needed = {r["plan"] for runs in left.values() for r in runs if "plan" in r}
    return {w: runs for w, runs in left.items() if runs}, {n: j for n, j in jobs.items() if n in needed}


def merge_rounds(records: dict[str, dict]) -> dict[str, dict]:
    """One record per run key from the records of its rounds (``--repeats``), by key.

    A single round is kept as it is.  For several, the record is that of the median round (the lower
    one for an even count; its steps, losses, trial and trace) with ``iter_time_s`` the median of the
    rounds' medians, the peak memory the largest, and ``rounds``: each round's status, time and steps.
    A round that failed is listed there; the run fails only when every round failed (with the first
    error)."""
    by_key: dict[str, list[dict]] = {}
    for rec in records.values():
        by_key.setdefault(rec["key"], []).append(rec)
    out = {}
    for key, recs in by_key.items():
        recs.sort(key=lambda r: r.get("round", 0))
        ok = [r for r in recs if r.get("status") == "ok"]
        base = dict(sorted(ok, key=lambda r: r["iter_time_s"])[(len(ok) - 1) // 2] if ok else recs[0])
        base.pop("id", None)
        base.pop("round", None)
        out[key] = base
        if len(recs) == 1:
            continue
        base["rounds"] = [
            {
                "round": r.get("round", 0),
                "status": r.get("status"),
                "iter_time_s": r.get("iter_time_s"),
                "iters": r.get("iters"),
                "date": r.get("date"),
            }
            for r in recs
        ]
        if ok:
            times = [r["iter_time_s"] for r in ok]
            median = statistics.median(times)
            for field in ("samples_per_s", "throughput"):  # rates per step: rescaled to the median time
                if base.get(field) is not None:
                    base[field] *= base["iter_time_s"] / median
            base["iter_time_s"] = median
            base["round_spread"] = max(times) / min(times)
            peaks = [r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes") is not None]
            base["peak_memory_bytes"] = max(peaks) if peaks else None
    return out
