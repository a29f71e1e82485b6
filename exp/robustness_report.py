"""The robustness study on paper: its table rows, ``docs/robustness.md`` / ``.json`` / ``.png``, and
one study combined from several runs of it (``python exp/noise.py --combine``).

A study's *jobs* are its perturbations, each with the plan its search found: ``label`` (the row),
``kind``, ``status``, ``identity`` (the plan), ``relative_predicted``, ``relative_measured`` (None when
not measured) and ``flips`` (``nodes``, ``kinds``, ``duplication``: how the plan differs from the
clean one).  :func:`summary_rows` turns jobs into rows; a single run (``exp/noise.py``) and a
combined study (:func:`combine`) both report through it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from report import hardware_line, load_json, pyplot, save_json, table, write_section


def _f(x, pct=False) -> str:
    return "-" if x is None else (f"{x:.3f}" if not pct else f"{100 * x:.1f}%")


HEADERS = ["perturbation", "plans", "distinct", "measured", "mean rel. (measured)", "worst rel. (measured)",
           "mean rel. (predicted)", "worst rel. (predicted)", "flipped nodes (mean)", "dup. flips"]


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
        rows.append({"label": label, "plans": len(group), "searched": len(ok),
                     "distinct": len({j["identity"] for j in ok}), "measured": len(meas),
                     "mean_measured": statistics.fmean(meas) if meas else None,
                     "worst_measured": max(meas, default=None),
                     "mean_predicted": statistics.fmean(predv) if predv else None,
                     "worst_predicted": max(predv, default=None),
                     "flipped_nodes_mean": statistics.fmean(len(j["flips"]["nodes"]) for j in ok) if ok else None,
                     "duplication_flips": sum(j["flips"]["duplication"] is not None for j in ok),
                     "flip_kinds": dict(kinds.most_common()),
                     "flip_examples": sorted({n for j in ok for n in j["flips"]["nodes"]})[:8]})
    return rows


def table_rows(rows: list[dict]) -> list[list]:
    """The cells of :data:`HEADERS` for :func:`summary_rows`' rows."""
    return [[r["label"], r["searched"] if r["searched"] == r["plans"] else f"{r['searched']}/{r['plans']}",
             r["distinct"], r["measured"], _f(r["mean_measured"]), _f(r["worst_measured"]), _f(r["mean_predicted"]),
             _f(r["worst_predicted"]),
             "-" if r["flipped_nodes_mean"] is None else f"{r['flipped_nodes_mean']:.1f}", r["duplication_flips"]]
            for r in rows]


def write_docs(args, result: dict, meta: dict) -> None:
    """A single run's ``robustness.json``, ``robustness.md`` and figure under ``args.docs``."""
    docs = Path(args.docs)
    save_json(docs / "robustness.json", dict(meta, **result))
    c = result["clean"]
    lines = [f"# Robustness to profile errors ({args.model}, {args.world} GPUs, {args.network})", "",
             f"Command: `{meta['command']}`  ", f"Hardware: {hardware_line(meta['hardware'])}  ",
             f"Date: {meta['hardware'].get('date')}  ", f"Clean profile: `{meta['profile']}`"
             + (f" ({meta['profile_note']})" if meta.get("profile_note") else "") + "  ",
             f"Precision: {args.precision}" + (f" (searched as {args.search_precision})"
                                              if args.search_precision != args.precision else "")
             + (", predicted only (no runs)" if args.predict_only else
                {"eager": "; plans run eagerly on one shared pair of copy communicators",
                 "auto": "; plans run as hidup train runs them, fresh copy communicators per run"}.get(
                    meta.get("mode"), "")), "",
             f"Clean plan `{c['identity']}` (duplication {'on' if c['duplication'] else 'off'}): predicted "
             f"{_f(c['predicted_s'] and c['predicted_s'] * 1e3)} ms"
             + (f", measured {c['measured_s'] * 1e3:.2f} ms" if c["measured_s"] else "")
             + (f", re-measured at the end {c['repeat_measured_s'] * 1e3:.2f} ms (measurement noise "
                f"{_f(c['measurement_noise'], pct=True)})" if c["repeat_measured_s"] else "")
             + (f"; {len(c['runs_s'])} runs of the clean plan spread {_f(c['spread'], pct=True)} "
                f"((max - min) / median)" if c.get("spread") is not None else "") + ".", "",
             "Relative time = iteration time of the plan searched with the perturbed profile / that of the clean "
             "plan (mean and worst over the perturbation's seeds). Predicted: both priced by the clean profile's "
             "cost model; measured: both run on the GPUs (each distinct plan once"
             + (", divided by the mean of the clean plan's runs right before and after it)"
                if any(j.get("reference_s") for j in result["jobs"]) else ")") + ".", "",
             table(HEADERS, table_rows(result["rows"])), "", "## Decisions that flipped", ""]
    for r in result["rows"]:
        kinds = ", ".join(f"{k} x{v}" for k, v in r["flip_kinds"].items()) or "none"
        ex = ", ".join(f"`{n}`" for n in r["flip_examples"])
        lines.append(f"- {r['label']}: {kinds}" + (f" (e.g. {ex})" if ex else ""))
    (docs / "robustness.md").write_text("\n".join(lines) + "\n")
    figure(result["rows"], docs / "robustness.png", f"{args.model}, {args.world} GPUs")


def figure(rows: list[dict], target: Path, title: str) -> None:
    """Bar chart of the rows' mean and worst relative times, predicted and measured."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: skipped {target}")
        return
    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    xs = range(len(labels))
    for off, key, name in ((-0.3, "mean_predicted", "mean (predicted)"), (-0.1, "worst_predicted", "worst (predicted)"),
                           (0.1, "mean_measured", "mean (measured)"), (0.3, "worst_measured", "worst (measured)")):
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
        raise ValueError(f"the runs searched different clean plans ({', '.join(sorted(clean))}): combine only runs "
                         "of one build on one profile")
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
        rel = 1.0 if j["identity"] == clean else (statistics.fmean(m["relative"] for m in runs_of) if runs_of
                                                   else None)
        seeds.append({"tag": tag, "label": j["label"], "kind": j["kind"], "status": "ok", "identity": j["identity"],
                      "relative_predicted": j["relative_predicted"], "relative_measured": rel, "measured": runs_of,
                      "flips": j["flips"]})
    rows = summary_rows(seeds)
    return {"description": "Per perturbation: the relative measured time of its plan (the mean over every "
                           "measurement of that plan in the runs, each paired with the clean plan's runs right "
                           "before and after it) and its relative predicted time (the clean profile's cost model).",
            "clean": clean, "runs": [{"file": p.name, "command": r.get("command"), "date": r.get("hardware", {})
                                      .get("date")} for p, r in runs],
            "seeds": seeds, "rows": rows}


def write_combined(result: dict, docs: Path) -> None:
    """``robustness.json`` (combined), the ``combined`` section of ``robustness.md``, the figure."""
    docs = Path(docs)
    save_json(docs / "robustness.json", result)
    worst = sorted((x for x in result["seeds"] if x["measured"]), key=lambda x: -x["relative_measured"])[:3]
    lines = ["Combined from " + ", ".join(f"`{r['file']}`" for r in result["runs"])
             + f" (`python exp/noise.py --combine ...`); clean plan `{result['clean']}`.", "",
             table(HEADERS, table_rows(result["rows"])), "",
             "Slowest measured plans (relative time of each measurement):", ""]
    for x in worst:
        lines.append(f"- {x['tag']} (`{x['identity']}`, predicted {x['relative_predicted']:.3f}): "
                     + ", ".join(f"{m['relative']:.3f} ({m['run']})" for m in x["measured"]))
    write_section(docs / "robustness.md", "combined", "\n".join(lines), title="Robustness to profile errors")
    figure(result["rows"], docs / "robustness.png", "combined runs")
