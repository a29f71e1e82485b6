"""Profile a machine: device FLOP rates and collective tables, written as a profile JSON.

``profile_machine`` runs on every rank of an initialized process group (or in one process, which
measures the device only) and returns a :class:`hidup.profiler.profile.Profile`:

* ``flops[dtype]`` = min over ranks of the peak matmul rate ``max_n 2 n^3 / t(n)`` (device.py);
* ``collectives[c][g]`` for the world and for pairs (comm.py): ``alpha`` fitted on the smallest
  sizes and the table bandwidth *net of alpha*, ``algbw(S) = S / (t(S) - alpha)``, because the
  profile charges ``time(S) = alpha + S / algbw(S)``; at every measured size that is ``t(S)``.
  The nccl-tests bandwidth ``S / t(S)`` is kept in the raw sidecar file ``<out>.raw.json``;
* ``concurrency[c][world]``: at every size, ``2 t(S) / t_pair(S)`` with ``t_pair`` the time of two
  equal calls issued together on two communicators of the whole world (what duplication's two
  copies do), in [1, 2] once clamped by the cost model; ``op_overhead`` / ``op_overhead_graph``:
  the fixed cost per op, eager and inside a CUDA graph (device.py);
* on several nodes of ``K`` ranks (``NNODES`` > 1 with ``CPN=K``, torchrun's ``LOCAL_WORLD_SIZE=K``
  below ``WORLD_SIZE``, or ``--gpus-per-node K`` to treat blocks of ``K`` consecutive ranks of one
  host as nodes): ``gpus_per_node = K``, the top-level tables (the node level) on groups of
  consecutive ranks inside each node (``K`` and pairs), and ``network`` on groups of one rank per
  node (all the nodes, and pairs of nodes), each level's concurrency on its largest groups
  (comm.py, "Nodes"; the levels: :mod:`hidup.profiler.profile`).  With one rank per node there is
  one level: every table is across nodes and ``gpus_per_node`` stays 0.

Ranks are started by :func:`hidup.runtime.launch.launch`: ``NODERANK``/``CPN`` (one launcher per
host spawning ``CPN`` ranks), torchrun's environment, or one process.  :func:`add_profile_args`
and :func:`run_profile` are the command line shared by ``exp/profiler.py`` and ``hidup profile``;
``--ops-model`` adds per-op times of a zoo model (ops.py, :func:`measure_model_ops`) to the profile;
``--calibrate-plans`` last times searched plans on the ranks (:func:`hidup.profiler.measure.calibrate.program_scales`).

Time bound: every (collective, size, group) point and every dtype gets about ``budget_s``
seconds (0.3 s, 0.1 s with ``quick``; whole-world points twice, for the pairs), so a 4-GPU host
(17 sizes x 4 collectives x 2 group sizes) takes one to two minutes; several nodes measure both
levels, up to twice as long.  ``comm_rounds`` (``--comm-rounds``)
measures the collective tables that many times over and keeps each point's median, for a network
whose speed drifts over seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hidup.models
from hidup.codegen.timing import max_over_ranks
from hidup.files import atomic_write
from hidup.models.source import ModelSourceError, load_factory
from hidup.profiler import profile as profile_mod
from hidup.profiler.attention import AttentionTable
from hidup.profiler.gemm import GemmGrid
from hidup.profiler.measure.calibrate import measure_model_ops, program_scales
from hidup.profiler.measure.comm import (
    default_comm_sizes,
    default_group_sizes,
    network_groups,
    node_groups,
    profile_collectives,
)
from hidup.profiler.measure.device import (
    adam_seconds_per_byte,
    attention_table,
    canonical_dtype,
    default_attention_grid,
    default_gemm_sizes,
    default_matmul_sizes,
    device_rates,
    dtype_supported,
    gemm_grid,
    grad_copy_overhead,
    kernel_floor,
    layout_bandwidth,
    memory_bandwidth,
    op_overhead,
    reduction_bandwidth,
    torch_dtype,
    transpose_bandwidth,
)
from hidup.profiler.profile import DTYPES, CommTable, Profile, load, save
from hidup.runtime.launch import add_launch_args, launch, launch_kwargs, layout_from_env

__all__ = [
    "profile_machine",
    "measure_model_ops",
    "write_profile",
    "comm_tables",
    "parse_sizes",
    "parse_overrides",
    "add_profile_args",
    "run_profile",
]


def _rates_agreed(rates: dict[str, float], device: torch.device) -> dict[str, float]:
    """Minimum over ranks of each rate (the slowest device bounds a synchronous step): minus the
    maximum of the negated rates, which is exact."""
    keys = sorted(rates)
    return dict(zip(keys, (-r for r in max_over_ranks([-rates[k] for k in keys], None, device))))


def _stored_as(storage: str, dtypes: tuple[str, ...], device: torch.device) -> bool:
    """Whether a compute dtype of ``dtypes`` stores its tensors as ``storage`` on ``device`` (float32 for
    ``fp32`` and ``tf32``): the attention tables measured for those dtypes."""
    return dtype_supported(device, storage) and any(torch_dtype(d) == torch_dtype(storage) for d in dtypes)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


class _Progress:
    """A rich progress bar on rank 0; silent elsewhere or when disabled."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]profile[/]"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
            )
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return str(n)


def comm_tables(curves) -> dict[str, dict[int, "CommTable"]]:
    """Profile tables from measured curves: ``alpha`` as fitted and the bandwidth *net of alpha*,
    ``algbw(S) = S / max(t(S) - alpha, 1e-3 t(S))``, so that the profile's
    ``time = alpha + S / algbw(S)`` reproduces each measured ``t(S)`` (to 0.1 % of it)."""
    tables: dict[str, dict[int, CommTable]] = {}
    for c in curves:
        bws = [s / max(t - c.alpha, 1e-3 * t) for s, t in zip(c.sizes, c.seconds)]
        tables.setdefault(c.op, {})[c.group_size] = CommTable(c.alpha, [float(s) for s in c.sizes], bws)
    return tables


def profile_machine(
    world: int | None = None,
    sizes: list[int] | None = None,
    dtypes: tuple[str, ...] = DTYPES,
    progress: bool = True,
    *,
    device: torch.device | str | None = None,
    out: str | Path | None = None,
    name: str | None = None,
    quick: bool = False,
    merge=None,
    matmul_sizes: tuple[int, ...] | None = None,
    gemm_sizes: tuple[int, ...] | None = None,
    attention: bool | None = None,
    group_sizes: list[int] | None = None,
    budget_s: float | None = None,
    ops_models: list[tuple[str, dict]] | None = None,
    ops_worlds: list[int] | None = None,
    ops_precisions: tuple[str, ...] = ("fp32",),
    ops_seconds: float = 120.0,
    calibrate_plans: list[tuple[str, dict]] | None = None,
    calibrate_precisions: tuple[str, ...] | None = None,
    comm_rounds: int = 1,
    held_out_plans: list[tuple[str, dict]] | None = None,
    gpus_per_node: int | None = None,
) -> "Profile":
    """Measure this machine and return a :class:`hidup.profiler.profile.Profile` (same on every rank).

    Inside an initialized process group of ``world`` ranks (every rank calls this): device FLOP
    rates per dtype (min over ranks) and the four collectives at ``sizes`` (logical bytes) on the
    whole world and on pairs.  With ``world == 1`` only the device is measured and the collective
    tables come from ``merge`` (a builtin profile name, a path, or a ``Profile``).  ``merge`` also
    contributes per-op times and any dtype not measured.  Rank 0 writes ``out`` (the profile JSON)
    and ``<out>.raw.json`` (the raw measurements, including the nccl-tests ``algbw = S / t``).
    ``ops_models`` ((zoo name, overrides) pairs) adds their per-op times for each world size of
    ``ops_worlds`` (default: this group's) in each of ``ops_precisions`` (:func:`measure_model_ops`).
    ``calibrate_plans`` ((zoo name, overrides) pairs) last times their searched plans on the ranks in
    each of ``calibrate_precisions`` (default ``ops_precisions``) and stores the compute factors
    inside the distributed program fitted on them, checked on the plans of ``held_out_plans``
    (:func:`hidup.profiler.measure.calibrate.program_scales`; both lists recorded in the corrections).
    ``comm_rounds`` measures the collective tables that many times and keeps each point's median
    (:func:`hidup.profiler.measure.comm.profile_collectives`).  ``gpus_per_node`` (``K``, a divisor of
    ``world`` below it) measures two levels, blocks of ``K`` consecutive ranks being nodes (module
    docstring); ``group_sizes`` are then the node level's.
    """
    prof, raw = _measure(
        world,
        sizes,
        dtypes,
        progress,
        device=device,
        name=name,
        quick=quick,
        merge=merge,
        matmul_sizes=matmul_sizes,
        gemm_sizes=gemm_sizes,
        attention=attention,
        group_sizes=group_sizes,
        budget_s=budget_s,
        comm_rounds=comm_rounds,
        gpus_per_node=gpus_per_node,
    )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    prof = _calibrate(
        prof,
        raw,
        torch.device(device),
        ops_models,
        ops_worlds,
        tuple(ops_precisions),
        ops_seconds,
        calibrate_plans,
        tuple(calibrate_precisions or ops_precisions),
        held_out_plans,
    )
    if out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        write_profile(prof, raw, out)
    return prof


def _calibrate(
    prof,
    raw: dict,
    device: torch.device,
    ops_models,
    ops_worlds,
    ops_precisions: tuple,
    ops_seconds: float,
    calibrate_plans,
    calibrate_precisions: tuple,
    held_out_plans=None,
):
    """``prof`` with the models' per-op times and their single-device checks
    (:func:`measure_model_ops`, when ``ops_models``), then the corrections inside the distributed
    program fitted on ``calibrate_plans`` and checked on ``held_out_plans`` (:func:`program_scales`);
    ``raw`` records how long each took."""
    if ops_models:
        t0 = time.perf_counter()
        group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        prof = measure_model_ops(prof, ops_models, list(ops_worlds or [group]), device, ops_precisions, ops_seconds)
        raw["ops_s"] = time.perf_counter() - t0
    if calibrate_plans:
        t0 = time.perf_counter()
        prof = program_scales(prof, calibrate_plans, calibrate_precisions, device, held_out=held_out_plans or [])
        raw["calibrate_plans_s"] = time.perf_counter() - t0
    return prof


def write_profile(prof, raw: dict, out: str | Path) -> Path:
    """Write the profile JSON to ``out`` and the raw measurements to ``<out stem>.raw.json``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(prof, out)
    atomic_write(out.with_name(out.stem + ".raw.json"), json.dumps(raw, indent=1) + "\n")
    return out


def _measure(
    world,
    sizes,
    dtypes,
    progress,
    *,
    device,
    name,
    quick,
    merge,
    matmul_sizes,
    group_sizes,
    budget_s,
    gemm_sizes=None,
    comm_rounds: int = 1,
    gpus_per_node: int | None = None,
    attention: bool | None = None,
):
    """The measurements of :func:`profile_machine`: ``(profile, raw dict)``."""
    initialized = dist.is_available() and dist.is_initialized()
    pg_world = dist.get_world_size() if initialized else 1
    world = pg_world if world is None else world
    if world != pg_world:
        raise ValueError(
            f"profile_machine(world={world}) but the process group has {pg_world} ranks; "
            f"initialize torch.distributed with world_size={world} (or pass world=None)"
        )
    rank = dist.get_rank() if initialized else 0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    base = profile_mod.load(merge) if merge is not None else None
    if world == 1 and base is None:
        raise ValueError(
            "a single process can only measure the device; give merge=<profile name or path> "
            "to take the collective tables from, or run on >= 2 ranks (NODERANK/CPN or torchrun)"
        )
    dtypes = tuple(dict.fromkeys(canonical_dtype(d) for d in dtypes))
    sizes = sorted(set(sizes or default_comm_sizes(device, quick)))
    matmul_sizes = tuple(matmul_sizes or default_matmul_sizes(device))
    if gemm_sizes is None:  # a GPU's grid by default; a CPU's only when asked (its profile prices no GPU)
        gemm_sizes = default_gemm_sizes(device) if device.type == "cuda" else ()
    # the attention table per storage dtype (float32 serves tf32), on a GPU unless turned off
    attention_grid = default_attention_grid(device) if attention is not False else ((), (), ())
    if attention and not attention_grid[0]:
        raise ValueError(f"the attention table is measured on a GPU only; {device} has none (turn it off)")
    attention_dtypes = [s for s in profile_mod.ATTENTION_DTYPES if attention_grid[0] and _stored_as(s, dtypes, device)]
    per_node = _gpus_per_node(world, gpus_per_node)
    nnodes = world // per_node if per_node else 1
    group_sizes = default_group_sizes(per_node or world) if group_sizes is None else list(group_sizes)
    network_sizes = default_group_sizes(nnodes) if per_node else []
    budget = budget_s if budget_s is not None else (0.1 if quick else 0.3)
    ops = profile_mod.COLLECTIVES
    n_groups = len(group_sizes) + len(network_sizes)
    n_points = len(dtypes) * (2 if gemm_sizes else 1) + len(attention_dtypes)
    n_points += n_groups * len(ops) * len(sizes) * comm_rounds if world > 1 else 0
    bar = _Progress(progress and rank == 0, n_points)
    t_start = time.perf_counter()
    try:
        matmul = device_rates(device, dtypes, matmul_sizes, budget_s=budget, on_dtype=lambda d: bar.step(f"matmul {d}"))
        rates = _rates_agreed({d: r.rate for d, r in matmul.items()}, device)
        gemm = {}
        for d in sorted(matmul) if gemm_sizes else ():  # each point's rate, the minimum over ranks
            grid = gemm_grid(device, d, gemm_sizes, budget_s=120 * budget)
            measured = grid.by_layout
            agreed = _rates_agreed(
                {f"{name}{i}": r for name, rates in measured.items() for i, r in enumerate(rates)}, device
            )
            gemm[d] = GemmGrid.of(
                grid.sizes,
                {name: [agreed[f"{name}{i}"] for i in range(len(rates))] for name, rates in measured.items()},
            )
            bar.step(f"GEMM grid {d}")
        tables = {}
        for d in attention_dtypes:  # each point's time, the maximum over ranks
            table = attention_table(device, d, *attention_grid, budget_s=60 * budget)
            agreed = _rates_agreed(
                {
                    f"{v}{j}{i}": 1.0 / t
                    for v, pair in table.times
                    for j, ts in enumerate(pair)
                    for i, t in enumerate(ts)
                },
                device,
            )
            slowest = {
                v: tuple([1.0 / agreed[f"{v}{j}{i}"] for i in range(len(ts))] for j, ts in enumerate(pair))
                for v, pair in table.times
            }
            tables[d] = AttentionTable.of(table.head_dims, table.seqs, table.rows, slowest)
            bar.step(f"attention {d}")
        mem_bw = _rates_agreed({"copy": memory_bandwidth(device, budget_s=budget)}, device)["copy"]
        overhead = 1.0 / _rates_agreed({"ops": 1.0 / op_overhead(device, budget_s=budget)}, device)["ops"]
        layout_bw = _rates_agreed({"layout": layout_bandwidth(device, budget_s=budget)}, device)["layout"]
        transpose_bw = _rates_agreed({"transpose": transpose_bandwidth(device, budget_s=budget)}, device)["transpose"]
        grad_copy = 1.0 / _rates_agreed({"params": 1.0 / grad_copy_overhead(device, budget_s=budget)}, device)["params"]
        adam = 1.0 / _rates_agreed({"adam": 1.0 / adam_seconds_per_byte(device, budget_s=budget)}, device)["adam"]
        overhead_graph = grad_copy_graph = 0.0
        if device.type == "cuda":
            per_op = op_overhead(device, budget_s=budget, graphed=True)
            overhead_graph = 1.0 / _rates_agreed({"ops": 1.0 / per_op}, device)["ops"]
            per_param = grad_copy_overhead(device, budget_s=budget, graphed=True)
            grad_copy_graph = 1.0 / _rates_agreed({"params": 1.0 / per_param}, device)["params"]
        reduction_bw, floor = {}, 0.0
        if device.type == "cuda":  # inductor's kernels (profile.py, "Generated kernels"); a CPU has none
            stored = [s for s in profile_mod.REDUCTION_DTYPES if _stored_as(s, dtypes, device)]
            if stored:
                measured = {s: reduction_bandwidth(device, s, budget_s=budget) for s in stored}
                reduction_bw = _rates_agreed(measured, device)
            floor = 1.0 / _rates_agreed({"kernel": 1.0 / kernel_floor(device, budget_s=budget)}, device)["kernel"]
        curves, net_curves = [], []
        if world > 1:
            curves = profile_collectives(
                device,
                sizes,
                ops,
                group_sizes,
                budget_s=budget,
                rounds=comm_rounds,
                on_point=lambda op, g, s: bar.step(f"{op} x{g} {_fmt_bytes(s)}"),
                groups=(lambda g: node_groups(world, per_node, g)) if per_node else None,
                pair_group=per_node or None,
            )
        if network_sizes:
            net_curves = profile_collectives(
                device,
                sizes,
                ops,
                network_sizes,
                budget_s=budget,
                rounds=comm_rounds,
                on_point=lambda op, g, s: bar.step(f"{op} x{g} across nodes {_fmt_bytes(s)}"),
                groups=lambda g: network_groups(world, per_node, g),
                pair_group=nnodes,
            )
    finally:
        bar.close()
    # the slowest rank's time, so that every rank records the same notes (and returns the same profile)
    elapsed = 1.0 / _rates_agreed({"t": 1.0 / max(time.perf_counter() - t_start, 1e-9)}, device)["t"]

    notes = [
        f"matmul sizes {list(matmul_sizes)}"
        + (f"; GEMM grid {list(gemm_sizes)}^3" if gemm else "")
        + (
            f"; attention {', '.join(tables)} at head dims x seqs x rows {list(map(list, attention_grid))}"
            if tables
            else ""
        )
        + f"; copy bandwidth {mem_bw / 1e9:.1f} GB/s "
        f"(layout-changing copy {layout_bw / 1e9:.1f} GB/s); op overhead {overhead * 1e6:.1f} us"
        + (f" ({overhead_graph * 1e6:.2f} us in a CUDA graph)" if overhead_graph else "")
        + f"; fused Adam {adam * 1e12:.1f} ps per parameter byte"
        + f"; gradient bucket copies {grad_copy * 1e6:.2f} us per parameter"
        + (f" ({grad_copy_graph * 1e6:.2f} us in a CUDA graph)" if grad_copy_graph else "")
    ]
    flops = dict(base.flops) if base is not None else {}
    flops.update(rates)
    # each size's rate, the minimum over ranks as for the peak (every rank keeps the same curve)
    per_size = {}
    for d, r in sorted(matmul.items()):
        if len(r.per_size) > 1 and d in rates:
            agreed = _rates_agreed({str(n): v for n, v in r.per_size.items()}, device)
            per_size[d] = {int(n): v for n, v in agreed.items()}
    missing = [d for d in profile_mod.DTYPES if d not in flops]
    if missing:
        fallback = rates.get("fp32") or max(rates.values())
        for d in missing:
            flops[d] = fallback
        notes.append(f"{', '.join(missing)}: not measured (unsupported or not requested), fp32 rate used")
    network = None
    if curves:
        collectives, concurrency = comm_tables(curves), _concurrency(curves)
        notes.append(
            f"collectives measured at {len(sizes)} sizes {sizes[0]}..{sizes[-1]} B on group sizes "
            f"{group_sizes}"
            + (
                f" inside a node of {per_node} ranks and {network_sizes} across {nnodes} nodes (one rank per node)"
                if per_node
                else (f" across {world} nodes of one rank (one level)" if gpus_per_node == 1 else "")
            )
            + (f", median of {comm_rounds} passes" if comm_rounds > 1 else "")
            + "; algbw is net of alpha"
        )
        if net_curves:
            network = profile_mod.NetworkTables(comm_tables(net_curves), _concurrency(net_curves))
    else:
        collectives = {c: dict(t) for c, t in base.collectives.items()}
        concurrency = {c: dict(t) for c, t in base.concurrency.items()}
        network, per_node = base.network, base.gpus_per_node
        notes.append(
            f"collectives taken from profile {base.name!r}" + (" (both levels)" if network is not None else "")
        )
    gpu = _device_name(device)
    if name is None:
        short = gpu.split("(")[0].replace("NVIDIA ", "").strip().lower().replace(" ", "-")
        name = f"{short}x{world}-measured"
    prof = profile_mod.Profile(
        name=name,
        flops=flops,
        collectives=collectives,
        ops=dict(base.ops) if base is not None else {},
        host=socket.gethostname(),
        gpu=gpu,
        world_sizes=[world] if world > 1 else list(base.world_sizes),
        date=datetime.date.today().isoformat(),
        source="measured",
        memory_bandwidth=mem_bw,
        op_overhead=overhead,
        op_overhead_graph=overhead_graph,
        concurrency=concurrency,
        layout_bandwidth=layout_bw,
        transpose_bandwidth=transpose_bw,
        grad_copy_overhead=grad_copy,
        grad_copy_overhead_graph=grad_copy_graph,
        gpus_per_node=per_node,
        network=network,
        matmul_sizes=per_size,
        gemm=gemm,
        attention=tables or (dict(base.attention) if base is not None else {}),
        reduction_bandwidth=reduction_bw,
        kernel_floor_graph=floor,
        notes=f"measured with torch {torch.__version__} in {elapsed:.0f} s; " + "; ".join(notes),
    )
    prof.optimizer_s_per_byte = adam
    if base is not None and base.ops:  # the merged per-op times keep how they were timed and calibrated
        prof.ops_timing = base.ops_timing
        prof.notes += f"; per-op times from profile {base.name!r}"
        if not curves:  # the same network: its corrections inside the distributed program hold too
            prof.corrections = base.corrections
            if not base.corrections.identity:
                prof.notes += " (and its corrections inside the distributed program)"
    prof = profile_mod.Profile.from_dict(prof.to_dict(), where=f"measured profile {name!r}")  # validate
    raw = {
        "name": name,
        "world": world,
        "device": gpu,
        "elapsed_s": elapsed,
        "copy_bandwidth": mem_bw,
        "layout_bandwidth": layout_bw,
        "transpose_bandwidth": transpose_bw,
        "grad_copy_overhead": grad_copy,
        "grad_copy_overhead_graph": grad_copy_graph,
        "op_overhead": overhead,
        "op_overhead_graph": overhead_graph,
        "reduction_bandwidth": reduction_bw,
        "kernel_floor_graph": floor,
        "matmul": {d: r.to_dict() for d, r in matmul.items()},
        "collectives": [c.to_dict() for c in curves],
    }
    if per_node and curves:
        raw["gpus_per_node"] = per_node
        raw["network_collectives"] = [c.to_dict() for c in net_curves]
    return prof, raw


def _gpus_per_node(world: int, gpus_per_node: int | None) -> int:
    """The node size whose two levels are measured: 0 for one level (not given, one node, or one
    rank per node, where every group crosses nodes); a divisor of ``world`` otherwise."""
    if gpus_per_node is None or gpus_per_node == world or world == 1:
        return 0
    if gpus_per_node < 1 or world % gpus_per_node:
        raise ValueError(
            f"gpus_per_node={gpus_per_node}: the {world} ranks do not split into nodes of that size; "
            f"give a divisor of {world} (the ranks of one node)"
        )
    return 0 if gpus_per_node == 1 else gpus_per_node


def _concurrency(curves) -> dict[str, dict[int, tuple[list[float], list[float]]]]:
    """Profile concurrency tables (collective -> group size -> (sizes, speedup)) of the curves that
    timed pairs."""
    out: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for c in curves:
        if c.pair_seconds:
            out.setdefault(c.op, {})[c.group_size] = ([float(x) for x in c.sizes], c.pair_speedup)
    return out


# ================================================================================ command line

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


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``exp/profiler.py`` / ``hidup profile`` (launch flags included)."""
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
    add_launch_args(p)


def _rank_main(ctx, kwargs: dict):
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.layout.cpn)))
    out = kwargs.pop("out")
    ops_model = kwargs.pop("ops_model")
    calibrate = kwargs.pop("calibrate_plans", None)
    per_node = kwargs.pop("gpus_per_node", None)
    if per_node is None and ctx.layout.nnodes > 1:
        per_node = ctx.layout.cpn
    prof, raw = _measure(ctx.world_size, device=ctx.device, gpus_per_node=per_node, **kwargs)
    names, overrides, seconds, precisions, worlds = ops_model or ((), {}, 0.0, (), None)
    calibrated, plan_overrides, plan_precisions, held_out = calibrate or ((), {}, (), ())
    prof = _calibrate(
        prof,
        raw,
        ctx.device,
        [(n, overrides) for n in names],
        worlds,
        precisions,
        seconds,
        [(n, plan_overrides) for n in calibrated],
        plan_precisions,
        [(n, plan_overrides) for n in held_out],
    )
    if ctx.rank == 0 and names:
        print(
            f"{len(prof.ops)} op shapes of {', '.join(names)} "
            f"(world {', '.join(map(str, worlds or [ctx.world_size]))}, {', '.join(precisions)})"
        )
    if ctx.rank == 0 and calibrated:
        print(f"inside the distributed program ({', '.join(plan_precisions)}): {prof.corrections.describe()}")
    if ctx.rank != 0:
        return None
    return str(write_profile(prof, raw, out or Path(f"profile_{prof.name}.json")))


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


def run_profile(args: argparse.Namespace) -> int:
    """Launch the ranks per ``args`` (NODERANK/CPN, torchrun or one process) and profile."""
    precisions = tuple(p.strip() for p in args.ops_precisions.split(",") if p.strip())
    if args.comm_rounds < 1:
        raise SystemExit(f"--comm-rounds {args.comm_rounds}: give at least one pass (1 measures the tables once)")
    kwargs = dict(
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
        group_sizes=None,
        comm_rounds=args.comm_rounds,
        ops_model=(
            _names(args.ops_model, "--ops-model"),
            parse_overrides(args.ops_overrides),
            args.ops_seconds,
            precisions,
            [int(w) for w in _names(args.ops_worlds, "--ops-worlds")] if args.ops_worlds else None,
        )
        if args.ops_model
        else None,
        calibrate_plans=(
            _names(args.calibrate_plans, "--calibrate-plans"),
            parse_overrides(args.ops_overrides),
            precisions,
            _names(args.held_out_plans, "--held-out-plans") if args.held_out_plans else [],
        )
        if args.calibrate_plans
        else None,
    )
    if args.held_out_plans and not args.calibrate_plans:
        raise SystemExit("--held-out-plans checks the factors --calibrate-plans fits: give --calibrate-plans too")
    if args.calibrate_plans and set(kwargs["calibrate_plans"][0]) & set(kwargs["calibrate_plans"][3]):
        both = sorted(set(kwargs["calibrate_plans"][0]) & set(kwargs["calibrate_plans"][3]))
        raise SystemExit(
            f"--held-out-plans {', '.join(both)}: also in --calibrate-plans; a held-out model must be "
            "one the factors are not fitted on"
        )
    lk = launch_kwargs(args)
    layout = layout_from_env(nnodes=lk["nnodes"], cpn=lk["cpn"], node_rank=lk["node_rank"])
    single = layout.source == "single"
    kwargs["gpus_per_node"] = _check_gpus_per_node(args.gpus_per_node, layout)
    if single and args.calibrate_plans:
        raise SystemExit(
            "--calibrate-plans times plans on the ranks: launch >= 2 (CPN=<GPUs> NODERANK=0, or "
            "torchrun), or leave it out"
        )
    if single and args.merge is None:
        return _device_only(kwargs, args.out)
    nnodes = lk.get("nnodes") or int(os.environ.get("NNODES", "1") or 1)
    if lk.get("master_port") is None and not os.environ.get("MASTER_PORT") and nnodes == 1:
        lk["master_port"] = 0  # one host: the launcher's store on a free port, no clash with other jobs
    out = args.out.resolve() if args.out is not None else None
    results = launch(_rank_main, dict(kwargs, out=out), **lk)
    path = next((r for r in results if r is not None), None)
    if path is None:
        return 0  # another host holds global rank 0 and writes the file

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
    return 0


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


def _device_only(kwargs: dict, out: Path | None) -> int:
    """One process and nothing to merge: print the device rates (a profile needs collectives)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    budget = kwargs["budget_s"] if kwargs["budget_s"] is not None else (0.1 if kwargs["quick"] else 0.3)
    rates = device_rates(device, kwargs["dtypes"], kwargs["matmul_sizes"], budget_s=budget)
    print(f"device {_device_name(device)}")
    for d, r in rates.items():
        sizes = ", ".join(f"{n}: {v / 1e12:.2f}" for n, v in r.per_size.items())
        print(f"  {d:5s} {r.rate / 1e12:9.2f} TFLOP/s   (per matmul size, TFLOP/s: {sizes})")
    print(f"  copy  {memory_bandwidth(device, budget_s=budget) / 1e9:9.1f} GB/s")
    print(
        "one process measures the device only; to write a profile, run the collectives too "
        "(CPN=<GPUs> NODERANK=0, or torchrun) or give --merge <profile> to take them from"
    )
    if out is not None:
        print(f"nothing written to {out}")
        return 2
    return 0
