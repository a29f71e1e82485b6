"""Robustness of hidup's plan to errors in the profile (the HiDup paper's Table IV), in one command.

    python exp/noise.py                        # BERT-SGMoE (paper defaults), 4 GPUs, sockets network
    python exp/noise.py --predict-only         # no GPU: price every plan with the clean cost model

The clean profile ``P`` is the network's profile (``--profile``; else ``<bench-out>/<network>-profile.json``
written by exp/bench.py; else measured here first).  Perturbed profiles:

* ``x%`` random noise: ``P.perturb(noise=x, seed=s)`` -- every FLOP rate, op time and bandwidth times
  its own ``U[1-x, 1+x]`` factor -- for ``x`` in ``--noise`` (0.2 0.4 0.8) and ``s < --seeds`` (10);
* ``±y%`` communication: ``P.perturb(noise=0, comm_scale=1+y/100)`` -- every collective ``1+y/100``
  times as slow -- for ``y`` in ``--comm`` (-50 -25 25 100).

Each profile is searched (DP, duplication-aware, in a pool of CPU processes); plans are identified by
their decisions (every node's signature and the duplication mode), and each distinct plan is RUN
once on the launched ranks in its own mode (exp/benchrun.py timing: median step time; on sockets
eagerly, all plans on the same pair of copy communicators, see ``--mode``).  Runs over a
shared network drift by several percent within minutes, so by default the clean plan ``c`` is run
again right after each perturbed plan (*paired*), and a perturbation's row reports over its plans::

    relative time r = t(plan) / mean(t(c) right before, t(c) right after)
    mean_s r    and    worst = max_s r

(``--unpaired``: ``r = t(plan) / t(c)`` with ``c`` measured once, first).  A plan whose ``r``
exceeds ``--again-above`` (1.10) is measured once more, paired, when every plan has been measured
and time is left; its ``r`` is then the mean of both.  The spread of all clean runs,
``(max - min) / median``, is reported as the measurement noise.

and the same with the clean profile's cost model in place of measurement (``predicted``:
``T_P(plan) / T_P(c)``, the search's own evaluation under ``P``).  ``flips`` are the nodes whose
signature differs from the clean plan's, summarized as ``kind -> kind`` counts.  The clean plan is
also measured again at the end when time allows.

Writes ``docs/robustness.json``, ``docs/robustness.md`` (table, flips, command, hardware) and
``docs/robustness.png``.

The report.  A study's *jobs* are its perturbations, each with the plan its search found: ``label``
(the row), ``kind``, ``status``, ``identity`` (the plan), ``relative_predicted``,
``relative_measured`` (None when not measured) and ``flips`` (``nodes``, ``kinds``, ``duplication``:
how the plan differs from the clean one).  :func:`summary_rows` turns jobs into rows; a single run
and a study combined from several runs of it (:func:`combine`: one that ran out of time and was
completed with ``--first-seed``, or measured again) both report through it::

    python exp/noise.py --combine run1/robustness.json run2/robustness.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hidup.models
from exp import benchrun as br
from exp.bench import FALLBACK_PROFILE, apply_network, measure_profile, read_partial
from exp.benchsearch import Searcher, job_name, overrides_of, predict, resolve_profile
from exp.report import (
    ROOT,
    command_line,
    hardware,
    hardware_line,
    link,
    load_json,
    pyplot,
    save_json,
    table,
    text_table,
    write_section,
)
from hidup.cli.model_flags import add_model_flags
from hidup.files import atomic_write
from hidup.frontend.trace import trace
from hidup.plan import Plan
from hidup.profiler import load
from hidup.runtime.launch import LaunchError, launch


def perturbations(args) -> list[dict]:
    """Clean first, then the communication scalings, then the noise seeds interleaved by level."""
    out = [{"tag": "clean", "label": "clean", "kind": "clean", "perturb": None}]
    for y in args.comm:
        if y <= -100:
            raise SystemExit(f"--comm {y}: communication can shrink by less than 100%")
        out.append(
            {
                "tag": f"comm{y:+d}",
                "label": f"{y:+d}% communication",
                "kind": "comm",
                "level": y,
                "perturb": {"noise": 0.0, "seed": 0, "comm_scale": 1.0 + y / 100.0},
            }
        )
    if not 0 <= args.first_seed < max(args.seeds, 1):
        raise SystemExit(f"--first-seed {args.first_seed}: must be at least 0 and below --seeds {args.seeds}")
    for s in range(args.first_seed, args.seeds):
        for x in args.noise:
            if not 0.0 <= x < 1.0:
                raise SystemExit(f"--noise {x}: the noise level is a fraction in [0, 1)")
            out.append(
                {
                    "tag": f"noise{x:g}-s{s}",
                    "label": f"{100 * x:g}% random noise",
                    "kind": "noise",
                    "level": x,
                    "seed": s,
                    "perturb": {"noise": x, "seed": s, "comm_scale": 1.0},
                }
            )
    return out


# ============================================================================ rank side
def child_main(ctx, cfg: dict) -> None:
    """Measure each distinct plan once, in the order the searches finish (clean first)."""
    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    if device.type == "cpu":
        torch.set_num_threads(max(1, (__import__("os").cpu_count() or 1) // max(1, world)))
    if cfg.get("measure_profile"):
        measure_profile(cfg, device)
    model_cpu, inputs_cpu = hidup.models.build(cfg["model"], world_size=world, seed=0, **cfg["overrides"])
    plan_dir, names = Path(cfg["plan_dir"]), cfg["names"]
    state = {
        "measured": set(),
        "bad": set(),
        "repeated": False,
        "last_clean": None,
        "pending": None,
        "relative": {},
        "again": set(),
    }  # identity -> paired relative times; plans measured again
    docs: dict[str, dict] = {}  # finished search results (written once, atomically)

    def decide() -> dict:
        left = cfg["deadline"] - time.time()
        if left < cfg["min_run_s"]:
            return {"action": "stop"}
        cap = min(cfg["run_cap"], max(cfg["min_run_s"], 0.5 * left))
        for n in names:
            if n not in docs and (plan_dir / f"{n}.json").is_file():
                docs[n] = load_json(plan_dir / f"{n}.json")
        clean = docs.get(names[0])
        if not state["measured"]:
            if clean is None:
                return {"action": "wait"}
            if clean.get("status") != "ok":
                return {"action": "stop"}
            return {"action": "run", "name": names[0], "doc": clean, "cap": cap, "repeat": False}
        if state["pending"] is not None:  # paired: the clean plan again, right after the perturbed one
            return {"action": "run", "name": names[0], "doc": clean, "cap": cap, "repeat": False, "ref": True}
        for n in names:
            d = docs.get(n)
            if d and d.get("status") == "ok" and d["identity"] not in state["measured"] | state["bad"]:
                return {"action": "run", "name": n, "doc": d, "cap": cap, "repeat": False}
        if len(docs) < len(names):
            return {"action": "wait"}
        again = cfg.get("again_above")
        if again and cfg.get("paired"):  # a plan far above the clean one: measure it once more, paired
            slow = [(max(r), i) for i, r in state["relative"].items() if i not in state["again"] and max(r) > again]
            if slow:
                ident = max(slow)[1]
                n, d = next((n, d) for n, d in docs.items() if d.get("identity") == ident)
                return {"action": "run", "name": n, "doc": d, "cap": cap, "repeat": False, "again": True}
        if not state["repeated"]:
            return {"action": "run", "name": names[0], "doc": clean, "cap": cap, "repeat": True}
        return {"action": "stop"}

    def emit(record: dict) -> None:
        if rank == 0:
            with open(cfg["partial"], "a") as f:
                f.write(json.dumps({"event": "result", "record": record}, default=str) + "\n")

    n_refs = 0
    while True:
        choice = br.broadcast(decide() if rank == 0 else None, device)
        if choice["action"] == "stop":
            break
        if choice["action"] == "wait":
            time.sleep(1.0)
            continue
        doc = choice["doc"]
        plan = Plan.from_dict(doc["plan"])
        method = ("hidup" if plan.duplication else "hidup-nodup") + ("-eager" if cfg.get("mode") == "eager" else "")
        res = br.execute(
            method,
            model_cpu,
            inputs_cpu,
            rank,
            world,
            device,
            cfg["precision_run"],
            warmup=cfg["warmup"],
            iters=cfg["iters"],
            cap_s=choice["cap"],
            plan=plan,
        )
        t = res.get("iter_time_s")
        tag = (
            "repeat"
            if choice["repeat"]
            else ("reference" if choice.get("ref") else ("measured again" if choice.get("again") else ""))
        )
        if rank == 0:
            print(
                f"[noise] plan {doc['identity']} ({choice['name']}{', ' + tag if tag else ''}): "
                + (f"{t * 1e3:.2f} ms" if t else f"{res['status']} {str(res.get('error'))[:120]}"),
                flush=True,
            )
        if choice.get("ref"):
            n_refs += 1
            emit(
                dict(
                    res,
                    key=f"{doc['identity']}-ref{n_refs}",
                    identity=doc["identity"],
                    name=choice["name"],
                    method=method,
                    repeat=False,
                    reference=True,
                )
            )
            pending, state["pending"] = state["pending"], None
            pending["ref_after_s"] = t
            state["last_clean"] = t or state["last_clean"]
            refs = [x for x in (pending.get("ref_before_s"), t) if x]
            if pending.get("iter_time_s") and refs:
                state["relative"].setdefault(pending["identity"], []).append(
                    pending["iter_time_s"] / statistics.fmean(refs)
                )
            emit(pending)
            continue
        if choice.get("again"):
            state["again"].add(doc["identity"])  # once, whether or not the run succeeds
        if choice["repeat"]:
            state["repeated"] = True
        else:
            (state["measured"] if res["status"] == "ok" else state["bad"]).add(doc["identity"])
        suffix = "-repeat" if choice["repeat"] else (f"-again{n_refs}" if choice.get("again") else "")
        record = dict(
            res,
            key=f"{doc['identity']}{suffix}",
            identity=doc["identity"],
            name=choice["name"],
            method=method,
            repeat=choice["repeat"],
            again=bool(choice.get("again")),
        )
        if choice["name"] == names[0] and not choice["repeat"]:
            state["last_clean"] = t
        elif cfg.get("paired") and not choice["repeat"] and res["status"] == "ok":
            record["ref_before_s"] = state["last_clean"]
            state["pending"] = record  # emitted with the clean plan's time measured right after it
            continue
        emit(record)
    if state["pending"] is not None:  # the budget ran out before the reference run
        emit(state["pending"])


# ============================================================================ launcher side
def _flips(clean: dict, plan: dict) -> dict:
    """Nodes whose signature differs from the clean plan's, as names and kind transitions."""
    nodes, kinds = [], Counter()
    for name, sig in plan["choices"].items():
        ref = clean["choices"].get(name)
        if ref is not None and sig != ref:
            nodes.append(name)
            kinds[f"{ref.get('kind', '?')}->{sig.get('kind', '?')}"] += 1
    return {
        "nodes": nodes,
        "kinds": dict(kinds.most_common()),
        "duplication": None if plan["duplication"] == clean["duplication"] else plan["duplication"],
    }


def assemble(args, perts: list[dict], names: list[str], plan_dir: Path, measured: dict, profile_path: Path) -> dict:
    """Rows of the table from the search results and the measured times (see the module docstring)."""
    docs = {n: load_json(plan_dir / f"{n}.json") for n in names}
    clean = docs[names[0]]
    if not clean or clean.get("status") != "ok":
        raise SystemExit(f"the clean search failed or did not finish: {(clean or {}).get('error', 'no result')}")
    model, inputs = hidup.models.build(args.model, world_size=args.world, device="meta", **overrides_of(args))
    graph = trace(model, inputs, world_size=args.world, half_batch=True)
    profile = load(profile_path)

    def pred(doc):
        plan = Plan.from_dict(doc["plan"])
        mode = "hidup" if plan.duplication else "hidup-nodup"
        return predict(graph, profile, plan, args.search_precision, doc["job"]["compiled"])[mode]

    t_clean_pred = pred(clean)
    t_clean = (measured.get(clean["identity"]) or {}).get("iter_time_s")
    jobs = []
    for p, n in zip(perts, names):
        d = docs.get(n) or {"status": "failed", "error": "the search did not finish in time"}
        j = {"tag": p["tag"], "label": p["label"], "kind": p["kind"], "perturb": p["perturb"], "status": d["status"]}
        if d["status"] == "ok":
            rec = measured.get(d["identity"]) or {}
            t = rec.get("iter_time_s")
            refs = [x for x in (rec.get("ref_before_s"), rec.get("ref_after_s")) if x]
            paired = []  # (time, its references) of every paired measurement of this plan
            modes = []  # how each measurement ran its steps (GraphedStep's choice: "graph" or "eager")
            for r in [rec] + [r for k, r in sorted(measured.items()) if k.startswith(d["identity"] + "-again")]:
                rr = [x for x in (r.get("ref_before_s"), r.get("ref_after_s")) if x]
                if r.get("iter_time_s") and rr:
                    paired.append((r["iter_time_s"], rr))
                if r.get("info"):
                    modes.append({k: r["info"].get(k) for k in ("step_mode", "mode_timings")})
            j.update(
                identity=d["identity"],
                duplication=d["plan"]["duplication"],
                search_s=d.get("search_s"),
                predicted_clean_model_s=pred(d),
                predicted_own_profile_s=d["predicted"]["hidup" if d["plan"]["duplication"] else "hidup-nodup"],
                measured_s=t,
                flips=_flips(clean["plan"], d["plan"]),
                step_modes=modes,
            )
            j["relative_predicted"] = j["predicted_clean_model_s"] / t_clean_pred
            if d["identity"] == clean["identity"]:
                j["relative_measured"] = 1.0 if t_clean else None
            elif paired:  # paired: against the clean plan measured right before and after (mean over runs)
                j["relative_runs"] = [x / statistics.fmean(rr) for x, rr in paired]
                j["relative_measured"] = statistics.fmean(j["relative_runs"])
                j["measured_runs_s"] = [x for x, _ in paired]
                j["reference_s"] = refs
            else:
                j["relative_measured"] = t / t_clean if t and t_clean else None
        else:
            j["error"] = d.get("error")
        jobs.append(j)
    rows = summary_rows(jobs)
    repeat = measured.get(f"{clean['identity']}-repeat", {}).get("iter_time_s")
    refs = [r["iter_time_s"] for k, r in measured.items() if r.get("reference") and r.get("iter_time_s")]
    clean_times = [t for t in [t_clean, repeat] + refs if t]
    spread = (max(clean_times) - min(clean_times)) / statistics.median(clean_times) if len(clean_times) > 1 else None
    return {
        "clean": {
            "identity": clean["identity"],
            "measured_s": t_clean,
            "predicted_s": t_clean_pred,
            "duplication": clean["plan"]["duplication"],
            "repeat_measured_s": repeat,
            "measurement_noise": abs(repeat - t_clean) / t_clean if repeat and t_clean else None,
            "runs_s": clean_times,
            "spread": spread,
            "step_modes": [
                r.get("info", {}).get("step_mode")
                for k, r in measured.items()
                if r.get("identity") == clean["identity"] and r.get("info")
            ],
        },
        "rows": rows,
        "jobs": jobs,
    }


# ============================================================================ report
def _f(x, pct=False) -> str:
    return "-" if x is None else (f"{x:.3f}" if not pct else f"{100 * x:.1f}%")


HEADERS = [
    "perturbation",
    "plans",
    "distinct",
    "measured",
    "mean rel. (measured)",
    "worst rel. (measured)",
    "mean rel. (predicted)",
    "worst rel. (predicted)",
    "flipped nodes (mean)",
    "dup. flips",
]


def summary_rows(jobs: list[dict]) -> list[dict]:
    """One row per perturbation label (the clean job aside): over its plans, mean and worst relative
    time measured and predicted, and what flipped."""
    rows = []
    for label in dict.fromkeys(j["label"] for j in jobs if j["kind"] != "clean"):
        group = [j for j in jobs if j["label"] == label]
        ok = [j for j in group if j["status"] == "ok"]
        meas = [j["relative_measured"] for j in ok if j["relative_measured"] is not None]
        predv = [j["relative_predicted"] for j in ok]
        kinds = Counter()
        for j in ok:
            kinds.update(j["flips"]["kinds"])
        rows.append(
            {
                "label": label,
                "plans": len(group),
                "searched": len(ok),
                "distinct": len({j["identity"] for j in ok}),
                "measured": len(meas),
                "mean_measured": statistics.fmean(meas) if meas else None,
                "worst_measured": max(meas, default=None),
                "mean_predicted": statistics.fmean(predv) if predv else None,
                "worst_predicted": max(predv, default=None),
                "flipped_nodes_mean": statistics.fmean(len(j["flips"]["nodes"]) for j in ok) if ok else None,
                "duplication_flips": sum(j["flips"]["duplication"] is not None for j in ok),
                "flip_kinds": dict(kinds.most_common()),
                "flip_examples": sorted({n for j in ok for n in j["flips"]["nodes"]})[:8],
            }
        )
    return rows


def table_rows(rows: list[dict]) -> list[list]:
    """The cells of :data:`HEADERS` for :func:`summary_rows`' rows."""
    return [
        [
            r["label"],
            r["searched"] if r["searched"] == r["plans"] else f"{r['searched']}/{r['plans']}",
            r["distinct"],
            r["measured"],
            _f(r["mean_measured"]),
            _f(r["worst_measured"]),
            _f(r["mean_predicted"]),
            _f(r["worst_predicted"]),
            "-" if r["flipped_nodes_mean"] is None else f"{r['flipped_nodes_mean']:.1f}",
            r["duplication_flips"],
        ]
        for r in rows
    ]


def write_docs(args, result: dict, meta: dict) -> None:
    """A single run's ``robustness.json``, ``robustness.md`` and figure under ``args.docs``; the page
    links the other two and the clean profile."""
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    results = save_json(docs / "robustness.json", dict(meta, **result))
    drawn = figure(result["rows"], docs / "robustness.png", f"{args.model}, {args.world} GPUs")
    profile = Path(meta["profile"])
    profile_ref = link(profile, docs) if profile.is_file() else f"`{meta['profile']}`"
    c = result["clean"]
    lines = [
        f"# Robustness to profile errors ({args.model}, {args.world} GPUs, {args.network})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Hardware: {hardware_line(meta['hardware'])}  ",
        f"Date: {meta['hardware'].get('date')}  ",
        f"Clean profile: {profile_ref}" + (f" ({meta['profile_note']})" if meta.get("profile_note") else "") + "  ",
        f"Precision: {args.precision}"
        + (f" (searched as {args.search_precision})" if args.search_precision != args.precision else "")
        + (
            ", predicted only (no runs)"
            if args.predict_only
            else {
                "eager": "; plans run eagerly on one shared pair of copy communicators",
                "auto": "; plans run as hidup train runs them, fresh copy communicators per run",
            }.get(meta.get("mode"), "")
        ),
        "",
        f"Clean plan `{c['identity']}` (duplication {'on' if c['duplication'] else 'off'}): predicted "
        f"{_f(c['predicted_s'] and c['predicted_s'] * 1e3)} ms"
        + (f", measured {c['measured_s'] * 1e3:.2f} ms" if c["measured_s"] else "")
        + (
            f", re-measured at the end {c['repeat_measured_s'] * 1e3:.2f} ms (measurement noise "
            f"{_f(c['measurement_noise'], pct=True)})"
            if c["repeat_measured_s"]
            else ""
        )
        + (
            f"; {len(c['runs_s'])} runs of the clean plan spread {_f(c['spread'], pct=True)} ((max - min) / median)"
            if c.get("spread") is not None
            else ""
        )
        + ".",
        "",
        "Relative time = iteration time of the plan searched with the perturbed profile / that of the clean "
        "plan (mean and worst over the perturbation's seeds). Predicted: both priced by the clean profile's "
        "cost model; measured: both run on the GPUs (each distinct plan once"
        + (
            ", divided by the mean of the clean plan's runs right before and after it)"
            if any(j.get("reference_s") for j in result["jobs"])
            else ")"
        )
        + ".",
        "",
        table(HEADERS, table_rows(result["rows"])),
        "",
        f"Results: {link(results, docs)}",
        "",
    ]
    if drawn is not None:
        lines += [f"![relative iteration times]({drawn.name})", ""]
    lines += ["## Decisions that flipped", ""]
    for r in result["rows"]:
        kinds = ", ".join(f"{k} x{v}" for k, v in r["flip_kinds"].items()) or "none"
        ex = ", ".join(f"`{n}`" for n in r["flip_examples"])
        lines.append(f"- {r['label']}: {kinds}" + (f" (e.g. {ex})" if ex else ""))
    atomic_write(docs / "robustness.md", "\n".join(lines) + "\n")


def figure(rows: list[dict], target: Path, title: str) -> Path | None:
    """Bar chart of the rows' mean and worst relative times, predicted and measured, saved as
    ``target`` (returned; None where matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: skipped {target}")
        return None
    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    xs = range(len(labels))
    for off, key, name in (
        (-0.3, "mean_predicted", "mean (predicted)"),
        (-0.1, "worst_predicted", "worst (predicted)"),
        (0.1, "mean_measured", "mean (measured)"),
        (0.3, "worst_measured", "worst (measured)"),
    ):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax.bar([x + off for x in xs], [y or 0.0 for y in ys], 0.2, label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("relative iteration time")
    ax.set_title(f"{title}: plans searched with a perturbed profile")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def combine(paths: list[Path]) -> dict:
    """One study from several runs of it (``robustness.json`` files of ``exp/noise.py``: a study that
    ran out of time and was completed with ``--first-seed``, or measured again): per perturbation,
    the plan its first run searched; its relative time is the mean over every paired measurement of
    that plan (by identity) in all runs.  The runs must share the clean plan (same build and
    profile); ValueError otherwise."""
    runs = [(Path(p), load_json(p)) for p in paths]
    if not runs:
        raise ValueError("nothing to combine: give the robustness.json files of the study's runs")
    clean = {r["clean"]["identity"] for _, r in runs}
    if len(clean) != 1:
        raise ValueError(
            f"the runs searched different clean plans ({', '.join(sorted(clean))}): combine only runs "
            "of one build on one profile"
        )
    clean = clean.pop()
    measured: dict[str, list[dict]] = {}  # identity -> every paired measurement
    jobs: dict[str, dict] = {}  # tag -> its job in the first run that has it
    for path, run in runs:
        seen = set()
        for j in run["jobs"]:
            if j.get("status") != "ok":
                continue
            jobs.setdefault(j["tag"], j)
            ident = j["identity"]
            if ident == clean or ident in seen:
                continue
            seen.add(ident)
            rel = j.get("relative_runs") or ([j["relative_measured"]] if j.get("reference_s") else [])
            measured.setdefault(ident, []).extend({"run": path.name, "relative": x} for x in rel)
    seeds = []
    for tag, j in jobs.items():
        if j["kind"] == "clean":
            continue
        runs_of = measured.get(j["identity"], [])
        rel = 1.0 if j["identity"] == clean else (statistics.fmean(m["relative"] for m in runs_of) if runs_of else None)
        seeds.append(
            {
                "tag": tag,
                "label": j["label"],
                "kind": j["kind"],
                "status": "ok",
                "identity": j["identity"],
                "relative_predicted": j["relative_predicted"],
                "relative_measured": rel,
                "measured": runs_of,
                "flips": j["flips"],
            }
        )
    rows = summary_rows(seeds)
    return {
        "description": "Per perturbation: the relative measured time of its plan (the mean over every "
        "measurement of that plan in the runs, each paired with the clean plan's runs right "
        "before and after it) and its relative predicted time (the clean profile's cost model).",
        "clean": clean,
        "runs": [
            {"file": p.name, "command": r.get("command"), "date": r.get("hardware", {}).get("date")} for p, r in runs
        ],
        "seeds": seeds,
        "rows": rows,
    }


def write_combined(result: dict, docs: Path, run_paths: list[Path]) -> None:
    """``robustness.json`` (combined), the ``combined`` section of ``robustness.md``, the figure; the
    section links the runs (``run_paths``, in the order given to :func:`combine`) and the results."""
    docs = Path(docs)
    docs.mkdir(parents=True, exist_ok=True)
    results = save_json(docs / "robustness.json", result)
    drawn = figure(result["rows"], docs / "robustness.png", "combined runs")
    worst = sorted((x for x in result["seeds"] if x["measured"]), key=lambda x: -x["relative_measured"])[:3]
    lines = [
        "Combined from "
        + ", ".join(link(p, docs) for p in run_paths)
        + f" (`python exp/noise.py --combine ...`); clean plan `{result['clean']}`; results: "
        + link(results, docs)
        + (f", figure: {link(drawn, docs)}" if drawn is not None else "")
        + ".",
        "",
        table(HEADERS, table_rows(result["rows"])),
        "",
        "Slowest measured plans (relative time of each measurement):",
        "",
    ]
    for x in worst:
        lines.append(
            f"- {x['tag']} (`{x['identity']}`, predicted {x['relative_predicted']:.3f}): "
            + ", ".join(f"{m['relative']:.3f} ({m['run']})" for m in x["measured"])
        )
    write_section(docs / "robustness.md", "combined", "\n".join(lines), title="Robustness to profile errors")


# ============================================================================ command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bert-sgmoe")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--network", choices=("sockets", "nvlink"), default="sockets")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="tf32")
    p.add_argument("--noise", type=float, nargs="+", default=[0.2, 0.4, 0.8])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="start at this seed (to complete a study that ran out of time: seeds first..seeds-1)",
    )
    p.add_argument("--comm", type=int, nargs="+", default=[-50, -25, 25, 100], help="communication change in %%")
    p.add_argument("--profile", default=None, help="clean profile (builtin name or path)")
    p.add_argument(
        "--predict-only",
        action="store_true",
        help="do not run plans; price them with the clean profile's cost model (needs no GPU)",
    )
    p.add_argument("--docs", type=Path, default=ROOT / "docs")
    p.add_argument(
        "--bench-out",
        type=Path,
        default=ROOT / "exp" / "records",
        help="exp/bench.py's results "
        "directory (its <network>-profile.json is the default clean profile; plans are cached there)",
    )
    p.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUN",
        help="run nothing: combine these runs' robustness.json files into one study (each plan's "
        "measurements averaged) and write it to --docs (robustness.json, the 'combined' section "
        "of robustness.md, robustness.png)",
    )
    p.add_argument(
        "--again-above",
        type=float,
        default=1.10,
        help="measure a plan a second time (paired) when it measured above this multiple of the "
        "clean plan, time allowing; its relative time is then the mean of both (0: never)",
    )
    p.add_argument(
        "--unpaired",
        action="store_true",
        help="measure each plan once against one clean run (default: run the clean plan again right "
        "after each perturbed plan and divide by the mean of the clean runs around it)",
    )
    p.add_argument(
        "--mode",
        choices=("auto", "eager"),
        default=None,
        help="how plans run: eagerly, every plan on one shared pair of copy communicators (the "
        "default on sockets, where hidup train's automatic choice keeps eager steps; about 4 s "
        "per run), or as hidup train runs them (auto: CUDA graph kept when faster, fresh copy "
        "communicators per run, about 25 s per run over sockets; the default on nvlink)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--run-cap", type=float, default=20.0)
    p.add_argument("--time-budget", type=float, default=480.0)
    p.add_argument("--profile-budget", type=float, default=0.1)
    p.add_argument(
        "--comm-rounds",
        type=int,
        default=3,
        metavar="R",
        help="passes over the collective tables of a measured profile (median per point; default 3)",
    )
    p.add_argument(
        "--search-jobs",
        type=int,
        default=None,
        help="parallel search processes (default: by CPUs; 0: search in this process)",
    )
    p.add_argument("--dist-timeout", type=float, default=120.0)
    add_model_flags(p.add_argument_group("model overrides"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        try:
            result = combine(args.combine)
        except ValueError as e:
            raise SystemExit(f"--combine: {e}") from None
        write_combined(result, args.docs, args.combine)
        print(text_table(HEADERS, table_rows(result["rows"])))
        print(f"\nwrote {Path(args.docs) / 'robustness.json'}, robustness.md (section 'combined'), robustness.png")
        return 0
    if args.mode is None:
        args.mode = "eager" if args.network == "sockets" else "auto"
    started = time.time()
    deadline = started + args.time_budget
    env = apply_network(args.network)
    gpu = torch.cuda.is_available() and not args.predict_only
    if not args.predict_only and torch.cuda.is_available() and args.world > torch.cuda.device_count():
        raise SystemExit(
            f"--world {args.world} needs {args.world} GPUs; this host has {torch.cuda.device_count()} "
            "(or use --predict-only)"
        )

    if args.model not in hidup.models.names():
        raise SystemExit(f"--model {args.model}: not in the zoo ({', '.join(hidup.models.names())})")
    # plans run on CPU ranks compute in fp32; priced only, they are priced as the GPU would run them
    args.search_precision = args.precision if torch.cuda.is_available() or args.predict_only else "fp32"
    bench_profile = args.bench_out / f"{args.network}-profile.json"
    note, measure = "", False
    if args.profile:
        profile_path = resolve_profile(args.profile)
    elif bench_profile.is_file():
        profile_path = bench_profile
    elif args.predict_only:
        profile_path = resolve_profile(FALLBACK_PROFILE[args.network])
        note = f"no measured profile at {bench_profile}; the builtin {FALLBACK_PROFILE[args.network]} was used"
    else:
        profile_path, measure = bench_profile, True
    perts = perturbations(args)
    overrides = overrides_of(args)
    names = [job_name(args.model, args.world, args.search_precision, overrides, f"-{p['tag']}") for p in perts]
    jobs = {
        n: {
            "name": n,
            "model": args.model,
            "world": args.world,
            "precision": args.search_precision,
            "overrides": overrides,
            "perturb": p["perturb"],
            "compiled": torch.cuda.is_available(),  # the runs are compiled (and captured) on GPUs only
        }
        for n, p in zip(names, perts)
    }
    plan_dir = args.bench_out / "plans" / f"robustness-{args.network}"
    searcher = Searcher(
        plan_dir,
        jobs,
        profile_path,
        FALLBACK_PROFILE[args.network],
        deadline,
        workers=args.search_jobs,
        reserve_cpus=0 if args.predict_only else 2 * args.world,
    )
    args.bench_out.mkdir(parents=True, exist_ok=True)
    searcher.start()
    measured: dict = {}
    try:
        if args.predict_only:
            if not searcher.wait(timeout=max(1.0, deadline - time.time())):
                print("[noise] the time budget ran out before every search finished; rows use the finished ones")
        else:
            partial = args.bench_out / f".partial-robustness-{args.network}.jsonl"
            partial.unlink(missing_ok=True)
            cfg = {
                "network": args.network,
                "profile": str(profile_path),
                "profile_budget": args.profile_budget,
                "comm_rounds": args.comm_rounds,
                "measure_profile": measure,
                "model": args.model,
                "overrides": overrides,
                "plan_dir": str(plan_dir),
                "names": names,
                "deadline": deadline,
                "min_run_s": 3.0,
                "run_cap": args.run_cap,
                "warmup": args.warmup,
                "iters": args.iters,
                "partial": str(partial),
                "paired": not args.unpaired,
                "mode": args.mode,
                "again_above": args.again_above,
                "precision_run": args.precision if gpu else "fp32",
                "models": [args.model],
                "worlds": [args.world],
                "precisions": [args.search_precision],
                "ops_seconds": 60.0,
            }
            try:
                launch(
                    child_main,
                    cfg,
                    nnodes=1,
                    cpn=args.world,
                    node_rank=0,
                    master_addr="127.0.0.1",
                    master_port=0,
                    timeout_s=args.dist_timeout,
                )
            except (LaunchError, RuntimeError) as e:
                print(f"[noise] the process group failed; reporting what was measured:\n{str(e)[-2000:]}")
            measured = read_partial(partial)[0]
            partial.unlink(missing_ok=True)
            if profile_path.with_name(profile_path.name + ".error").is_file():
                note = searcher.note
    finally:
        searcher.stop()
    result = assemble(
        args,
        perts,
        names,
        plan_dir,
        measured,
        profile_path if not searcher.note else resolve_profile(FALLBACK_PROFILE[args.network]),
    )
    meta = {
        "command": command_line("exp/noise.py", argv),
        "hardware": hardware("cuda" if gpu else "cpu"),
        "env": env,
        "profile": str(profile_path),
        "profile_note": note or searcher.note,
        "model": args.model,
        "world": args.world,
        "precision": args.precision,
        "predict_only": args.predict_only,
        "mode": args.mode,
        "elapsed_s": time.time() - started,
    }
    write_docs(args, result, meta)
    print(text_table(HEADERS, table_rows(result["rows"])))
    print(f"\nwrote {Path(args.docs) / 'robustness.md'} and robustness.json ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
