"""The flags of ``hidup profile`` (and ``exp/profiler.py``) and the :class:`ProfileOptions` they make.

:func:`add_profile_args` adds them, the launch flags included (:mod:`hidup.cli.launch_flags`);
:func:`profile_options` checks them and turns them into the
:class:`hidup.profiler.measure.machine.ProfileOptions` that the measuring harness takes;
:func:`run_profile` starts the ranks (:func:`hidup.profiler.measure.machine.profile_ranks`), or in one
process with nothing to merge prints the device's rates (:func:`~hidup.profiler.measure.machine.device_only`),
and prints what the written profile holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import hidup.models
from hidup.cli.launch_flags import add_launch_args, launch_options
from hidup.models.source import ModelSourceError, load_factory
from hidup.profiler.measure.machine import ProfileOptions, device_only, profile_ranks
from hidup.profiler.profile import load
from hidup.runtime.launch import layout_from_env

__all__ = ["add_profile_args", "profile_options", "run_profile", "parse_sizes", "parse_overrides"]


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``exp/profiler.py`` / ``hidup profile`` (launch flags included)."""
    _measurement_flags(p)
    _model_flags(p)
    add_launch_args(p)


def _measurement_flags(p: argparse.ArgumentParser) -> None:
    """What is measured on the device and the network, and where it goes."""
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="profile JSON to write (default profile_<name>.json; raw data in <out>.raw.json)",
    )
    p.add_argument("--name", default=None, help="profile name (default <gpu>x<world>-measured)")
    p.add_argument(
        "--sizes",
        default=None,
        help="collective sizes in logical bytes: '4K,1M,64M' or a power-of-two range '4K..256M' "
        "(default 4K..256M on GPUs, 4K..4M on CPUs)",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing (about 4x faster)")
    p.add_argument("--dtypes", default="fp32,tf32,bf16,fp16", help="compute dtypes to time (default all four)")
    p.add_argument("--matmul-sizes", default=None, help="square matmul sizes, e.g. 2048,4096,8192")
    p.add_argument(
        "--gemm-sizes",
        default=None,
        help="sizes of the (m, n, k) GEMM grid that prices a matmul by its shape, e.g. 256,1024,4096, or "
        "'none' (default 128..16384 by powers of two on a GPU, none on a CPU)",
    )
    p.add_argument(
        "--no-attention",
        action="store_true",
        help="leave out the table of attention times by variant, head dim, sequence and rows (measured by "
        "default on a GPU, in each storage dtype of --dtypes; the cost model prices attention from it)",
    )
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per point (default 0.3; quick 0.1)")
    p.add_argument(
        "--comm-rounds",
        type=int,
        default=1,
        metavar="R",
        help="measure the collective tables R times, one pass after the other, and keep each point's "
        "median: for a network whose speed drifts over seconds, e.g. NCCL over sockets (default 1)",
    )
    p.add_argument(
        "--merge",
        default=None,
        help="profile (builtin name or path) supplying what is not measured: "
        "the collectives (and their concurrency) in a single-process run, per-op times (with the "
        "Adam rate), unsupported dtypes",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="K",
        help="treat each block of K consecutive ranks as one node and measure both levels: the node's "
        "tables on groups inside a node and the network's on groups of one rank per node (default: "
        "the launch's nodes, NNODES/CPN or torchrun's LOCAL_WORLD_SIZE; on one host this simulates "
        "several nodes, e.g. for testing)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The models whose ops are timed and whose plans calibrate the profile."""
    p.add_argument(
        "--ops-model",
        default=None,
        help="also time the ops of these models (comma-separated zoo names "
        "or package.module:function factories returning (model, example_inputs)) at "
        "their sharded shapes (every signature, for each --ops-worlds; at the batch and at half of it, "
        "for duplication), check their sum against whole single-device steps (and the two copies on "
        "two streams; reported in the notes, not applied) and store them in the profile; the ranks "
        "split the work. "
        "Op shapes the --merge profile already has are not timed again",
    )
    p.add_argument(
        "--ops-worlds",
        default=None,
        help="world sizes to trace --ops-model for, e.g. '4,2' (default: the "
        "profiled world size; a single process with --merge needs it)",
    )
    p.add_argument(
        "--ops-precisions",
        default="fp32,tf32",
        help="precisions to time --ops-model in (the search's --precision; default fp32,tf32)",
    )
    p.add_argument(
        "--ops-overrides",
        default="",
        help="model overrides for --ops-model, e.g. 'layers=2,d_model=1024' (a factory gets them as keyword arguments)",
    )
    p.add_argument(
        "--ops-seconds",
        type=float,
        default=120.0,
        help="time limit of --ops-model per precision and rank, in seconds (default 120)",
    )
    p.add_argument(
        "--calibrate-plans",
        default=None,
        metavar="MODELS",
        help="last, on the ranks: search these zoo models' plans (comma-separated; --ops-overrides and "
        "--ops-precisions apply) with the profile so far, time each plan's forward + backward "
        "without and with duplication as training runs it, and store the compute factors that "
        "make the cost model match (dist_scale, dist_dup_scale); needs >= 2 ranks",
    )
    p.add_argument(
        "--held-out-plans",
        default=None,
        metavar="MODELS",
        help="with --calibrate-plans: time these zoo models' plans the same way and record how the "
        "fitted factors predict them (models the factors are not fitted on; comma-separated)",
    )


# ================================================================================ options


def profile_options(args: argparse.Namespace) -> ProfileOptions:
    """The :class:`ProfileOptions` of parsed :func:`add_profile_args` flags; a bad value ends in
    ``SystemExit`` naming its flag (a size that cannot be read, or an override: ``ValueError``)."""
    precisions = tuple(p.strip() for p in args.ops_precisions.split(",") if p.strip())
    if args.comm_rounds < 1:
        raise SystemExit(f"--comm-rounds {args.comm_rounds}: give at least one pass (1 measures the tables once)")
    return ProfileOptions(
        sizes=parse_sizes(args.sizes) if args.sizes else None,
        dtypes=tuple(d for d in args.dtypes.split(",") if d.strip()),
        progress=not args.no_progress,
        quick=args.quick,
        name=args.name,
        merge=args.merge,
        matmul_sizes=tuple(int(n) for n in args.matmul_sizes.split(",")) if args.matmul_sizes else None,
        gemm_sizes=_gemm_sizes(args.gemm_sizes),
        attention=False if args.no_attention else None,
        budget_s=args.budget,
        comm_rounds=args.comm_rounds,
        ops_precisions=precisions,
        **_ops_models(args),
        **_calibration(args),
    )


def _ops_models(args: argparse.Namespace) -> dict:
    """``--ops-model`` and what goes with it, as :class:`ProfileOptions` fields."""
    if not args.ops_model:
        return {}
    names = _names(args.ops_model, "--ops-model")
    overrides = parse_overrides(args.ops_overrides)
    worlds = [int(w) for w in _names(args.ops_worlds, "--ops-worlds")] if args.ops_worlds else None
    return dict(ops_models=[(n, overrides) for n in names], ops_worlds=worlds, ops_seconds=args.ops_seconds)


def _calibration(args: argparse.Namespace) -> dict:
    """``--calibrate-plans`` and ``--held-out-plans``, checked, as :class:`ProfileOptions` fields."""
    fitted, held_out, overrides = [], [], {}
    if args.calibrate_plans:
        fitted = _names(args.calibrate_plans, "--calibrate-plans")
        overrides = parse_overrides(args.ops_overrides)
        held_out = _names(args.held_out_plans, "--held-out-plans") if args.held_out_plans else []
    if args.held_out_plans and not args.calibrate_plans:
        raise SystemExit("--held-out-plans checks the factors --calibrate-plans fits: give --calibrate-plans too")
    both = sorted(set(fitted) & set(held_out))
    if both:
        raise SystemExit(
            f"--held-out-plans {', '.join(both)}: also in --calibrate-plans; a held-out model must be "
            "one the factors are not fitted on"
        )
    if not fitted:
        return {}
    return dict(calibrate_plans=[(n, overrides) for n in fitted], held_out_plans=[(n, overrides) for n in held_out])


def _names(text: str, flag: str) -> list[str]:
    """The comma-separated items of ``flag``'s value, checked (zoo model names or ``package.module:function``
    factories, whose module and function must exist; or world sizes)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if flag == "--ops-worlds":
        if not items or not all(x.isdigit() and int(x) >= 1 for x in items):
            raise SystemExit(f"{flag} {text!r}: expected world sizes >= 1 separated by commas, e.g. '4,2'")
        return items

    unknown = [x for x in items if x not in hidup.models.names() and not hidup.models.is_factory(x)]
    if not items or unknown:
        raise SystemExit(
            f"{flag} {text!r}: unknown model(s) {', '.join(unknown) or '(none given)'}; the zoo has "
            f"{', '.join(hidup.models.names())}, or give package.module:function"
        )
    for spec in filter(hidup.models.is_factory, items):
        try:
            load_factory(spec)
        except ModelSourceError as e:
            raise SystemExit(f"{flag}: {e}") from None
    return items


def _gemm_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--gemm-sizes``: None (the device's default), () for ``none``, else the sizes."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0:
        raise SystemExit(
            f"--gemm-sizes {text!r}: give positive integers separated by commas (e.g. 256,1024,4096) or 'none'"
        )
    return sizes


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def _one_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write bytes with an optional unit: 4096, 4K, 16M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M,64M"`` (a list) or ``"4K..256M"`` (every power of two from 4 KiB to 256 MiB)."""
    if ".." in text:
        lo, hi = (_one_size(t) for t in text.split("..", 1))
        if lo <= 0 or hi < lo:
            raise ValueError(f"size range {text!r} must go from a positive size up")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= 2
        return out
    sizes = [_one_size(t) for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes {text!r}: give at least one positive size")
    return sorted(set(sizes))


def parse_overrides(text: str) -> dict:
    """``"layers=2,d_model=1024,capacity_factor=2.5"`` -> ``{"layers": 2, "d_model": 1024, ...}``."""
    out: dict = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"model override {item!r} must be written key=value (e.g. layers=2)")
        key = key.strip().replace("-", "_")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"model override {item!r}: the value must be a number") from None
    return out


# ================================================================================ the command


def run_profile(args: argparse.Namespace) -> int:
    """Launch the ranks per ``args`` (NODERANK/CPN, torchrun or one process) and profile."""
    options = profile_options(args)
    launch = launch_options(args)
    layout = layout_from_env(nnodes=launch.nnodes, cpn=launch.cpn, node_rank=launch.node_rank)
    single = layout.source == "single"
    options = dataclasses.replace(options, gpus_per_node=_check_gpus_per_node(args.gpus_per_node, layout))
    if single and args.calibrate_plans:
        raise SystemExit(
            "--calibrate-plans times plans on the ranks: launch >= 2 (CPN=<GPUs> NODERANK=0, or "
            "torchrun), or leave it out"
        )
    if single and args.merge is None:
        return device_only(options, args.out)
    nnodes = launch.nnodes or int(os.environ.get("NNODES", "1") or 1)
    if launch.master_port is None and not os.environ.get("MASTER_PORT") and nnodes == 1:
        launch = dataclasses.replace(launch, master_port=0)  # one host: the launcher's store on a free port
    path = profile_ranks(options, args.out.resolve() if args.out is not None else None, launch)
    if path is None:
        return 0  # another host holds global rank 0 and writes the file
    _print_profile(path)
    return 0


def _print_profile(path: str) -> None:
    """The written profile: its rates and each collective table's latency and largest bandwidth."""
    prof = load(path)
    print(f"profile {prof.name!r} written to {path}")
    for d, r in prof.flops.items():
        print(f"  {d:5s} {r / 1e12:9.2f} TFLOP/s")
    levels = [("", prof.collectives)]
    if prof.network is not None:
        print(f"  {prof.gpus_per_node} ranks per node; across nodes (one rank per node) marked 'net'")
        levels.append((" net", prof.network.collectives))
    for mark, collectives in levels:
        for c, tabs in collectives.items():
            for g, t in tabs.items():
                print(
                    f"  {c:15s} x{g}{mark:4s}: alpha {t.alpha * 1e6:8.1f} us, algbw {t.algbw[-1] / 1e9:8.2f} GB/s "
                    f"at {t.sizes[-1] / 2**20:.0f} MiB"
                )


def _check_gpus_per_node(value: int | None, layout) -> int | None:
    """``--gpus-per-node``, checked against the launch's ranks (None: the launch's own nodes)."""
    if value is None:
        return None
    if layout.source == "single":
        raise SystemExit(
            f"--gpus-per-node {value} groups the ranks of a run into nodes: launch >= 2 ranks "
            "(CPN=<ranks> NODERANK=0, or torchrun), or leave it out"
        )
    if value < 1 or layout.world_size % value:
        raise SystemExit(
            f"--gpus-per-node {value}: the {layout.world_size} ranks do not split into nodes of {value}; "
            f"give a divisor of {layout.world_size}"
        )
    if layout.nnodes > 1 and value != layout.cpn:
        raise SystemExit(
            f"--gpus-per-node {value} contradicts the launch's {layout.nnodes} nodes of {layout.cpn} ranks; "
            "leave it out on a real multi-node launch"
        )
    return value
