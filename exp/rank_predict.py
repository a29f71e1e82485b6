"""How well the cost model predicts one rank's compute, against ``hidup bench-rank`` on a GPU.

Two steps, the first on any machine, the second wherever the bench-rank JSON files are:

``plans``: for each model of a set, writes world-N plan files of several styles (``searched``: the
search's plan without duplication; ``data``, ``tensor``, ``fsdp``: :func:`hidup.search.forced`), each
recording its model, so that ``hidup bench-rank --plan FILE`` rebuilds the same model on the GPU
(``exp/gpu_predict.sh`` runs them).

``predict``: for each bench-rank JSON (a run of one plan file, ``compile+graph`` and/or
``cuda-graph`` modes), the cost model's prediction of the rank's step without communication --
``compute + optimizer`` of :func:`hidup.search.price` without duplication, under ``--profile``, priced
as the mode runs (``compiled`` for the compile modes) -- against the measured median, per precision.
Models named by ``--calibration`` are in-sample for any factor fitted on them (``--fit``: the
geometric mean of measured / predicted over their runs, one for all runs or one per mode and
precision, applied to every prediction, and checked by leaving each calibration model out in
turn); the others are held out.  With ``--fit`` off the prediction is physical (nothing fitted on any run).

    python exp/rank_predict.py plans --set calibration --out docs/bench/predict/rank-plans
    python exp/rank_predict.py predict docs/bench/predict/*.json --profile docs/bench/predict/h100.json \\
        --calibration bert-sgmoe,gpt --fit per-setting --out docs/bench/predict/predictions.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import hidup
import hidup.models
import hidup.profiler
from hidup.plan import Plan
from hidup.search import forced, price, search

FACTORY = "exp.rank_models"

# model sets: name -> (spec, model args)
SETS = {
    "calibration": {
        "bert-sgmoe": ("bert-sgmoe", {}),
        "gpt": ("gpt", {}),
    },
    "held-out": {
        "vit-sgmoe": ("vit-sgmoe", {"batch_per_gpu": 64}),
        "llama": (f"{FACTORY}:llama", {}),
        "mixtral": (f"{FACTORY}:mixtral", {}),
    },
    # measured only after the cost model's changes made on the sets above: held out from both
    "held-out-2": {
        "bert-switch": ("bert-switch", {}),
        "vit-switch": ("vit-switch", {"batch_per_gpu": 64}),
        "gpt-1024": (
            "gpt",
            {"layers": 6, "d_model": 1024, "heads": 16, "ffn": 4096, "seq_len": 512, "batch_per_gpu": 8},
        ),
    },
}
STYLES = ("searched", "data", "tensor", "fsdp")


def _graph(spec: str, model_args: dict, world: int, device: str | None = None):
    """The model's graph as the ranks trace it: a factory's model built on ``device`` (default the
    CPU), a zoo model on ``meta``."""
    device = (device or None) if hidup.models.is_factory(spec) else "meta"
    model, inputs = hidup.models.build(spec, world_size=world, device=device, **model_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=world, half_batch=True)
    graph.model = spec
    return graph


def make_plans(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = hidup.profiler.load(args.profile)
    for name, (spec, model_args) in SETS[args.set].items():
        if args.models and name not in args.models.split(","):
            continue
        graph = _graph(spec, model_args, args.world, args.device)
        record = {"model": spec, "args": model_args}
        for style in args.styles.split(","):
            kw = dict(duplication=False, precision="bf16", progress=False, model_source=record)
            try:
                plan = search(graph, profile, **kw) if style == "searched" else forced(graph, profile, style, **kw)
            except Exception as e:  # noqa: BLE001 - a style the model cannot take is reported, the rest go on
                print(f"{name} {style}: no plan ({type(e).__name__}: {e})", flush=True)
                continue
            path = out / f"{name}-{style}.json"
            plan.save(path)
            print(f"{path}: predicted {plan.predicted['total'] * 1e3:.2f} ms on {profile.name}", flush=True)
    return 0


def _setting(row: dict, scheme: str) -> str:
    """The key a fitted factor is shared by: all runs (``one``) or one per mode and precision."""
    return "all" if scheme == "one" else f"{row['mode']}/{row['precision']}"


def fit_factors(rows: list[dict], scheme: str) -> dict[str, float]:
    """Geometric mean of measured / physical over ``rows``, per :func:`_setting`."""
    logs: dict[str, list[float]] = {}
    for r in rows:
        logs.setdefault(_setting(r, scheme), []).append(math.log(r["measured_ms"] / r["physical_ms"]))
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}


def cross_validated(rows: list[dict], scheme: str) -> list[float]:
    """|measured / predicted - 1| of each calibration run, its factors fitted on the other models."""
    errors = []
    for model in sorted({r["model"] for r in rows}):
        factors = fit_factors([r for r in rows if r["model"] != model], scheme)
        for r in rows:
            if r["model"] == model and _setting(r, scheme) in factors:
                errors.append(abs(r["measured_ms"] / (r["physical_ms"] * factors[_setting(r, scheme)]) - 1))
    return errors or [float("nan")]


def predict(args) -> int:
    profile = hidup.profiler.load(args.profile)
    calibration = set(filter(None, args.calibration.split(",")))
    rows = []
    graphs: dict = {}
    for path in args.runs:
        data = json.loads(Path(path).read_text())
        config = data["config"]
        plan = Plan.load(config["plan"]) if Path(config["plan"]).is_file() else None
        if plan is None:
            print(f"{path}: its plan file {config['plan']} is not here; skipped", file=sys.stderr)
            continue
        key = (config["model"], json.dumps(config["model_args"], sort_keys=True), config["world"])
        if key not in graphs:
            graphs[key] = _graph(config["model"], config["model_args"], config["world"], args.device)
        graph = graphs[key]
        name = Path(config["plan"]).stem
        model = name.rsplit("-", 1)[0]
        for run in data["runs"]:
            if run["what"] != "rank" or run["status"] != "ok":
                continue
            compiled = run["mode"].startswith("compile")
            ev = price(
                graph, profile, plan, run["precision"], cuda_graphs=run["mode"].endswith("graph"), compiled=compiled
            )
            ev = ev[False]
            rows.append(
                {
                    "plan": name,
                    "model": model,
                    "in_sample": model in calibration,
                    "mode": run["mode"],
                    "precision": run["precision"],
                    "measured_ms": run["step_ms_median"],
                    "physical_ms": (ev.compute + ev.optimizer) * 1e3,
                    "optimizer_ms": ev.optimizer * 1e3,
                    "kernels": run.get("kernels"),
                }
            )
    fit: dict | None = None
    if args.fit:
        cal = [r for r in rows if r["in_sample"]]
        if not cal:
            print("--fit: no run of a --calibration model", file=sys.stderr)
            return 2
        fit = fit_factors(cal, args.fit)
        cv = cross_validated(cal, args.fit)
        print(
            f"--fit {args.fit}: leave-one-calibration-model-out error (worst, mean): "
            f"{max(cv):.1%}, {sum(cv) / len(cv):.1%}"
        )
    for r in rows:
        r["predicted_ms"] = r["physical_ms"] * (fit[_setting(r, args.fit)] if fit else 1.0)
        r["ratio"] = r["measured_ms"] / r["predicted_ms"]
    print(f"profile {profile.name}; factors fitted on {sorted(calibration)}: {fit}")
    print(f"{'plan':24s} {'sample':9s} {'mode':14s} {'prec':5s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}")
    for r in rows:
        print(
            f"{r['plan']:24s} {'in' if r['in_sample'] else 'held-out':9s} {r['mode']:14s} {r['precision']:5s} "
            f"{r['measured_ms']:9.2f} {r['predicted_ms']:9.2f} {r['ratio']:6.3f}"
        )
    held = [r for r in rows if not r["in_sample"]]
    if held:
        worst = max(abs(r["ratio"] - 1) for r in held)
        within = sum(abs(r["ratio"] - 1) <= 0.10 for r in held)
        print(f"held out: {within} of {len(held)} within 10%, worst {worst:.1%}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"profile": profile.name, "fit": fit, "calibration": sorted(calibration), "rows": rows}, indent=1
            )
        )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plans", help="write plan files of each style for a model set")
    a.add_argument("--set", choices=sorted(SETS), default="calibration")
    a.add_argument("--styles", default=",".join(STYLES))
    a.add_argument("--models", default=None, help="comma-separated models of the set (default all)")
    a.add_argument("--world", type=int, default=4)
    a.add_argument("--profile", default="h200x4-nvlink", help="profile the plans are searched under")
    a.add_argument("--out", required=True)
    a.add_argument("--device", default=None, help="where factories build their model (default cpu)")
    b = sub.add_parser("predict", help="predicted against measured rank steps")
    b.add_argument("--device", default=None, help="where factories build their model (as for `plans`)")
    b.add_argument("runs", nargs="+", help="bench-rank JSON files")
    b.add_argument("--profile", required=True, help="the GPU's profile (builtin name or JSON)")
    b.add_argument("--calibration", default="", help="comma-separated models in-sample for --fit")
    b.add_argument(
        "--fit",
        choices=("one", "per-setting"),
        default=None,
        help="fit factors on the calibration models' runs: one for all, or one per mode and precision "
        "(default: none, the physical prediction)",
    )
    b.add_argument("--out", default=None)
    args = p.parse_args(argv)
    return make_plans(args) if args.cmd == "plans" else predict(args)


if __name__ == "__main__":
    raise SystemExit(main())
