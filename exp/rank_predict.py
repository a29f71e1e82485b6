"""How well the cost model predicts one rank's compute, against ``hidup bench-rank`` on a GPU.

Two steps, the first on any machine, the second wherever the bench-rank JSON files are:

``plans``: for each model of a set, writes world-N plan files of several styles (``searched``: the
search's plan without duplication; ``data``, ``tensor``, ``fsdp``: :func:`hidup.search.forced`), each
recording its model, so that ``hidup bench-rank --plan FILE`` rebuilds the same model on the GPU
(``exp/gpu_predict.sh`` runs them).

``register``: the same physical prediction for plan files alone, written (and committed) before the
runs it predicts.

``predict``: for each bench-rank JSON (a run of one plan file, ``compile+graph`` and/or
``cuda-graph`` modes), the cost model's prediction of the rank's step without communication --
``compute + optimizer`` of the plan without duplication (:func:`hidup.search.price`), under
``--profile``, priced as the mode runs (``compiled`` for the compile modes), plus the copies the
fake process group makes in place of the collectives (:func:`stand_in_copies`) -- against the
measured median, per precision, and the same split by kernel kind (:func:`priced`) against the
run's profiler trace (``--kernels``), so that a wrong prediction shows which kind it misses.
Models named by ``--calibration`` are in-sample for any factor fitted on them (``--fit``: the
geometric mean of measured / predicted over their runs, one for all runs or one per mode and
precision, applied to every prediction; ``compute``: one per mode and precision applied to all but
the memory copies, ``predicted = copies + f * (physical - copies)``, since the copies are priced by a
measured bandwidth and the factor stands for kernels that run below their measured rates; each
checked by leaving each calibration model out in turn); models named by ``--seen`` were looked at
while the cost model was built (their errors known, nothing fitted on them); the others are held
out.  With ``--fit`` off the prediction is physical
(nothing fitted on any run).

    python exp/rank_predict.py plans --set calibration --out exp/records/predict/rank-plans
    python exp/rank_predict.py predict exp/records/predict/h200-*/runs/rank-*.json \\
        --profile exp/records/predict/h200-10/h200-ops.json --calibration bert-sgmoe,gpt --fit per-setting \\
        --out exp/records/predict/h200-10/predictions.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch

import hidup
import hidup.models
import hidup.profiler
from hidup.models.source import recorded_source
from hidup.plan import Plan
from hidup.plan.record import traced_versions
from hidup.search import forced, search
from hidup.search.api import plan_indices, recomputed
from hidup.search.cost import KERNEL_KINDS, kernel_kind
from hidup.search.problem import Problem
from hidup.search.schedule import evaluate

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
    # chosen before the cost model priced a matmul by its shape, measured after it; its plans are searched
    # under a profile without a GEMM grid, so the shape pricing does not choose them
    "held-out-3": {
        "qwen2": (f"{FACTORY}:qwen2", {}),
        "gpt2-1280": (f"{FACTORY}:gpt2", {}),
        "gpt-512": (
            "gpt",
            {"layers": 6, "d_model": 512, "heads": 8, "ffn": 2048, "seq_len": 256, "batch_per_gpu": 32},
        ),
    },
    # chosen after held-out-3 was read and before any change to the cost model made after that: held out from it
    "held-out-4": {
        "llama-1536": (f"{FACTORY}:llama", {"hidden": 1536, "heads": 12, "kv_heads": 4, "ffn": 4096, "batch": 4}),
        "gpt2-1024": (f"{FACTORY}:gpt2", {"hidden": 1024, "heads": 16}),
        "mixtral-768": (
            f"{FACTORY}:mixtral",
            {"hidden": 768, "heads": 12, "kv_heads": 4, "ffn": 2048, "seq": 512, "batch": 8},
        ),
    },
    # chosen after held-out-4 was read, before the compute-only factor (--fit compute) was tried on a set
    # it was not chosen on: held out from that scheme and from any change made after it
    "held-out-5": {
        "qwen2-1024": (f"{FACTORY}:qwen2", {"hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 2816}),
        "gpt2-768": (f"{FACTORY}:gpt2", {"layers": 8, "hidden": 768, "heads": 12, "seq": 1024, "batch": 4}),
        "gpt-1536": (
            "gpt",
            {"layers": 4, "d_model": 1536, "heads": 12, "ffn": 6144, "seq_len": 512, "batch_per_gpu": 8},
        ),
    },
    # chosen with the measured attention table and the per-kind factors (--fit kinds), before either was
    # checked on any run: a dense attention below the table's shortest sequence, a masked one at head dim 96
    # (between the table's), a masked one at sequence 2048
    "held-out-6": {
        "vit-1024": ("vit-sgmoe", {"layers": 6, "d_model": 1024, "heads": 8, "ffn": 4096, "batch_per_gpu": 64}),
        "gpt2-1536": (f"{FACTORY}:gpt2", {"layers": 4, "hidden": 1536, "heads": 16, "seq": 512, "batch": 8}),
        "llama-s2048": (
            f"{FACTORY}:llama",
            {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn": 2816, "seq": 2048, "batch": 4},
        ),
    },
    # chosen after held-out-6 was read, with the scheme it was read under fixed before any run of this set
    # (--fit kinds --physical-kinds matmul,copies, calibration bert-sgmoe, gpt, qwen2-1024)
    "held-out-7": {
        "qwen2-2048": (
            f"{FACTORY}:qwen2",
            {"hidden": 2048, "heads": 16, "kv_heads": 2, "ffn": 5504, "seq": 1024, "batch": 4},
        ),
        "gpt-2048": (
            "gpt",
            {"layers": 4, "d_model": 2048, "heads": 16, "ffn": 8192, "seq_len": 1024, "batch_per_gpu": 4},
        ),
        "bert-switch-1024": ("bert-switch", {"layers": 6, "d_model": 1024, "heads": 16, "ffn": 4096, "seq_len": 256}),
    },
    # chosen after held-out-7 was read: dims off the GEMM grid (896, 2560, 1280) and misaligned vocabularies
    # (50257, 30522).  Registered before any run of it: held-out-7's scheme unchanged (--fit kinds
    # --physical-kinds matmul,copies, calibration bert-sgmoe, gpt, qwen2-1024, profile h200-7/h200.json, the
    # calibration runs of h200-8/runs); also reported, physical under h200-8/h200-points.json (the plans'
    # GEMMs measured at their exact and padded shapes), which already misprices those calibration runs'
    # matmuls by up to 1.23x
    "held-out-8": {
        "gpt2-896": (f"{FACTORY}:gpt2", {"layers": 6, "hidden": 896, "heads": 14, "seq": 1024, "batch": 4}),
        "llama-2560": (
            f"{FACTORY}:llama",
            {"layers": 3, "hidden": 2560, "heads": 20, "kv_heads": 4, "ffn": 6912, "seq": 1024, "batch": 2},
        ),
        "gpt-1280": (
            "gpt",
            {"layers": 6, "d_model": 1280, "heads": 10, "ffn": 5120, "seq_len": 512, "batch_per_gpu": 8},
        ),
    },
    # chosen after held-out-8 was read, before any run of it, with its scheme registered: the physical
    # prediction, nothing fitted, under the profile of the session that measures it (hidup profile, with
    # the sums over rows measured: reduction_bandwidth, kernel_floor_graph) plus the GEMM points of its
    # plans and the calibration plans (exp/gemm_check.py --points); also reported, held-out-7's scheme
    # (--fit kinds --physical-kinds matmul,copies, calibration bert-sgmoe, gpt, qwen2-1024) under the same
    # profile without points.  A Qwen2 of hidden 1792, a GPT-2 at sequence 2048, a zoo BERT-Switch (MoE)
    "held-out-9": {
        "qwen2-1792": (
            f"{FACTORY}:qwen2",
            {"layers": 4, "hidden": 1792, "heads": 14, "kv_heads": 2, "ffn": 4864, "batch": 4},
        ),
        "gpt2-s2048": (f"{FACTORY}:gpt2", {"layers": 4, "hidden": 1024, "heads": 16, "seq": 2048, "batch": 2}),
        "bert-switch-768": ("bert-switch", {"layers": 8, "seq_len": 256}),
    },
    # chosen after held-out-9 was read, before any run of it, with its scheme registered: the physical
    # prediction, nothing fitted, under held-out-9's profile (h200-9/h200-points.json) with the GEMM points
    # of these plans added (exp/gemm_check.py --points) and the opaque ops (the MoE gating) of these, the
    # calibration and held-out-9's plans timed on the GPU (exp/op_check.py).  Two MoE models the zoo
    # builds at sizes no set had: a BERT-SGMoE of d 1024 (top-2 gating) and a BERT-Switch of 4 experts per
    # GPU at sequence 512; measured in the order bert-sgmoe-1024-data, bert-switch-e4-data,
    # bert-sgmoe-1024-tensor, bert-switch-e4-tensor, then the FSDP plans
    "held-out-10": {
        "bert-sgmoe-1024": (
            "bert-sgmoe",
            {"layers": 4, "d_model": 1024, "heads": 16, "ffn": 4096, "seq_len": 256, "batch_per_gpu": 16},
        ),
        "bert-switch-e4": ("bert-switch", {"layers": 6, "experts_per_gpu": 4, "seq_len": 512, "batch_per_gpu": 8}),
    },
}
STYLES = ("searched", "data", "tensor", "fsdp")


def built(spec: str, model_args: dict, world: int, device: str | None = None):
    """``(model, inputs)`` of ``spec`` for ``world`` ranks: a factory's model built on ``device``
    (default the CPU), a zoo model on ``meta``."""
    device = (device or None) if hidup.models.is_factory(spec) else "meta"
    return hidup.models.build(spec, world_size=world, device=device, **model_args)


def _graph(spec: str, model_args: dict, world: int, device: str | None = None):
    """The model's graph as the ranks trace it (:func:`built`), with its half-batch graph."""
    model, inputs = built(spec, model_args, world, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = hidup.trace(model, inputs, world_size=world, half_batch=True)
    graph.model = spec
    return graph


def plan_file_arguments(parser: argparse.ArgumentParser, profile_help: str) -> None:
    """The arguments of a GPU check over plan files (``exp/gemm_check.py``, ``exp/op_check.py``): the
    plan files, the profile, the precisions and where factories build their model."""
    parser.add_argument("plans", nargs="+", help="plan files recording their model (exp/rank_predict.py plans)")
    parser.add_argument("--profile", required=True, help=profile_help)
    parser.add_argument("--precisions", default="tf32,bf16")
    parser.add_argument("--device", default=None, help="where factories build their model (default the CPU)")


def parsed_on_gpu(parser: argparse.ArgumentParser, argv, tool: str) -> argparse.Namespace | None:
    """``parser``'s arguments, or None after saying so when a plan file is missing or there is no CUDA
    GPU to time on."""
    args = parser.parse_args(argv)
    missing = [p for p in args.plans if not Path(p).is_file()]
    if missing:
        print(f"{tool}: no plan file {', '.join(missing)} (write them with exp/rank_predict.py plans)", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print(f"{tool}: needs a CUDA GPU", file=sys.stderr)
        return None
    return args


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


# What a collective copies on the fake process group in place of moving data (hidup.codegen.collectives,
# "One device standing in for a rank": one copy kernel filling the output as a mirrored world would):
# (bytes read and written as a multiple of the tensor's logical size B, kernels) for B over N ranks.
STAND_IN_COPIES = {
    "all_gather": lambda n: (1.0 + 1.0 / n, 1),  # reads the local B/N, writes B
    "reduce_scatter": lambda n: (2.0 / n, 1),  # reads and writes this rank's B/N
    "all_to_all": lambda n: (1.0 / n + 1.0 / n**2, 1),  # reads a B/N^2 chunk, writes the local B/N
    "all_reduce": lambda n: (0.0, 0),
}


def stand_in_copies(problem: Problem, steps) -> float:
    """Seconds of the copies the fake process group makes on the compute stream in place of the
    plan's collectives (:data:`STAND_IN_COPIES`), forward and backward: part of what ``hidup
    bench-rank`` measures, though no rank of a real run makes them (its collectives are priced as
    communication)."""
    cost, profile = problem.cost, problem.cost.profile
    total = 0.0
    for step in steps:
        for tid, _, src, dst in step.convs:
            conv = problem.conversion(tid, src, dst).conv
            parts = getattr(conv, "steps", None)
            if parts is None:
                parts = [(conv, cost.world, float(cost.nbytes[tid]))]
            else:
                parts = [(p.conv, cost.mesh[p.axis], cost.step_bytes(tid, p.before, p.axis)) for p in parts]
            grad = problem.graph.tensors[tid].requires_grad
            for c, n, nbytes in parts:
                fwd, bwd = c.collectives
                for collective in (fwd, bwd if grad else ""):
                    if collective:
                        passes, kernels = STAND_IN_COPIES[collective](n)
                        total += passes * nbytes / profile.memory_bandwidth + kernels * profile.op_overhead
    return total


def priced(graph, profile, plan: Plan, precision: str, mode: str) -> tuple[float, float, dict[str, float]]:
    """The cost model's physical seconds of a rank's step without communication (``compute +
    optimizer`` of the plan without duplication, priced as ``mode`` runs), the fake process group's
    copies (:func:`stand_in_copies`), and the two together by kernel kind
    (:data:`hidup.search.cost.KERNEL_KINDS`): each call node's compute under its kind
    (:func:`hidup.search.cost.kernel_kind`), the memory copies of the form changes and gradient
    buckets charged to it and the stand-in copies under ``copies`` (autocast's casts, a bias's
    gradient and the copies of padded matmul outputs under ``generated``: inductor generates them),
    the Adam step under ``optimizer`` (on the host, with its copies, for a plan that offloads it)."""
    problem = Problem(
        graph,
        profile.launched(mode.endswith("graph"), mode.startswith("compile")),
        precision,
        recompute=recomputed(plan),
        reshard=frozenset(getattr(plan, "reshard", None) or ()),
        zero=plan.zero_stage,
        offload=getattr(plan, "offload", "off") != "off",
    )
    ks = plan_indices(problem, plan)
    ev = evaluate(problem, ks, False)
    kinds = dict.fromkeys(KERNEL_KINDS, 0.0)
    for i, (node, k, step) in enumerate(zip(problem.order, ks, ev.steps)):
        own = sum(problem.compute[i][k])
        kind = kernel_kind(node.target) if node.op == "call" else None
        if kind is not None:
            sig = problem.sigs[i][k]  # autocast's casts and a bias's gradient run as generated kernels
            generated = sum(problem.cost.autocast_casts(node, sig)) + problem.cost.bias_grad(node, sig)
            kinds[kind] += own - generated
            kinds["generated"] += generated
        padded = 0.0  # a padded matmul output's copies around its conversion run as generated kernels
        for tid, _, src, dst in step.convs:
            conv = problem.conversion(tid, src, dst).conv
            first = conv.steps[0].conv.forward if getattr(conv, "steps", None) else conv.forward
            pad = problem.cost.padded_copies(tid, problem.forms[src], first)
            padded += pad * (2 if problem.graph.tensors[tid].requires_grad else 1)
        kinds["generated"] += padded
        kinds["copies"] += step.compute - own - padded
    kinds["optimizer"] = ev.optimizer
    stand_in = stand_in_copies(problem, ev.steps)
    kinds["copies"] += stand_in
    return ev.compute + ev.optimizer, stand_in, kinds


def _setting(row: dict, scheme: str) -> str:
    """The key a fitted factor is shared by: all runs (``one``) or one per mode and precision."""
    return "all" if scheme == "one" else f"{row['mode']}/{row['precision']}"


def _fixed_ms(row: dict, scheme: str) -> float:
    """The part of a run's physical prediction a factor leaves as it is: the memory copies (the form
    changes' and the fake process group's, priced by the measured copy bandwidth) under ``compute``,
    nothing under the other schemes."""
    return row["physical_kinds_ms"]["copies"] if scheme == "compute" else 0.0


def _traced(row: dict) -> bool:
    """Whether the run has its kernel times by kind (bench-rank ``--kernels``)."""
    return any(row["measured_kinds_ms"].values())


def _log_mean(logs: dict[str, list[float]]) -> dict[str, float]:
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items() if v}


def fit_factors(rows: list[dict], scheme: str, physical_kinds: frozenset = frozenset()) -> dict[str, float]:
    """The factors of ``scheme`` fitted on ``rows``: under ``one``, ``per-setting`` and ``compute``
    the geometric mean of (measured - fixed) / (physical - fixed) per :func:`_setting` (``fixed``:
    :func:`_fixed_ms`); under ``kinds``, per setting and kernel kind the geometric mean of the measured
    / physical kernel time of that kind over the runs with kernel times (``<setting>/<kind>``), and
    per setting the geometric mean of the measured step over the sum of the kinds so corrected
    (``<setting>/gaps``: the time between kernels); the kinds of ``physical_kinds`` keep factor 1."""
    logs: dict[str, list[float]] = {}
    if scheme != "kinds":
        for r in rows:
            fixed = _fixed_ms(r, scheme)
            ratio = (r["measured_ms"] - fixed) / (r["physical_ms"] - fixed)
            logs.setdefault(_setting(r, scheme), []).append(math.log(ratio))
        return _log_mean(logs)
    traced = [r for r in rows if _traced(r)]
    for r in traced:
        for kind in (k for k in KERNEL_KINDS if k not in physical_kinds):
            measured, physical = r["measured_kinds_ms"][kind], r["physical_kinds_ms"][kind]
            if measured > 0 and physical > 0:
                logs.setdefault(f"{_setting(r, scheme)}/{kind}", []).append(math.log(measured / physical))
    factors = _log_mean(logs)
    gaps: dict[str, list[float]] = {}
    for r in traced:
        kernels = _by_kinds(r, factors)
        gaps.setdefault(f"{_setting(r, scheme)}/gaps", []).append(math.log(r["measured_ms"] / kernels))
    return {**factors, **_log_mean(gaps)}


def _by_kinds(row: dict, factors: dict[str, float]) -> float:
    """Sum over kernel kinds of the physical time times its factor (1 where none was fitted)."""
    setting = _setting(row, "kinds")
    return sum(factors.get(f"{setting}/{k}", 1.0) * row["physical_kinds_ms"][k] for k in KERNEL_KINDS)


def scaled(row: dict, factors: dict[str, float], scheme: str) -> float | None:
    """The prediction of ``row`` under the fitted ``factors`` of ``scheme`` (:func:`fit_factors`):
    ``fixed + factor * (physical - fixed)``, or under ``kinds`` ``gaps * sum over kinds of factor *
    physical``; None when no factor was fitted for the run's setting."""
    setting = _setting(row, scheme)
    if scheme == "kinds":
        gaps = factors.get(f"{setting}/gaps")
        return None if gaps is None else gaps * _by_kinds(row, factors)
    if setting not in factors:
        return None
    fixed = _fixed_ms(row, scheme)
    return fixed + factors[setting] * (row["physical_ms"] - fixed)


def cross_validated(rows: list[dict], scheme: str, physical_kinds: frozenset = frozenset()) -> list[float]:
    """|measured / predicted - 1| of each calibration run, its factors fitted on the other models."""
    errors = []
    for model in sorted({r["model"] for r in rows}):
        factors = fit_factors([r for r in rows if r["model"] != model], scheme, physical_kinds)
        for r in rows:
            predicted = scaled(r, factors, scheme) if r["model"] == model else None
            if predicted is not None:
                errors.append(abs(r["measured_ms"] / predicted - 1))
    return errors or [float("nan")]


def predict(args) -> int:
    profile = hidup.profiler.load(args.profile)
    calibration = set(filter(None, args.calibration.split(",")))
    seen = set(filter(None, args.seen.split(","))) - calibration
    modes = set(filter(None, args.modes.split(",")))
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
            if run["what"] != "rank" or run["status"] != "ok" or (modes and run["mode"] not in modes):
                continue
            compute, stand_in, kinds = priced(graph, profile, plan, run["precision"], run["mode"])
            measured_kinds = (run.get("kernels") or {}).get("kinds_ms", {})
            rows.append(
                {
                    "plan": name,
                    "model": model,
                    "in_sample": model in calibration,
                    "sample": "calibration" if model in calibration else "seen" if model in seen else "held out",
                    "mode": run["mode"],
                    "precision": run["precision"],
                    "measured_ms": run["step_ms_median"],
                    "physical_ms": (compute + stand_in) * 1e3,
                    "stand_in_ms": stand_in * 1e3,
                    "physical_kinds_ms": {k: v * 1e3 for k, v in kinds.items()},
                    "measured_kinds_ms": {k: measured_kinds.get(k, 0.0) for k in KERNEL_KINDS},
                    "kernels": run.get("kernels"),
                }
            )
    if not rows:
        which = f" of modes {args.modes}" if modes else ""
        print(f"predict: no finished rank run{which} in {args.runs}", file=sys.stderr)
        return 2
    fit: dict | None = None
    if args.fit:
        cal = [r for r in rows if r["in_sample"]]
        if not cal:
            print("--fit: no run of a --calibration model", file=sys.stderr)
            return 2
        physical_kinds = frozenset(filter(None, args.physical_kinds.split(",")))
        if physical_kinds - set(KERNEL_KINDS):
            print(f"--physical-kinds: not kernel kinds: {sorted(physical_kinds - set(KERNEL_KINDS))}", file=sys.stderr)
            return 2
        fit = fit_factors(cal, args.fit, physical_kinds)
        cv = cross_validated(cal, args.fit, physical_kinds)
        print(
            f"--fit {args.fit}: leave-one-calibration-model-out error (worst, mean): "
            f"{max(cv):.1%}, {sum(cv) / len(cv):.1%}"
        )
    for r in rows:
        predicted = scaled(r, fit, args.fit) if fit else r["physical_ms"]
        if predicted is None:
            print(f"--fit {args.fit}: no factor fitted for {_setting(r, args.fit)} (plan {r['plan']})", file=sys.stderr)
            return 2
        r["predicted_ms"] = predicted
        r["ratio"] = r["measured_ms"] / predicted
    print(f"profile {profile.name}; factors fitted on {sorted(calibration)}: {fit}")
    print(f"{'plan':24s} {'sample':11s} {'mode':14s} {'prec':5s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}")
    for r in rows:
        print(
            f"{r['plan']:24s} {r['sample']:11s} {r['mode']:14s} {r['precision']:5s} "
            f"{r['measured_ms']:9.2f} {r['predicted_ms']:9.2f} {r['ratio']:6.3f}"
        )
    print("by kernel kind, measured / physical ms (eager programs count their elementwise kernels as copies or other):")
    print(f"{'plan':24s} {'mode':14s} {'prec':5s} " + " ".join(f"{k:>13s}" for k in KERNEL_KINDS))
    for r in rows:
        if r["measured_kinds_ms"] and any(r["measured_kinds_ms"].values()):
            cells = (f"{r['measured_kinds_ms'][k]:6.2f}/{r['physical_kinds_ms'][k]:<6.2f}" for k in KERNEL_KINDS)
            print(f"{r['plan']:24s} {r['mode']:14s} {r['precision']:5s} " + " ".join(f"{c:>13s}" for c in cells))
    for sample in ("calibration", "seen", "held out"):
        for mode in ("compile+graph", None):
            some = [r for r in rows if r["sample"] == sample and mode in (None, r["mode"])]
            if some:
                worst = max(abs(r["ratio"] - 1) for r in some)
                within = sum(abs(r["ratio"] - 1) <= 0.10 for r in some)
                what = f"{sample} ({mode or 'all modes'})"
                print(f"{what:28s}: {within} of {len(some)} within 10%, worst {worst:.1%}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "profile": profile.name,
                    "fit": fit,
                    "fit_scheme": args.fit,
                    "physical_kinds": sorted(filter(None, args.physical_kinds.split(","))),
                    "calibration": sorted(calibration),
                    "seen": sorted(seen),
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


def register(args) -> int:
    """The physical prediction of rank 0's step of each plan file, per mode and precision, written
    before the runs it predicts (``predict`` then compares the runs with the same function)."""
    profile = hidup.profiler.load(args.profile)
    rows = []
    for path in args.plans:
        plan = Plan.load(path)
        source = recorded_source(plan)
        if source is None:
            print(f"register: {path} does not record its model", file=sys.stderr)
            return 2
        graph = _graph(source["model"], source.get("args") or {}, plan.world_size, args.device)
        for mode in filter(None, args.modes.split(",")):
            for precision in filter(None, args.precisions.split(",")):
                compute, stand_in, kinds = priced(graph, profile, plan, precision, mode)
                rows.append(
                    {
                        "plan": Path(path).stem,
                        "mode": mode,
                        "precision": precision,
                        "physical_ms": (compute + stand_in) * 1e3,
                        "stand_in_ms": stand_in * 1e3,
                        "physical_kinds_ms": {k: v * 1e3 for k, v in kinds.items()},
                    }
                )
                print(f"{rows[-1]['plan']:28s} {mode:14s} {precision:5s} predicted {rows[-1]['physical_ms']:8.2f} ms")
    record = {"profile": profile.name, "profile_file": args.profile, "rows": rows}
    record["versions"] = traced_versions()
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
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
    r = sub.add_parser("register", help="physical predictions of plan files' rank steps, before their runs")
    r.add_argument("plans", nargs="+", help="plan files recording their model")
    r.add_argument("--profile", required=True, help="the GPU's profile (builtin name or JSON)")
    r.add_argument("--modes", default="compile+graph")
    r.add_argument("--precisions", default="bf16")
    r.add_argument("--device", default=None, help="where factories build their model (default cpu)")
    r.add_argument("--out", default=None)
    b = sub.add_parser("predict", help="predicted against measured rank steps")
    b.add_argument("--device", default=None, help="where factories build their model (as for `plans`)")
    b.add_argument("runs", nargs="+", help="bench-rank JSON files")
    b.add_argument("--profile", required=True, help="the GPU's profile (builtin name or JSON)")
    b.add_argument("--calibration", default="", help="comma-separated models in-sample for --fit")
    b.add_argument("--seen", default="", help="comma-separated models whose runs the cost model was built looking at")
    b.add_argument(
        "--fit",
        choices=("one", "per-setting", "compute", "kinds"),
        default=None,
        help="fit factors on the calibration models' runs: one for all, one per mode and precision, one "
        "per mode and precision applied to all but the memory copies, or one per mode, precision and kernel "
        "kind from the runs' kernel times (--kernels) with one for the gaps between kernels (default: none, "
        "the physical prediction)",
    )
    b.add_argument(
        "--modes",
        default="",
        help="comma-separated bench-rank modes to predict (default: every mode the runs hold)",
    )
    b.add_argument(
        "--physical-kinds",
        default="",
        help=f"with --fit kinds: comma-separated kernel kinds of {KERNEL_KINDS} priced as measured, no factor fitted",
    )
    b.add_argument("--out", default=None)
    args = p.parse_args(argv)
    return {"plans": make_plans, "register": register, "predict": predict}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
