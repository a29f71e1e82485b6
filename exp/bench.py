"""Side-by-side benchmark of hidup and the baselines on one network, in one process group per world size.

    python exp/bench.py --network nvlink  --worlds 2 4 --models bert-sgmoe bert-switch vit-sgmoe vit-switch \
        --precisions tf32 bf16 --out exp/records/
    python exp/bench.py --network sockets              # the same matrix over NCCL's socket transport

The network flag sets NCCL's environment before any process group exists (``sockets``:
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``; always ``NCCL_NVLS_ENABLE=0``).  Then, for each world size
``N`` (largest first), the ranks are launched once and, inside that group:

1. (first group only) a quick profile of this network is measured with
   ``hidup.profiler.measure.machine.profile_machine`` (collective tables: the median of ``--comm-rounds``
   passes) -- with the per-op times of every benchmarked model at
   its sharded and half-batch shapes, for every world size and precision, the ranks splitting them --
   and saved as ``<out>/<network>-profile.json`` (``--ops-from P`` takes the per-op times already in
   profile ``P`` -- compute does not depend on the network -- and times only the shapes it lacks;
   ``--calibrate-plans M ...`` then times the searched plans of models ``M`` on the ranks and stores the
   cost model's compute factors inside the distributed program, ``hidup profile --calibrate-plans``);
2. every (model, precision) runs ``single`` (one rank's share, the floor), ``ddp``, ``fsdp``, ``expert``
   (MoE models) -- each in the variants ``--variants`` (eager, torch.compile, the whole step as one
   CUDA graph, both; fused Adam), reporting its fastest variant that ran and recording the others,
   failures included --, ``hidup`` (the plan searched with the measured profile and that precision, duplication
   on) and ``hidup-nodup`` (the same plan, duplication off), both with forward and backward captured
   as one CUDA graph; on request also ``single-graph`` (the floor captured the same way),
   ``single-dup`` (the floor run as two duplicated copies on two streams, captured the same way),
   ``hidup-auto`` (the plan with duplication on or off by a short timed trial, as ``hidup train``
   runs it by default) and
   ``hidup-eager`` / ``hidup-nodup-eager`` (no capture); see ``exp/benchrun.py`` for the timing.

Plans are searched (DP, duplication-aware) in a pool of CPU worker processes of this launcher as soon
as the profile exists, while the group runs the baselines; a run whose plan is ready goes first.  Plans
are cached in ``<out>/plans/<network>/`` by (model, world, precision, overrides, profile digest).

Timing (every method alike, ``exp/baselines/timing.py``): ``--warmup`` untimed steps, then the best of
``--best-of`` windows of ``N <= --iters`` steps between two device syncs, each window's per-step time
``(t_end - t_start) / N`` taken as the max over ranks.

Reported per run: iteration time ``t`` (the best window's; for a baseline, of its fastest variant,
named in ``variant``); throughput ``B * S / t`` tokens/s for language models
and ``B / t`` images/s for ViTs (``B`` the groups in the step: ``batch_per_gpu * N``, or
``batch_per_gpu`` for ``single``); scaling efficiency ``t_single / t`` (weak scaling: perfect scaling
keeps the per-rank share's time); peak memory (max over ranks); for hidup the predicted iteration time
of the plan in that mode and ``measured / predicted``.

Repeats: ``--repeats R`` runs each (world, model, precision) in ``R`` rounds, every method once per
round, a round starting only when the one before it is done; a run then reports the median of its
rounds' times (``rounds`` lists each; ``exp/benchplan.py``), and the summary table gives each ratio
with its range over the rounds' pairs.  Over sockets one run of a plan can differ from the next by a
quarter; rounds keep such drift from landing on one method only.

Time bounds: each run (each variant of a baseline) does ``--warmup`` steps and at most ``--best-of`` x
``--iters`` timed steps within ``--run-cap`` seconds (fewer near the end of the budget); no new run
starts after ``--time-budget`` seconds; a run that fails (OOM, error, a crashed rank) is recorded
with its error and the sweep continues (a crashed group is relaunched for the remaining runs, and a
baseline keeps the variants it finished before the crash; so is a group whose run has not finished
after ``--stall-timeout`` seconds).  Results merge into ``<out>/<network>.json`` (a rerun replaces
the runs it repeats; a run it did not reach keeps its earlier result, and ``--resume`` runs only
what is not yet recorded as ok, on the profile already in ``<out>``), ``docs/benchmarks.md`` gets
this network's section and ``benchmarks.png`` beside it the figure; a compact table is printed at the
end.  ``--breakdown`` also records one profiled step per run (chrome trace under
``<out>/traces/``, analyzed by exp/breakdown.py).

On a CPU the same command runs on gloo ranks (tiny models: ``--layers 2 --d-model 32 ...``); tf32 and
bf16 then run as fp32, which the records note.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hidup.models
from exp import benchrun as br
from exp import benchsearch
from exp.baselines.harness import VARIANTS
from exp.benchplan import merge_rounds, pick, plan_runs, resume_runs, timed_parts
from exp.benchreport import bench_finish
from exp.benchrun import METHODS
from exp.benchsearch import Searcher
from exp.report import ROOT, command_line, hardware, load_json, save_json
from hidup.cli.model_flags import add_model_flags
from hidup.plan import Plan
from hidup.profiler.measure.machine import profile_machine
from hidup.profiler.profile import load as load_profile
from hidup.runtime.launch import LaunchError, launch

NETWORK_ENV = {"nvlink": {}, "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}}
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0"}
FALLBACK_PROFILE = {"nvlink": "h200x4-nvlink", "sockets": "h200x4-socket"}
DEFAULT_MODELS = ("bert-sgmoe", "bert-switch", "vit-sgmoe", "vit-switch")
DEFAULT_METHODS = ("single", "ddp", "fsdp", "expert", "hidup", "hidup-nodup")


def apply_network(network: str) -> dict:
    """Set the NCCL environment of ``network`` in this process (children inherit it); returns it."""
    if network not in NETWORK_ENV:
        raise ValueError(f"unknown network {network!r}; choose from {', '.join(NETWORK_ENV)}")
    env = dict(COMMON_ENV, **NETWORK_ENV[network])
    for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        if k not in env:
            os.environ.pop(k, None)
    os.environ.update(env)
    return env


# =============================================================================== rank side
def child_main(ctx, cfg: dict) -> None:
    """Everything one rank does inside the launched group (see the module docstring)."""
    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    partial = Path(cfg["partial"])

    def emit(event: dict) -> None:
        if rank == 0:
            with open(partial, "a") as f:
                f.write(json.dumps(event, default=str) + "\n")

    if cfg.get("measure_profile"):
        measure_profile(cfg, device)
    models: dict[str, tuple] = {}
    pending = list(cfg["runs"])
    while pending:
        choice = br.broadcast(pick(pending, cfg) if rank == 0 else None, device)
        if choice["skip"]:
            for run in pending:
                emit({"event": "result", "record": dict(run, status="skipped", error=choice["skip"])})
            break
        run = pending.pop(choice["index"])
        emit({"event": "start", "key": run["id"]})
        record = dict(run, network=cfg["network"], device=str(device), date=time.strftime("%Y-%m-%d %H:%M:%S"))
        record["precision_run"] = br.effective_precision(run["precision"], device)
        if run["model"] not in models:
            models.clear()  # one model's weights at a time
            try:
                models[run["model"]] = hidup.models.build(run["model"], world_size=world, seed=0, **cfg["overrides"])
            except Exception as e:  # noqa: BLE001 - a bad override fails this model's runs only
                models[run["model"]] = e
        built = models[run["model"]]
        plan_doc = None
        if isinstance(built, Exception):
            result = {"status": "failed", "error": f"building {run['model']}: {type(built).__name__}: {built}"}
        elif br.applicable(run["method"], built[0]):
            result = {"status": "skipped", "error": br.applicable(run["method"], built[0])}
        else:
            if run["method"] in br.HIDUP_METHODS:
                plan_doc = _wait_plan(run["plan"], cfg, device)
            if plan_doc is not None and plan_doc.get("status") != "ok":
                result = {"status": "failed", "error": f"search: {plan_doc.get('error')}"}
            else:
                plan = Plan.from_dict(plan_doc["plan"]) if plan_doc is not None else None
                trace_name = f"{cfg['network']}-{run['id'].replace('/', '-').replace('#', '-r')}.json"
                trace = Path(cfg["out"]) / "traces" / trace_name if cfg.get("breakdown") else None
                result = br.execute(
                    run["method"],
                    built[0],
                    built[1],
                    rank,
                    world,
                    device,
                    record["precision_run"],
                    warmup=cfg["warmup"],
                    iters=cfg["iters"],
                    cap_s=choice["cap"],
                    plan=plan,
                    trace_path=trace,
                    variants=cfg["variants"],
                    best_of=cfg["best_of"],
                    compile_backend=cfg["compile_backend"],
                    on_variant=lambda v, summary, key=run["id"]: emit(
                        {"event": "variant", "key": key, "variant": v, "summary": summary}
                    ),
                    phase=lambda name, key=run["id"]: emit({"event": "phase", "key": key, "phase": name}),
                )
        record.update(result)
        if record["status"] == "ok":
            _throughput(record, work_shape(built[0], built[1], world), world)
            if plan_doc is not None:
                priced = run["method"]
                if priced == "hidup-auto":  # priced in the mode its trial kept
                    priced = "hidup" if record.get("info", {}).get("duplication") else "hidup-nodup"
                record["predicted_s"] = plan_doc["predicted"].get(priced)
                record["search_s"] = plan_doc.get("search_s")
                record["plan_duplication"] = plan_doc["plan"]["duplication"]
                record["profile"] = plan_doc.get("profile")
        if plan_doc is not None and plan_doc.get("profile", {}).get("note"):
            record["note"] = plan_doc["profile"]["note"]
        emit({"event": "result", "record": record})
        if rank == 0:
            t = record.get("iter_time_s")
            print(
                f"[bench {cfg['network']}] {run['id']}: {record['status']}"
                + (f" {t * 1e3:.2f} ms x{record['iters']}" if t else f" ({str(record.get('error'))[:120]})")
                + (f" [{record['variant']} of {', '.join(record['variants'])}]" if record.get("variant") else ""),
                flush=True,
            )


def measure_profile(cfg: dict, device) -> None:
    """Measure this network's profile on every rank (quick, time-bounded); rank 0 writes it.  A failure
    leaves ``<profile>.error`` so that the searches fall back to the builtin profile."""
    path = Path(cfg["profile"])
    error = ""
    ops_models = [(m, cfg["overrides"]) for m in cfg["models"]] if cfg["ops_seconds"] > 0 else None
    try:
        profile_machine(
            None,
            progress=False,
            device=device,
            out=path,
            quick=True,
            budget_s=cfg["profile_budget"],
            name=f"{cfg['network']}-measured",
            merge=cfg.get("ops_from"),
            ops_models=ops_models,
            ops_worlds=cfg["worlds"],
            ops_precisions=tuple(cfg["precisions"]),
            ops_seconds=cfg["ops_seconds"],
            comm_rounds=cfg["comm_rounds"],
            calibrate_plans=[(m, cfg["overrides"]) for m in cfg.get("calibrate_plans") or []],
        )
    except Exception as e:  # noqa: BLE001 - reported through the marker file
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
    failed = br.reduce_max([1.0 if error else 0.0], device)[0] > 0
    if failed and (not br.distributed() or __import__("torch").distributed.get_rank() == 0):
        path.with_name(path.name + ".error").write_text(error or "another rank failed to measure the profile")


def _wait_plan(name: str, cfg: dict, device) -> dict:
    """The search result ``name`` on every rank, polled until it exists or the budget runs out."""

    path = Path(cfg["plan_dir"]) / f"{name}.json"
    while True:
        doc = None
        if not br.distributed() or __import__("torch").distributed.get_rank() == 0:
            if path.is_file():
                doc = load_json(path)
            elif time.time() > cfg["deadline"]:
                doc = {"status": "failed", "error": f"the plan {name} was not found before the time budget ran out"}
        doc = br.broadcast(doc, device)
        if doc is not None:
            return doc
        time.sleep(1.0)


@dataclass(frozen=True)
class WorkShape:
    """What one step of a model processes, for its throughput: ``groups_per_gpu`` sequences (or
    images) per rank, ``tokens_per_group`` tokens each (None for images), ``num_parameters``."""

    groups_per_gpu: int
    tokens_per_group: int | None
    num_parameters: int


def work_shape(model, inputs: tuple, world: int) -> WorkShape:
    """The :class:`WorkShape` of a built model: a zoo model's from its config; a factory's (a
    ``transformers`` step taking ``(input_ids, labels)``) from its first input, ``[groups, tokens]``
    for the global batch of ``world`` ranks."""
    cfg = getattr(model, "config", None)
    params = sum(p.numel() for p in model.parameters())
    if isinstance(cfg, hidup.models.ModelConfig):
        tokens = None if cfg.family == "vit" else cfg.tokens_per_group
        return WorkShape(cfg.batch_per_gpu, tokens, params)
    first = inputs[0]
    if first.dim() < 2 or first.shape[0] % world:
        raise ValueError(
            f"a factory model's first input must be [groups, tokens] with groups a multiple of {world}; "
            f"got shape {tuple(first.shape)}"
        )
    return WorkShape(first.shape[0] // world, int(first.shape[1]), params)


def _throughput(record: dict, shape: WorkShape, world: int) -> None:
    groups = shape.groups_per_gpu * (1 if record["method"].startswith("single") else world)
    t = record["iter_time_s"]
    record["samples_per_s"] = groups / t
    if shape.tokens_per_group is None:
        record["throughput"], record["unit"] = groups / t, "img/s"
    else:
        record["throughput"], record["unit"] = groups * shape.tokens_per_group / t, "tok/s"
    record["num_parameters"] = shape.num_parameters
    record["global_batch"] = groups


# =============================================================================== launcher side
def read_partial(path: Path) -> tuple[dict, list[str], dict]:
    """(records by key, keys started, {key: {variant: summary}} of the variants finished) from a
    group's progress file."""
    records, started, variants = {}, [], {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if ev.get("event") == "start":
                started.append(ev["key"])
            elif ev.get("event") == "variant":
                variants.setdefault(ev["key"], {})[ev["variant"]] = ev["summary"]
            elif ev.get("event") == "result":
                records[ev["record"].get("id", ev["record"]["key"])] = ev["record"]
    return records, started, variants


def crashed_record(run: dict, error: str, variants: dict, cfg: dict, world: int) -> dict:
    """The record of a run during which the process group failed.  A baseline whose earlier variants
    finished keeps them: it reports the fastest of those (``ok``), and the variant that was running
    is recorded as failed with the group's error; otherwise the run failed."""
    record = dict(run, network=cfg["network"], status="failed", error=error)
    if not variants:
        return record
    running = next((v for v in cfg["variants"] if v not in variants), None)
    summaries = dict(variants)
    if running is not None:
        summaries[running] = {"status": "failed", "error": error}
    record["variants"] = summaries
    ran = {v: x for v, x in variants.items() if x.get("status") == "ok"}
    if ran:
        best = min(ran, key=lambda v: ran[v]["iter_time_s"])
        record.update(
            ran[best],
            status="ok",
            variant=best,
            variants=summaries,
            precision_run=br.effective_precision(
                run["precision"], torch.device("cuda" if torch.cuda.is_available() else "cpu")
            ),
        )
        record.pop("error", None)
        model, inputs = hidup.models.build(run["model"], world_size=world, device="meta", **cfg["overrides"])
        _throughput(record, work_shape(model, inputs, world), world)
    return record


def stall_watch(partial: Path, limit_s: float):
    """A ``launch(stalled=...)`` check: a reason once the run in progress (the progress file's last
    event is its start, one of its phases or one of its finished variants) has gone ``limit_s``
    seconds without a result or a next phase -- naming the phase it stopped in; None otherwise."""

    def stalled() -> str | None:
        try:
            st = partial.stat()
            lines = partial.read_text().splitlines()
        except OSError:
            return None
        if limit_s <= 0 or not lines or time.time() - st.st_mtime < limit_s:
            return None
        try:
            last = json.loads(lines[-1])
        except json.JSONDecodeError:
            return None
        if last.get("event") not in ("start", "phase", "variant"):
            return None
        where = f" in phase {last['phase']!r}" if last.get("phase") else ""
        return f"run {last.get('key')} made no progress{where} for {limit_s:.0f} s (--stall-timeout)"

    return stalled


def run_world(world: int, runs: list[dict], cfg: dict, args) -> dict:
    """Launch ``world`` ranks for ``runs`` (relaunching after a crash while time is left)."""
    records: dict = {}
    for attempt in range(1 + args.relaunch):
        todo = [r for r in runs if r["id"] not in records]
        if not todo or time.time() > cfg["deadline"] - cfg["min_run_s"]:
            break
        partial = Path(args.out) / f".partial-{args.network}-w{world}.jsonl"
        partial.unlink(missing_ok=True)
        wcfg = dict(cfg, runs=todo, partial=str(partial), measure_profile=cfg["measure_profile"] and attempt == 0)
        error = None
        try:
            launch(
                child_main,
                wcfg,
                nnodes=1,
                cpn=world,
                node_rank=0,
                master_addr="127.0.0.1",
                master_port=0,
                timeout_s=args.dist_timeout,
                stalled=stall_watch(partial, args.stall_timeout),
            )
        except (LaunchError, RuntimeError) as e:
            error = str(e)
        done, started, variants = read_partial(partial)
        records.update(done)
        partial.unlink(missing_ok=True)
        if error is None:
            break
        crashed = [k for k in started if k not in done] or [todo[0]["id"]]
        for r in todo:
            if r["id"] in crashed:
                records[r["id"]] = crashed_record(
                    r,
                    f"the process group failed during this run: {error[-3000:]}",
                    variants.get(r["id"], {}),
                    cfg,
                    world,
                )
        print(
            f"[bench {args.network}] world {world}: the group failed during {crashed[0]}; "
            f"{'relaunching for the remaining runs' if attempt < args.relaunch else 'giving up'}",
            flush=True,
        )
    for r in runs:
        records.setdefault(
            r["id"],
            dict(r, network=args.network, status="skipped", error="not run: time budget exhausted or the group failed"),
        )
    return records


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--network", choices=sorted(NETWORK_ENV), default="nvlink")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--precisions", nargs="+", choices=("fp32", "tf32", "bf16"), default=["tf32", "bf16"])
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(DEFAULT_METHODS),
        help=f"default: {' '.join(DEFAULT_METHODS)}",
    )
    p.add_argument("--out", type=Path, default=ROOT / "exp" / "records", help="results directory")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where benchmarks.md/.png are written")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    p.add_argument(
        "--iters", type=int, default=10, help="steps per timed window (between two device syncs) at most (default 10)"
    )
    p.add_argument(
        "--best-of",
        type=int,
        default=3,
        metavar="K",
        help="timed windows per run (per variant), the fastest reported: the same for every method (default 3)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the variants each baseline (single, ddp, fsdp, expert) runs in, its fastest reported: "
        "eager, compile (torch.compile), graph (the whole step as one CUDA graph), compile-graph "
        "(default: all; CUDA-graph variants are recorded as skipped on a CPU)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled variants (default inductor; aot_eager checks the "
        "compiled path where inductor is too slow to build, e.g. on a small CPU)",
    )
    p.add_argument(
        "--run-cap",
        type=float,
        default=25.0,
        help="seconds of stepping per run (per variant of a baseline) at most (default 25)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run every method R times, in R rounds of all methods per (world, model, precision); a "
        "run reports the median of its rounds (default 1)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds after which no run starts (default 480, for a < 9 min command)",
    )
    p.add_argument("--profile", default=None, help="use this profile (builtin name or path) instead of measuring")
    p.add_argument(
        "--search-only",
        action="store_true",
        help="search the plans the runs need on --profile (in each run's precision, as on a GPU host), "
        "write them with their predictions to <out>/plans/<network>/ and stop without launching: "
        "committed, they register the predictions of a later run on the same profile and code",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs <out>/<network>.json already records as ok and, without --profile, reuse "
        "<out>/<network>-profile.json: a matrix larger than one time budget completes over "
        "several invocations",
    )
    p.add_argument("--profile-budget", type=float, default=0.1, help="seconds per measured point (default 0.1)")
    p.add_argument(
        "--comm-rounds",
        type=int,
        default=3,
        metavar="R",
        help="passes over the collective tables of the measured profile, each point keeping its median "
        "(default 3: a sockets network drifts over seconds)",
    )
    p.add_argument(
        "--ops-seconds",
        type=float,
        default=60.0,
        help="per-op timing of the models at their sharded and half-batch shapes, seconds per "
        "(model, world, precision) and rank at most (default 60; 0: price ops by the roofline)",
    )
    p.add_argument(
        "--ops-from",
        type=Path,
        default=None,
        metavar="PROFILE",
        help="take the per-op times of this profile (e.g. one measured on another network of the same "
        "GPUs) into the measured profile and time only the shapes it lacks",
    )
    p.add_argument(
        "--calibrate-plans",
        nargs="*",
        default=None,
        metavar="MODEL",
        help="when measuring the profile: time these models' searched plans on the ranks, without and "
        "with duplication, and store the cost model's compute factors inside the distributed "
        "program (hidup profile --calibrate-plans); with --profile, nothing is measured",
    )
    p.add_argument(
        "--search-jobs",
        type=int,
        default=None,
        help="parallel search processes (default: by CPUs; 0: search in this process)",
    )
    p.add_argument("--breakdown", action="store_true", help="trace one step per run and break its time down")
    p.add_argument("--relaunch", type=int, default=1, help="relaunches of a group that crashed (default 1)")
    p.add_argument("--dist-timeout", type=float, default=120.0, help="process-group timeout in seconds")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=180.0,
        help="seconds a run may go without finishing before its group is killed and relaunched for "
        "the remaining runs (a hang no process-group timeout ends; 0: never)",
    )
    add_model_flags(p.add_argument_group("model overrides (applied to every model)"))
    return p.parse_args(argv)


def search_only(plan_dir: Path, jobs: dict, profile_path: Path, args) -> int:
    """``--search-only``: search every plan the runs need on ``profile_path`` (as a GPU host would,
    in its precision) into ``plan_dir``, print each plan's predictions and stop.  Committed before a
    run on the same profile and code, they are its registered predictions (the run reuses them)."""
    if not profile_path.is_file():
        raise SystemExit(f"--search-only needs a profile that exists (--profile); {profile_path} does not")
    searcher = Searcher(plan_dir, jobs, profile_path, FALLBACK_PROFILE[args.network], float("inf"), workers=0)
    searcher.start()
    searcher.wait()
    failed, registered = 0, {}
    for name in jobs:
        doc = load_json(plan_dir / f"{name}.json") or {}
        if doc.get("status") != "ok":
            failed += 1
            print(f"{name}: failed: {str(doc.get('error', 'no result'))[:300]}")
            continue
        ms = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in doc["predicted"].items())
        print(f"{name}: duplication {doc['plan']['duplication']}; {ms}; searched in {doc['search_s']:.1f} s")
        registered[name] = {k: doc[k] for k in ("identity", "predicted")}
        registered[name]["duplication"] = doc["plan"]["duplication"]
    record = args.out / f"{args.network}-registered.json"
    save_json(
        record,
        {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "profile": {"path": str(profile_path), "sha256": benchsearch.file_sha(profile_path)},
            "code": benchsearch.code_digest(),
            "plans": registered,
        },
    )
    print(f"registered predictions: {record} (commit it before the runs; the plan files are not kept by git)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    env = apply_network(args.network)

    for flag, names in (("--models", args.models), ("--calibrate-plans", args.calibrate_plans or [])):
        unknown = [m for m in names if m not in hidup.models.names() and not hidup.models.is_factory(m)]
        if unknown:
            raise SystemExit(
                f"{flag}: unknown model(s) {', '.join(unknown)}; the zoo has {', '.join(hidup.models.names())}, "
                f"or name a factory as package.module:function (e.g. exp.rank_models:llama)"
            )
    if args.repeats < 1 or args.comm_rounds < 1 or args.best_of < 1:
        raise SystemExit(
            f"--repeats {args.repeats} / --comm-rounds {args.comm_rounds} / --best-of {args.best_of}: "
            f"each must be at least 1"
        )
    if min(args.worlds) < 2:
        raise SystemExit(
            "--worlds: every world size must be at least 2 (the single-rank floor is the 'single' method of each world)"
        )
    if torch.cuda.is_available() and max(args.worlds) > torch.cuda.device_count():
        raise SystemExit(
            f"--worlds {max(args.worlds)} needs {max(args.worlds)} GPUs; this host has {torch.cuda.device_count()}"
        )
    if args.ops_from is not None:
        try:
            carried = load_profile(args.ops_from)
        except Exception as e:  # noqa: BLE001 - reported with the flag's name
            raise SystemExit(f"--ops-from {args.ops_from}: not a readable profile ({type(e).__name__}: {e})") from None
        if not carried.ops:
            raise SystemExit(
                f"--ops-from {args.ops_from}: the profile has no per-op times; measure them with --ops-seconds instead"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = started + args.time_budget
    resumed_profile = args.out / f"{args.network}-profile.json"
    if args.profile:
        profile_path, measure = benchsearch.resolve_profile(args.profile), False
    elif args.resume and resumed_profile.is_file():
        profile_path, measure = resumed_profile, False
    else:
        profile_path, measure = args.out / f"{args.network}-profile.json", True
        for stale in (profile_path, profile_path.with_name(profile_path.name + ".error")):
            stale.unlink(missing_ok=True)
    per_world, jobs = plan_runs(args)
    if args.resume:
        per_world, jobs = resume_runs(per_world, jobs, args.out / f"{args.network}.json")
    plan_dir = args.out / "plans" / args.network
    if args.search_only:
        return search_only(plan_dir, jobs, profile_path, args)
    searcher = Searcher(
        plan_dir,
        jobs,
        profile_path,
        FALLBACK_PROFILE[args.network],
        deadline,
        workers=args.search_jobs,
        reserve_cpus=2 * max(args.worlds),
    )
    searcher.start()
    cfg = {
        "network": args.network,
        "out": str(args.out),
        "plan_dir": str(plan_dir),
        "profile": str(profile_path),
        "profile_budget": args.profile_budget,
        "comm_rounds": args.comm_rounds,
        "measure_profile": measure,
        "deadline": deadline,
        "reserve_s": 10.0,
        "min_run_s": 3.0,
        "run_cap": args.run_cap,
        "warmup": args.warmup,
        "iters": args.iters,
        "best_of": args.best_of,
        "variants": list(dict.fromkeys(args.variants)),
        "compile_backend": args.compile_backend,
        "variant_units": max(
            1, sum(1 for v in dict.fromkeys(args.variants) if "graph" not in v or torch.cuda.is_available())
        ),
        "overrides": benchsearch.overrides_of(args),
        "breakdown": args.breakdown,
        "models": list(args.models),
        "worlds": list(args.worlds),
        "precisions": list(args.precisions),
        "ops_seconds": args.ops_seconds,
        "ops_from": str(args.ops_from) if args.ops_from else None,
        "calibrate_plans": args.calibrate_plans or [],
    }
    records: dict = {}
    worlds = list(per_world)
    try:
        for i, world in enumerate(worlds):
            future = sum(timed_parts(r, cfg) for w in worlds[i + 1 :] for r in per_world[w])
            records.update(run_world(world, per_world[world], dict(cfg, future_runs=future), args))
            cfg["measure_profile"] = False
    finally:
        searcher.stop()
    records = merge_rounds(records)
    bench_finish(
        args, records, env, hardware(), command_line("exp/bench.py", argv), profile_path, time.time() - started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
