"""The benchmark's results: merged per network, tabulated, written into ``docs/benchmarks.md`` and drawn.

* :func:`bench_finish` merges one invocation's records into ``<out>/<network>.json``, rewrites that
  network's section of ``benchmarks.md`` (:func:`bench_markdown`) and the figure, and prints the
  compact table;
* scaling efficiency (:func:`add_efficiency`) is ``t_single / t``, the floor of the same (world,
  model, precision) over the run's time (weak scaling), also against the floor captured as one CUDA
  graph where it was measured;
* the speedup table (:func:`speedup_rows`) sets the searched plan against the fastest variant of the
  fastest baseline, each ratio with its range over paired rounds.
"""

from __future__ import annotations

from pathlib import Path

from exp.benchrun import METHODS
from exp.breakdown import BREAKDOWN_HEADERS, breakdown_rows
from exp.report import (
    gib,
    hardware_line,
    link,
    load_json,
    ms,
    pyplot,
    rate,
    save_json,
    table,
    text_table,
    write_section,
)

BENCH_HEADERS = [
    "world",
    "model",
    "prec",
    "method",
    "variant",
    "iter (ms)",
    "throughput",
    "scaling eff.",
    "eff. (graphed floor)",
    "peak mem (GiB)",
    "predicted (ms)",
    "measured/pred.",
    "note",
]


def add_efficiency(runs: list[dict]) -> None:
    """``scaling_efficiency = t_single / t`` per run, with ``t_single`` the floor of the same
    (world, model, precision); ``None`` where either time is missing.  Where the floor was also run
    as one CUDA graph (``single-graph``), ``scaling_efficiency_graphed = t_single_graph / t``."""

    def floor_of(method):
        return {
            (r["world"], r["model"], r["precision"]): r["iter_time_s"]
            for r in runs
            if r.get("method") == method and r.get("status") == "ok"
        }

    floor, floor_graph = floor_of("single"), floor_of("single-graph")
    ref_loss = {}
    for r in runs:  # the first step's global loss of the first distributed method: all must agree
        if r.get("status") == "ok" and not r.get("method", "").startswith("single") and r.get("loss_first") is not None:
            ref_loss.setdefault((r["world"], r["model"], r["precision"]), (r["method"], r["loss_first"]))
    for r in runs:
        g = (r["world"], r["model"], r["precision"])
        f = floor.get(g)
        r["scaling_efficiency"] = f / r["iter_time_s"] if f and r.get("status") == "ok" else None
        fg = floor_graph.get(g)
        r["scaling_efficiency_graphed"] = fg / r["iter_time_s"] if fg and r.get("status") == "ok" else None
        ref = ref_loss.get(g)
        if ref and r.get("status") == "ok" and not r.get("method", "").startswith("single"):
            r["loss_check"] = {
                "reference": ref[0],
                "relative_difference": abs(r["loss_first"] - ref[1]) / max(abs(ref[1]), 1e-12),
            }


def _note(r: dict) -> str:
    if r.get("status") != "ok":
        first = str(r.get("error") or "").strip().splitlines()
        return f"{r.get('status')}: {first[0][:90] if first else ''}"
    notes = []
    rounds = [x["iter_time_s"] for x in r.get("rounds") or [] if x.get("status") == "ok"]
    if len(r.get("rounds") or []) > 1:
        failed = len(r["rounds"]) - len(rounds)
        notes.append(
            f"median of {len(rounds)} rounds ({ms(min(rounds))}-{ms(max(rounds))} ms)"
            + (f", {failed} failed" if failed else "")
        )
    if r.get("capped"):
        notes.append(f"{r.get('iters')} steps per window (time cap)")
    others = [
        f"{v} {ms(x['iter_time_s'])} ms" if x.get("status") == "ok" else f"{v} {x.get('status')}"
        for v, x in (r.get("variants") or {}).items()
        if v != r.get("variant")
    ]
    if others:
        notes.append("other variants: " + ", ".join(others))
    if r.get("precision_run") and r["precision_run"] != r["precision"]:
        notes.append(f"ran as {r['precision_run']}")
    if r.get("method") in ("hidup", "hidup-eager") and r.get("plan_duplication") is False:
        notes.append("search preferred no duplication")
    if r.get("method") in ("hidup-nodup", "hidup-nodup-eager") and r.get("plan_duplication") is True:
        notes.append("search preferred duplication")
    dup_trial = (r.get("info") or {}).get("duplication_trial") or {}
    if "on_s" in dup_trial:
        notes.append(
            f"duplication {'on' if r['info'].get('duplication') else 'off'} by trial (on "
            f"{dup_trial['on_s'] * 1e3:.1f} ms, off {dup_trial['off_s'] * 1e3:.1f} ms; plan: "
            f"{'on' if r.get('plan_duplication') else 'off'})"
        )
    mode = (r.get("info") or {}).get("step_mode")
    if mode and r.get("method") in ("hidup", "hidup-nodup", "hidup-auto"):
        trial = (r.get("info") or {}).get("mode_timings") or {}
        notes.append(
            f"{'CUDA graph' if mode == 'graph' else 'eager steps'} kept"
            + (
                f" (trial: graph {trial['graph_s'] * 1e3:.1f} ms, eager {trial['eager_s'] * 1e3:.1f} ms)"
                if "graph_s" in trial
                else ""
            )
        )
    check = r.get("loss_check") or {}
    tol = 2e-2 if r.get("precision_run", r.get("precision")) == "bf16" else 5e-3
    if check.get("relative_difference", 0.0) > tol:
        notes.append(f"first loss differs from {check['reference']} by {100 * check['relative_difference']:.1f}%")
    return "; ".join(notes)


def bench_rows(runs: list[dict]) -> list[list]:
    rows = []
    for r in runs:
        ok = r.get("status") == "ok"
        pred = r.get("predicted_s")
        eff = r.get("scaling_efficiency")
        effg = r.get("scaling_efficiency_graphed")
        rows.append(
            [
                r["world"],
                r["model"],
                r["precision"],
                r["method"],
                variant_of(r),
                ms(r.get("iter_time_s")) if ok else None,
                f"{rate(r.get('throughput'))} {r.get('unit', '')}" if ok else None,
                f"{eff:.2f}" if eff is not None else None,
                f"{effg:.2f}" if effg is not None else None,
                gib(r.get("peak_memory_bytes")) if ok else None,
                ms(pred) if pred else None,
                _accuracy(r, pred) if ok and pred else None,
                _note(r),
            ]
        )
    return rows


def _accuracy(r: dict, pred: float) -> str:
    """Measured / predicted, marked ``(in-sample)`` where the profile's corrections were fitted on this
    run's model (``"?"``: a profile that did not record its calibration models)."""
    fitted = (r.get("profile") or {}).get("calibration_models") or []
    return f"{r['iter_time_s'] / pred:.2f}" + (" (in-sample)" if r["model"] in fitted or "?" in fitted else "")


SPEEDUP_HEADERS = [
    "world",
    "model",
    "prec",
    "fastest baseline (ms)",
    "searched plan (ms)",
    "speedup",
    "dup. on vs off",
    "eff. (graphed floor)",
    "measured/pred.",
]
BASELINES = ("ddp", "fsdp", "expert")


def variant_of(r: dict) -> str | None:
    """How a run ran: a baseline's variant (``eager``, ``compile``, ``graph``, ``compile-graph``);
    hidup's step mode (``graph`` or ``eager``), prefixed ``compile-`` when its program ran compiled;
    ``eager (per-step sync)`` for a baseline recorded before
    baselines had variants (eager, unfused Adam, timed with a device sync after every step)."""
    if r.get("variant"):
        return r["variant"]
    info = r.get("info") or {}
    if info.get("step_mode"):
        return ("compile-" if info.get("compiled") else "") + info["step_mode"]
    if r.get("method") in BASELINES + ("single",) and r.get("status") == "ok":
        return "eager (per-step sync)"
    return None


def _fair(r: dict) -> bool:
    """Whether a baseline run is a tuned one: recorded with variants, and its fastest is not eager
    merely because no other variant was attempted."""
    variants = r.get("variants") or {}
    return bool(variants) and any(v != "eager" and x.get("status") in ("ok", "failed") for v, x in variants.items())


def _round_times(r: dict) -> dict[int, float]:
    return {x["round"]: x["iter_time_s"] for x in r.get("rounds") or [] if x.get("status") == "ok"}


def _ratio(slow: dict, fast: dict) -> str:
    """``t_slow / t_fast`` of two runs, with the range of the per-round ratios where both ran in rounds
    (each round pairs runs taken minutes apart, so drift of the host or network cancels)."""
    text = f"{slow['iter_time_s'] / fast['iter_time_s']:.2f}x"
    a, b = _round_times(slow), _round_times(fast)
    paired = [a[i] / b[i] for i in sorted(set(a) & set(b))]
    if len(paired) > 1:
        text += f" ({min(paired):.2f}-{max(paired):.2f} over {len(paired)} rounds)"
    return text


def speedup_rows(runs: list[dict]) -> list[list]:
    """Per (world, model, precision): the fastest baseline (the fastest variant of DDP, FSDP2 and expert
    parallelism, named), the searched plan in the mode the search chose (``plan_duplication``), their
    ratio, duplication on vs off of that plan, its efficiency against the graphed floor and its
    measured / predicted time: the issue's targets, side by side.  A comparison whose baselines did
    not try a compiled or captured variant (a CPU run without compile, or a record from before the
    variants) is labelled ``vs eager baselines``."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        if r.get("status") == "ok":
            groups.setdefault((r["world"], r["model"], r["precision"]), {})[r["method"]] = r
    rows = []
    for (world, model, precision), by in sorted(groups.items()):
        plan_dup = next((by[m].get("plan_duplication") for m in ("hidup", "hidup-nodup") if m in by), None)
        searched = by.get("hidup" if plan_dup else "hidup-nodup")
        bases = [by[m] for m in BASELINES if m in by]
        if searched is None or not bases:
            continue
        best = min(bases, key=lambda r: r["iter_time_s"])
        on, off = by.get("hidup"), by.get("hidup-nodup")
        eff = searched.get("scaling_efficiency_graphed")
        pred = searched.get("predicted_s")
        speedup = _ratio(best, searched)
        if not all(_fair(r) for r in bases):
            speedup += " (vs eager baselines)"
        rows.append(
            [
                world,
                model,
                precision,
                f"{ms(best['iter_time_s'])} {best['method']} {variant_of(best)}",
                f"{ms(searched['iter_time_s'])} {'dup' if plan_dup else 'no dup'}",
                speedup,
                _ratio(off, on) if on and off else None,
                f"{eff:.3f}" if eff is not None else None,
                _accuracy(searched, pred) if pred else None,
            ]
        )
    return rows


def _sort_key(r: dict):
    m = r.get("method")
    return (r["world"], r["model"], r["precision"], METHODS.index(m) if m in METHODS else 99)


def _profile_summary(path: Path) -> dict:
    doc = load_json(path, {}) or {}
    out = {
        "name": doc.get("name"),
        "path": str(path),
        "source": doc.get("source"),
        "gpu": doc.get("gpu"),
        "flops": doc.get("flops"),
        "collectives": {},
    }
    for c, groups in (doc.get("collectives") or {}).items():
        out["collectives"][c] = {
            g: {"alpha_s": t["alpha"], "algbw_at_max": t["algbw"][-1], "max_bytes": t["sizes"][-1]}
            for g, t in groups.items()
        }
    return out


def bench_finish(args, records: dict, env: dict, hw: dict, command: str, profile_path: Path, elapsed: float) -> dict:
    """Merge ``records`` into ``<out>/<network>.json``, rewrite this network's section of
    ``<docs>/benchmarks.md`` and the figure, and print the compact table."""
    path = Path(args.out) / f"{args.network}.json"
    doc = load_json(path, {}) or {}
    runs = {r["key"]: r for r in doc.get("runs", [])}
    runs.update(
        {
            k: r
            for k, r in records.items()  # a run this invocation did not reach keeps its result
            if not (r.get("status") == "skipped" and runs.get(k, {}).get("status") == "ok")
        }
    )
    ordered = sorted(runs.values(), key=_sort_key)
    add_efficiency(ordered)
    invocation = {
        "command": command,
        "hardware": hw,
        "env": env,
        "elapsed_s": elapsed,
        "time_budget_s": args.time_budget,
        "profile": _profile_summary(profile_path),
        "runs": sorted(records),
    }
    doc = {
        "network": args.network,
        "env": env,
        "latest": invocation,
        "invocations": (doc.get("invocations", []) + [invocation])[-20:],
        "runs": ordered,
    }
    save_json(path, doc)
    figure = bench_figure(Path(args.out), Path(args.docs) / "benchmarks.png")
    write_section(
        Path(args.docs) / "benchmarks.md",
        f"bench-{args.network}",
        bench_markdown(doc, page_dir=Path(args.docs), results=path, figure=figure),
        title="Benchmarks",
    )
    new = [r for r in ordered if r["key"] in records]
    print()
    print(text_table(BENCH_HEADERS, bench_rows(new)))
    speedups = speedup_rows(new)
    if speedups:
        print()
        print(text_table(SPEEDUP_HEADERS, speedups))
    print(
        f"\n{len(new)} runs ({sum(r.get('status') == 'ok' for r in new)} ok) in {elapsed:.0f} s; "
        f"results: {path}; report: {Path(args.docs) / 'benchmarks.md'}"
        + (f"; figure: {figure}" if figure else " (no figure: matplotlib is not installed)"),
        flush=True,
    )
    return doc


def bench_markdown(
    doc: dict, page_dir: Path | None = None, results: Path | None = None, figure: Path | None = None
) -> str:
    """One network's section of ``benchmarks.md`` (in ``page_dir``), linking the results file, the
    profile the searches used and the figure where given."""
    inv = doc["latest"]
    prof = inv.get("profile") or {}
    prof_path = Path(prof["path"]) if prof.get("path") else None
    where = (
        link(prof_path, page_dir)
        if page_dir is not None and prof_path is not None and prof_path.is_file()
        else f"`{prof.get('path')}`"
    )
    lines = [
        f"## Network: {doc['network']}",
        "",
        f"Command: `{inv['command']}`  ",
        f"Hardware: {hardware_line(inv['hardware'])}  ",
        f"Date: {inv['hardware'].get('date')}  ",
        f"NCCL environment: {', '.join(f'{k}={v}' for k, v in sorted(doc['env'].items())) or '(defaults)'}  ",
        f"Profile used by the search: {prof.get('name')} ({prof.get('source')}, {where})",
    ]
    if page_dir is not None and results is not None:
        lines[-1] += "  "
        lines.append(
            f"Results: {link(results, page_dir)}"
            + (f"; figure (every network): {link(figure, page_dir)}" if figure is not None else "")
        )
    ar = (prof.get("collectives") or {}).get("all_reduce") or {}
    if ar:
        lines[-1] += "  "
        lines.append(
            "Measured all-reduce: "
            + ", ".join(
                f"{g} ranks alpha {v['alpha_s'] * 1e6:.0f} us, {v['algbw_at_max'] / 1e9:.1f} GB/s at "
                f"{v['max_bytes'] / 2**20:.0f} MiB"
                for g, v in sorted(ar.items())
            )
        )
    lines += [
        "",
        "Iteration time: the best of the timed windows, each window N steps between two device syncs, "
        "(t_end - t_start) / N, max over ranks -- every method timed alike (exp/baselines/timing.py). A "
        "baseline reports its fastest variant (eager, compile = torch.compile, graph = the whole step "
        "including fused Adam as one CUDA graph, compile-graph = both); the note lists the others. "
        "Scaling efficiency = single-rank-share time (its fastest variant) / time (weak scaling; the "
        "graphed floor: that share's forward and backward captured as hidup captures its steps); "
        "predicted = the plan's cost-model time in that mode; measured/pred. is marked in-sample where "
        "the profile's corrections were fitted on that model's plans.",
        "",
        table(BENCH_HEADERS, bench_rows(doc["runs"])),
    ]
    speedups = speedup_rows(doc["runs"])
    if speedups:
        lines += [
            "",
            f"### The searched plan against the fastest baseline ({doc['network']})",
            "",
            table(SPEEDUP_HEADERS, speedups),
            "",
            "searched plan: hidup's plan in the duplication mode the search chose; fastest baseline: "
            "the fastest variant of DDP, FSDP2 and expert parallelism; speedup = fastest "
            "baseline / searched plan, labelled 'vs eager baselines' where the baselines did not try "
            "compiled or captured variants; dup. on vs off = the same plan without / with duplication; with "
            "--repeats, the range of the ratios of each round's pair of runs.",
        ]
    items = [
        (r["key"], r["breakdown"])
        for r in doc["runs"]
        if isinstance(r.get("breakdown"), dict) and "span_s" in r["breakdown"]
    ]
    if items:
        lines += [
            "",
            f"### Time breakdown of one iteration ({doc['network']}, rank 0)",
            "",
            table(BREAKDOWN_HEADERS, breakdown_rows(items)),
            "",
            "compute / comm: busy time of compute kernels / NCCL kernels and device-to-device copies; "
            "hidden: communication overlapped by compute on another stream; exposed = comm - hidden; "
            "concurrent comm: communication of two or more streams at once (the copies' communicators, "
            "a gradient all-reduce beside them).",
        ]
    return "\n".join(lines)


def figure_panels(out_dir: Path) -> dict:
    """``{(network, world): {"graphed": bool, "groups": {(model, precision): {method: efficiency}}}}`` from
    each network's merged ``<out>/<network>.json`` (copies beside it, a run's own file, repeat its keys
    and are ignored); the efficiency is against the graphed floor where one was measured (``graphed``):
    the eager floor pays host dispatch too."""
    docs = [
        d
        for p, d in ((p, load_json(p, None)) for p in sorted(out_dir.glob("*.json")))
        if d and "runs" in d and d.get("network") == p.stem
    ]
    panels: dict = {}
    for d in docs:
        for r in d["runs"]:
            panel = panels.setdefault((d["network"], r["world"]), {"graphed": False, "groups": {}})
            panel["graphed"] = panel["graphed"] or bool(r.get("scaling_efficiency_graphed"))
            group = panel["groups"].setdefault((r["model"], r["precision"]), {})
            if not r["method"].startswith("single") and r["method"] in METHODS:  # the floors are the 1.0 line
                group[r["method"]] = r.get("scaling_efficiency_graphed") or r.get("scaling_efficiency") or 0.0
    return dict(sorted(panels.items()))


def bench_figure(out_dir: Path, target: Path) -> Path | None:
    """Scaling efficiency per method, one panel per (network, world) (:func:`figure_panels`)."""
    plt = pyplot()
    if plt is None:
        return None
    panels = figure_panels(out_dir)
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for ax, ((net, world), panel) in zip(axes[:, 0], panels.items()):
        groups = panel["groups"]
        keys = sorted(groups)
        methods = [m for m in METHODS if any(m in groups[g] for g in keys)]
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            ax.bar([i + j * width for i in range(len(keys))], [groups[g].get(m, 0.0) for g in keys], width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{m}\n{p}" for m, p in keys], fontsize=8)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_ylabel("scaling efficiency")
        ax.set_title(
            f"{net}, {world} GPUs (1.0 = one rank's share alone"
            + (", captured as one CUDA graph)" if panel["graphed"] else ")")
        )
        if methods:  # a sweep of the floors alone has no bar to label
            ax.legend(fontsize=8, ncol=len(methods))
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
