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

What to measure is a :class:`ProfileOptions`.  :func:`profile_ranks` starts the ranks with
:func:`hidup.runtime.launch.launch`: ``NODERANK``/``CPN`` (one launcher per host spawning ``CPN``
ranks), torchrun's environment, or one process; :func:`device_only` prints the device's rates when one
process has no profile to merge.  The command line shared by ``exp/profiler.py`` and ``hidup profile``
(its flags, and the options they make) is :mod:`hidup.cli.profile_flags`.  ``ops_models``
(``--ops-model``) adds per-op times of zoo models (ops.py, :func:`measure_model_ops`) to the profile;
``calibrate_plans`` (``--calibrate-plans``) last times searched plans on the ranks
(:func:`hidup.profiler.measure.calibrate.program_scales`).

Time bound: every (collective, size, group) point and every dtype gets about ``budget_s``
seconds (0.3 s, 0.1 s with ``quick``; whole-world points twice, for the pairs), so a 4-GPU host
(17 sizes x 4 collectives x 2 group sizes) takes one to two minutes; several nodes measure both
levels, up to twice as long.  ``comm_rounds`` (``--comm-rounds``)
measures the collective tables that many times over and keeps each point's median, for a network
whose speed drifts over seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from hidup.codegen.timing import max_over_ranks
from hidup.files import atomic_write
from hidup.optionset import OptionSet
from hidup.profiler import profile as profile_mod
from hidup.profiler.attention import AttentionTable
from hidup.profiler.gemm import GemmGrid
from hidup.profiler.measure.calibrate import measure_model_ops, program_scales
from hidup.profiler.measure.comm import (
    CommOptions,
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
    host_adam_seconds_per_byte,
    host_copy_bandwidth,
    kernel_floor,
    layout_bandwidth,
    memory_bandwidth,
    op_overhead,
    reduction_bandwidth,
    torch_dtype,
    transpose_bandwidth,
)
from hidup.profiler.profile import DTYPES, CommTable, Profile, save
from hidup.runtime.launch import LaunchOptions, launch

__all__ = [
    "ProfileOptions",
    "profile_machine",
    "profile_ranks",
    "device_only",
    "measure_model_ops",
    "write_profile",
    "comm_tables",
]


@dataclass(frozen=True)
class ProfileOptions(OptionSet):
    """What :func:`profile_machine` measures (it takes them as keywords too; the command line's flags
    make one: :mod:`hidup.cli.profile_flags`).

    ``sizes`` the collective sizes in logical bytes (None: 4 KiB .. 256 MiB on a GPU, fewer with
    ``quick``: :func:`hidup.profiler.measure.comm.default_comm_sizes`); ``dtypes`` the compute dtypes
    timed; ``progress`` a progress bar on rank 0; ``name`` the profile's (None:
    ``<gpu>x<world>-measured``); ``quick`` fewer sizes and shorter timing; ``merge`` a profile (builtin
    name, path or Profile) supplying what is not measured; ``matmul_sizes`` the square matmul sizes and
    ``gemm_sizes`` those of the GEMM grid (None: the device's defaults, a grid on a GPU only; ``()``:
    no grid); ``attention`` False leaves out the attention table (None: measured on a GPU; True: a GPU
    is required); ``group_sizes`` the (node level's) group sizes (None: the world, or the node, and
    pairs); ``budget_s`` seconds of timing per point (None: :meth:`budget`).  ``comm_rounds``,
    ``gpus_per_node``, ``ops_models``, ``ops_worlds``, ``ops_precisions``, ``ops_seconds``,
    ``calibrate_plans``, ``calibrate_precisions`` and ``held_out_plans``: :func:`profile_machine`."""

    sizes: list[int] | None = None
    dtypes: tuple[str, ...] = DTYPES
    progress: bool = True
    name: str | None = None
    quick: bool = False
    merge: str | Path | Profile | None = None
    matmul_sizes: tuple[int, ...] | None = None
    gemm_sizes: tuple[int, ...] | None = None
    attention: bool | None = None
    group_sizes: list[int] | None = None
    budget_s: float | None = None
    comm_rounds: int = 1
    gpus_per_node: int | None = None
    ops_models: list[tuple[str, dict]] | None = None
    ops_worlds: list[int] | None = None
    ops_precisions: tuple[str, ...] = ("fp32",)
    ops_seconds: float = 120.0
    calibrate_plans: list[tuple[str, dict]] | None = None
    calibrate_precisions: tuple[str, ...] | None = None
    held_out_plans: list[tuple[str, dict]] | None = None
    WHAT = "profile_machine"

    def budget(self) -> float:
        """Seconds of timing per point: ``budget_s``, else 0.3 (0.1 with ``quick``)."""
        return self.budget_s if self.budget_s is not None else (0.1 if self.quick else 0.3)


def _rates_agreed(rates: dict[str, float], device: torch.device) -> dict[str, float]:
    """Minimum over ranks of each rate (the slowest device bounds a synchronous step): minus the
    maximum of the negated rates, which is exact."""
    keys = sorted(rates)
    return dict(zip(keys, (-r for r in max_over_ranks([-rates[k] for k in keys], None, device))))


def _stored_as(storage: str, dtypes: tuple[str, ...], device: torch.device) -> bool:
    """Whether a compute dtype of ``dtypes`` stores its tensors as ``storage`` on ``device`` (float32 for
    ``fp32`` and ``tf32``): the attention tables measured for those dtypes."""
    return dtype_supported(device, storage) and any(torch_dtype(d) == torch_dtype(storage) for d in dtypes)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
    options: ProfileOptions | None = None,
    *,
    device: torch.device | str | None = None,
    out: str | Path | None = None,
    **changes,
) -> "Profile":
    """Measure this machine as ``options`` (:class:`ProfileOptions`) updated by the keyword ``changes``
    say (``profile_machine(world, quick=True, merge="h200x4-nvlink")``) and return a
    :class:`hidup.profiler.profile.Profile` (same on every rank).

    Inside an initialized process group of ``world`` ranks (every rank calls this): device FLOP
    rates per dtype (min over ranks) and the four collectives at ``sizes`` (logical bytes) on the
    whole world and on pairs.  With ``world == 1`` only the device is measured and the collective
    tables come from ``merge`` (a builtin profile name, a path, or a ``Profile``).  ``merge`` also
    contributes per-op times and any dtype not measured.  Rank 0 writes ``out`` (the profile JSON)
    and ``<out>.raw.json`` (the raw measurements, including the nccl-tests ``algbw = S / t``).
    ``ops_models`` ((zoo name, overrides) pairs) adds their per-op times for each world size of
    ``ops_worlds`` (default: this group's) in each of ``ops_precisions``, ``ops_seconds`` at most for
    each (:func:`measure_model_ops`).
    ``calibrate_plans`` ((zoo name, overrides) pairs) last times their searched plans on the ranks in
    each of ``calibrate_precisions`` (default ``ops_precisions``) and stores the compute factors
    inside the distributed program fitted on them, checked on the plans of ``held_out_plans``
    (:func:`hidup.profiler.measure.calibrate.program_scales`; both lists recorded in the corrections).
    ``comm_rounds`` measures the collective tables that many times and keeps each point's median
    (:func:`hidup.profiler.measure.comm.profile_collectives`).  ``gpus_per_node`` (``K``, a divisor of
    ``world`` below it) measures two levels, blocks of ``K`` consecutive ranks being nodes (module
    docstring); ``group_sizes`` are then the node level's.
    """
    opts = ProfileOptions.of(options, **changes)
    prof, raw = _measure(world, device, opts)
    prof = _calibrate(prof, raw, _default_device() if device is None else torch.device(device), opts)
    if out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        write_profile(prof, raw, out)
    return prof


def _calibrate(prof, raw: dict, device: torch.device, options: ProfileOptions):
    """``prof`` with the models' per-op times and their single-device checks
    (:func:`measure_model_ops`, when ``options.ops_models``), then the corrections inside the
    distributed program fitted on ``options.calibrate_plans`` and checked on ``options.held_out_plans``
    (:func:`program_scales`); ``raw`` records how long each took."""
    if options.ops_models:
        t0 = time.perf_counter()
        group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        worlds = list(options.ops_worlds or [group])
        precisions = tuple(options.ops_precisions)
        prof = measure_model_ops(prof, options.ops_models, worlds, device, precisions, options.ops_seconds)
        raw["ops_s"] = time.perf_counter() - t0
    if options.calibrate_plans:
        t0 = time.perf_counter()
        precisions = tuple(options.calibrate_precisions or options.ops_precisions)
        held_out = options.held_out_plans or []
        prof = program_scales(prof, options.calibrate_plans, precisions, device, held_out=held_out)
        raw["calibrate_plans_s"] = time.perf_counter() - t0
    return prof


def write_profile(prof, raw: dict, out: str | Path) -> Path:
    """Write the profile JSON to ``out`` and the raw measurements to ``<out stem>.raw.json``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(prof, out)
    atomic_write(out.with_name(out.stem + ".raw.json"), json.dumps(raw, indent=1) + "\n")
    return out


def _measure(world: int | None, device, options: ProfileOptions) -> tuple[Profile, dict]:
    """The measurements of :func:`profile_machine`: ``(profile, raw dict)``."""
    return _Measurement(world, device, options).run()


@dataclass(frozen=True)
class _Figures:
    """The device's figures besides its FLOP rates, each agreed over the ranks (named as in the raw
    record; ``adam`` is the profile's ``optimizer_s_per_byte``)."""

    copy_bandwidth: float
    layout_bandwidth: float
    transpose_bandwidth: float
    grad_copy_overhead: float
    grad_copy_overhead_graph: float
    op_overhead: float
    op_overhead_graph: float
    reduction_bandwidth: dict
    kernel_floor_graph: float
    adam: float
    host_bandwidth: float  # pinned host-device copies (0 off a GPU: not measured)
    host_adam: float  # the profile's host_optimizer_s_per_byte


class _Measurement:
    """One :func:`profile_machine` measurement on this rank.  ``__init__`` resolves what to measure
    from the options, the device and the process group; :meth:`run` takes the steps in the order
    every rank takes them (each agreement over the ranks is a collective) and builds the profile."""

    def __init__(self, world: int | None, device, options: ProfileOptions):
        initialized = dist.is_available() and dist.is_initialized()
        pg_world = dist.get_world_size() if initialized else 1
        world = pg_world if world is None else world
        if world != pg_world:
            raise ValueError(
                f"profile_machine(world={world}) but the process group has {pg_world} ranks; "
                f"initialize torch.distributed with world_size={world} (or pass world=None)"
            )
        self.world, self.rank, self.options = world, dist.get_rank() if initialized else 0, options
        self.device = _default_device() if device is None else torch.device(device)
        self.base = profile_mod.load(options.merge) if options.merge is not None else None
        if world == 1 and self.base is None:
            raise ValueError(
                "a single process can only measure the device; give merge=<profile name or path> "
                "to take the collective tables from, or run on >= 2 ranks (NODERANK/CPN or torchrun)"
            )
        self._resolve_device_points()
        self._resolve_groups()

    def _resolve_device_points(self) -> None:
        o, device = self.options, self.device
        self.dtypes = tuple(dict.fromkeys(canonical_dtype(d) for d in o.dtypes))
        self.sizes = sorted(set(o.sizes or default_comm_sizes(device, o.quick)))
        self.matmul_sizes = tuple(o.matmul_sizes or default_matmul_sizes(device))
        self.gemm_sizes = o.gemm_sizes
        if self.gemm_sizes is None:  # a GPU's grid by default; a CPU's only when asked (its profile prices no GPU)
            self.gemm_sizes = default_gemm_sizes(device) if device.type == "cuda" else ()
        # the attention table per storage dtype (float32 serves tf32), on a GPU unless turned off
        self.attention_grid = default_attention_grid(device) if o.attention is not False else ((), (), ())
        if o.attention and not self.attention_grid[0]:
            raise ValueError(f"the attention table is measured on a GPU only; {device} has none (turn it off)")
        self.attention_dtypes = [
            s for s in profile_mod.ATTENTION_DTYPES if self.attention_grid[0] and _stored_as(s, self.dtypes, device)
        ]

    def _resolve_groups(self) -> None:
        self.per_node = _gpus_per_node(self.world, self.options.gpus_per_node)
        self.nnodes = self.world // self.per_node if self.per_node else 1
        given = self.options.group_sizes
        self.group_sizes = default_group_sizes(self.per_node or self.world) if given is None else list(given)
        self.network_sizes = default_group_sizes(self.nnodes) if self.per_node else []
        self.budget = self.options.budget()

    def _points(self) -> int:
        """The progress bar's steps."""
        n = len(self.dtypes) * (2 if self.gemm_sizes else 1) + len(self.attention_dtypes)
        n_groups = len(self.group_sizes) + len(self.network_sizes)
        n_comm = n_groups * len(profile_mod.COLLECTIVES) * len(self.sizes) * self.options.comm_rounds
        return n + (n_comm if self.world > 1 else 0)

    def _agreed(self, rates: dict[str, float]) -> dict[str, float]:
        return _rates_agreed(rates, self.device)

    def _fastest(self, key: str, rate: float) -> float:
        """A rate, the minimum over the ranks."""
        return self._agreed({key: rate})[key]

    def _slowest(self, key: str, seconds: float) -> float:
        """A time, the maximum over the ranks."""
        return 1.0 / self._agreed({key: 1.0 / seconds})[key]

    def run(self) -> tuple[Profile, dict]:
        """Measure, then ``(profile, raw record)``."""
        bar = _Progress(self.options.progress and self.rank == 0, self._points())
        t_start = time.perf_counter()
        try:
            self._matmuls(bar)
            self._gemm_grids(bar)
            self._attention_tables(bar)
            self.figures = self._device_figures()
            self._collectives(bar)
        finally:
            bar.close()
        # the slowest rank's time, so that every rank records the same notes (and returns the same profile)
        self.elapsed = self._slowest("t", max(time.perf_counter() - t_start, 1e-9))
        prof = self._profile()
        return prof, self._raw()

    def _matmuls(self, bar: _Progress) -> None:
        self.matmul = device_rates(
            self.device,
            self.dtypes,
            self.matmul_sizes,
            budget_s=self.budget,
            on_dtype=lambda d: bar.step(f"matmul {d}"),
        )
        self.rates = self._agreed({d: r.rate for d, r in self.matmul.items()})

    def _gemm_grids(self, bar: _Progress) -> None:
        self.gemm = {}
        for d in sorted(self.matmul) if self.gemm_sizes else ():  # each point's rate, the minimum over ranks
            grid = gemm_grid(self.device, d, self.gemm_sizes, budget_s=120 * self.budget)
            measured = grid.by_layout
            agreed = self._agreed({f"{name}{i}": r for name, rates in measured.items() for i, r in enumerate(rates)})
            self.gemm[d] = GemmGrid.of(
                grid.sizes,
                {name: [agreed[f"{name}{i}"] for i in range(len(rates))] for name, rates in measured.items()},
            )
            bar.step(f"GEMM grid {d}")

    def _attention_tables(self, bar: _Progress) -> None:
        self.attention = {}
        for d in self.attention_dtypes:  # each point's time, the maximum over ranks
            table = attention_table(self.device, d, *self.attention_grid, budget_s=60 * self.budget)
            agreed = self._agreed(
                {
                    f"{v}{j}{i}": 1.0 / t
                    for v, pair in table.times
                    for j, ts in enumerate(pair)
                    for i, t in enumerate(ts)
                }
            )
            slowest = {
                v: tuple([1.0 / agreed[f"{v}{j}{i}"] for i in range(len(ts))] for j, ts in enumerate(pair))
                for v, pair in table.times
            }
            self.attention[d] = AttentionTable.of(table.head_dims, table.seqs, table.rows, slowest)
            bar.step(f"attention {d}")

    def _device_figures(self) -> _Figures:
        device, budget = self.device, self.budget
        mem_bw = self._fastest("copy", memory_bandwidth(device, budget_s=budget))
        overhead = self._slowest("ops", op_overhead(device, budget_s=budget))
        layout_bw = self._fastest("layout", layout_bandwidth(device, budget_s=budget))
        transpose_bw = self._fastest("transpose", transpose_bandwidth(device, budget_s=budget))
        grad_copy = self._slowest("params", grad_copy_overhead(device, budget_s=budget))
        adam = self._slowest("adam", adam_seconds_per_byte(device, budget_s=budget))
        host_adam = self._slowest("host_adam", host_adam_seconds_per_byte(budget_s=budget))
        host_bw = host_copy_bandwidth(device, budget_s=budget)
        host_bw = self._fastest("host_copy", host_bw) if host_bw > 0 else 0.0
        overhead_graph = grad_copy_graph = floor = 0.0
        reduction_bw = {}
        if device.type == "cuda":  # CUDA graphs, and inductor's kernels (profile.py, "Generated kernels")
            overhead_graph = self._slowest("ops", op_overhead(device, budget_s=budget, graphed=True))
            grad_copy_graph = self._slowest("params", grad_copy_overhead(device, budget_s=budget, graphed=True))
            stored = [s for s in profile_mod.REDUCTION_DTYPES if _stored_as(s, self.dtypes, device)]
            if stored:
                reduction_bw = self._agreed({s: reduction_bandwidth(device, s, budget_s=budget) for s in stored})
            floor = self._slowest("kernel", kernel_floor(device, budget_s=budget))
        return _Figures(
            copy_bandwidth=mem_bw,
            layout_bandwidth=layout_bw,
            transpose_bandwidth=transpose_bw,
            grad_copy_overhead=grad_copy,
            grad_copy_overhead_graph=grad_copy_graph,
            op_overhead=overhead,
            op_overhead_graph=overhead_graph,
            reduction_bandwidth=reduction_bw,
            kernel_floor_graph=floor,
            adam=adam,
            host_bandwidth=host_bw,
            host_adam=host_adam,
        )

    def _collectives(self, bar: _Progress) -> None:
        world, per_node = self.world, self.per_node
        sweep = CommOptions(
            sizes=self.sizes, ops=profile_mod.COLLECTIVES, budget_s=self.budget, rounds=self.options.comm_rounds
        )
        self.curves, self.net_curves = [], []
        if world > 1:
            self.curves = profile_collectives(
                self.device,
                sweep,
                group_sizes=self.group_sizes,
                on_point=lambda op, g, s: bar.step(f"{op} x{g} {_fmt_bytes(s)}"),
                groups=(lambda g: node_groups(world, per_node, g)) if per_node else None,
                pair_group=per_node or None,
            )
        if self.network_sizes:
            self.net_curves = profile_collectives(
                self.device,
                sweep,
                group_sizes=self.network_sizes,
                on_point=lambda op, g, s: bar.step(f"{op} x{g} across nodes {_fmt_bytes(s)}"),
                groups=lambda g: network_groups(world, per_node, g),
                pair_group=self.nnodes,
            )

    def _per_size(self) -> dict[str, dict[int, float]]:
        """Each matmul size's rate, the minimum over ranks as for the peak (every rank keeps the same curve)."""
        per_size = {}
        for d, r in sorted(self.matmul.items()):
            if len(r.per_size) > 1 and d in self.rates:
                agreed = self._agreed({str(n): v for n, v in r.per_size.items()})
                per_size[d] = {int(n): v for n, v in agreed.items()}
        return per_size

    def _device_note(self) -> str:
        f = self.figures
        return (
            f"matmul sizes {list(self.matmul_sizes)}"
            + (f"; GEMM grid {list(self.gemm_sizes)}^3" if self.gemm else "")
            + (
                f"; attention {', '.join(self.attention)} at head dims x seqs x rows "
                f"{list(map(list, self.attention_grid))}"
                if self.attention
                else ""
            )
            + f"; copy bandwidth {f.copy_bandwidth / 1e9:.1f} GB/s "
            f"(layout-changing copy {f.layout_bandwidth / 1e9:.1f} GB/s); op overhead {f.op_overhead * 1e6:.1f} us"
            + (f" ({f.op_overhead_graph * 1e6:.2f} us in a CUDA graph)" if f.op_overhead_graph else "")
            + f"; fused Adam {f.adam * 1e12:.1f} ps per parameter byte"
            + f"; gradient bucket copies {f.grad_copy_overhead * 1e6:.2f} us per parameter"
            + (f" ({f.grad_copy_overhead_graph * 1e6:.2f} us in a CUDA graph)" if f.grad_copy_overhead_graph else "")
        )

    def _flops(self, notes: list[str]) -> dict[str, float]:
        """The measured rates over the merged profile's; a dtype neither has gets fp32's (noted)."""
        flops = dict(self.base.flops) if self.base is not None else {}
        flops.update(self.rates)
        missing = [d for d in profile_mod.DTYPES if d not in flops]
        if missing:
            fallback = self.rates.get("fp32") or max(self.rates.values())
            for d in missing:
                flops[d] = fallback
            notes.append(f"{', '.join(missing)}: not measured (unsupported or not requested), fp32 rate used")
        return flops

    def _tables(self, notes: list[str]) -> tuple[dict, dict, object, int]:
        """(collectives, concurrency, network tables, GPUs per node): measured, or the merged profile's."""
        if not self.curves:
            base = self.base
            notes.append(
                f"collectives taken from profile {base.name!r}" + (" (both levels)" if base.network is not None else "")
            )
            collectives = {c: dict(t) for c, t in base.collectives.items()}
            concurrency = {c: dict(t) for c, t in base.concurrency.items()}
            return collectives, concurrency, base.network, base.gpus_per_node
        one_level = self.options.gpus_per_node == 1
        notes.append(
            f"collectives measured at {len(self.sizes)} sizes {self.sizes[0]}..{self.sizes[-1]} B on group sizes "
            f"{self.group_sizes}"
            + (
                f" inside a node of {self.per_node} ranks and {self.network_sizes} across {self.nnodes} nodes "
                "(one rank per node)"
                if self.per_node
                else (f" across {self.world} nodes of one rank (one level)" if one_level else "")
            )
            + (f", median of {self.options.comm_rounds} passes" if self.options.comm_rounds > 1 else "")
            + "; algbw is net of alpha"
        )
        network = None
        if self.net_curves:
            network = profile_mod.NetworkTables(comm_tables(self.net_curves), _concurrency(self.net_curves))
        return comm_tables(self.curves), _concurrency(self.curves), network, self.per_node

    def _profile(self) -> Profile:
        """The profile of the measurements (merged with ``merge``'s), validated."""
        per_size = self._per_size()
        notes = [self._device_note()]
        flops = self._flops(notes)
        collectives, concurrency, network, per_node = self._tables(notes)
        base, f = self.base, self.figures
        self.gpu = _device_name(self.device)
        self.name = self.options.name
        if self.name is None:
            short = self.gpu.split("(")[0].replace("NVIDIA ", "").strip().lower().replace(" ", "-")
            self.name = f"{short}x{self.world}-measured"
        prof = profile_mod.Profile(
            name=self.name,
            flops=flops,
            collectives=collectives,
            ops=dict(base.ops) if base is not None else {},
            host=socket.gethostname(),
            gpu=self.gpu,
            world_sizes=[self.world] if self.world > 1 else list(base.world_sizes),
            date=datetime.date.today().isoformat(),
            source="measured",
            memory_bandwidth=f.copy_bandwidth,
            op_overhead=f.op_overhead,
            op_overhead_graph=f.op_overhead_graph,
            concurrency=concurrency,
            layout_bandwidth=f.layout_bandwidth,
            transpose_bandwidth=f.transpose_bandwidth,
            grad_copy_overhead=f.grad_copy_overhead,
            grad_copy_overhead_graph=f.grad_copy_overhead_graph,
            gpus_per_node=per_node,
            network=network,
            matmul_sizes=per_size,
            gemm=self.gemm,
            attention=self.attention or (dict(base.attention) if base is not None else {}),
            reduction_bandwidth=f.reduction_bandwidth,
            kernel_floor_graph=f.kernel_floor_graph,
            notes=f"measured with torch {torch.__version__} in {self.elapsed:.0f} s; " + "; ".join(notes),
        )
        prof.optimizer_s_per_byte = f.adam
        prof.host_bandwidth, prof.host_optimizer_s_per_byte = f.host_bandwidth, f.host_adam
        self._merge_ops(prof)
        return profile_mod.Profile.from_dict(prof.to_dict(), where=f"measured profile {self.name!r}")  # validate

    def _merge_ops(self, prof: Profile) -> None:
        """The merged per-op times, which keep how they were timed and calibrated."""
        base = self.base
        if base is None or not base.ops:
            return
        prof.ops_timing = base.ops_timing
        prof.notes += f"; per-op times from profile {base.name!r}"
        if not self.curves:  # the same network: its corrections inside the distributed program hold too
            prof.corrections = base.corrections
            if not base.corrections.identity:
                prof.notes += " (and its corrections inside the distributed program)"

    def _raw(self) -> dict:
        """The raw record (``<out>.raw.json``)."""
        f = self.figures
        raw = {
            "name": self.name,
            "world": self.world,
            "device": self.gpu,
            "elapsed_s": self.elapsed,
            "copy_bandwidth": f.copy_bandwidth,
            "layout_bandwidth": f.layout_bandwidth,
            "transpose_bandwidth": f.transpose_bandwidth,
            "grad_copy_overhead": f.grad_copy_overhead,
            "grad_copy_overhead_graph": f.grad_copy_overhead_graph,
            "op_overhead": f.op_overhead,
            "op_overhead_graph": f.op_overhead_graph,
            "reduction_bandwidth": f.reduction_bandwidth,
            "kernel_floor_graph": f.kernel_floor_graph,
            "matmul": {d: r.to_dict() for d, r in self.matmul.items()},
            "collectives": [c.to_dict() for c in self.curves],
        }
        if self.per_node and self.curves:
            raw["gpus_per_node"] = self.per_node
            raw["network_collectives"] = [c.to_dict() for c in self.net_curves]
        return raw


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


# ================================================================================ ranks


def profile_ranks(options: ProfileOptions, out: Path | None, launch_options: LaunchOptions) -> str | None:
    """Start the ranks as ``launch_options`` say (:func:`hidup.runtime.launch.launch`) and profile the
    machine on them with ``options`` (:func:`profile_machine`; the launch's own nodes are measured as
    nodes unless ``options.gpus_per_node`` is given).  Global rank 0 writes ``out`` (default
    ``profile_<name>.json``); returns the path written, or None where another host holds rank 0."""
    results = launch(_rank_main, options, out, options=launch_options)
    return next((r for r in results if r is not None), None)


def _rank_main(ctx, options: ProfileOptions, out: Path | None) -> str | None:
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.layout.cpn)))
    per_node = options.gpus_per_node
    if per_node is None and ctx.layout.nnodes > 1:
        per_node = ctx.layout.cpn
    options = replace(options, gpus_per_node=per_node)
    prof, raw = _measure(ctx.world_size, ctx.device, options)
    prof = _calibrate(prof, raw, ctx.device, options)
    if ctx.rank != 0:
        return None
    names = [n for n, _ in options.ops_models or ()]
    if names:
        worlds = options.ops_worlds or [ctx.world_size]
        print(
            f"{len(prof.ops)} op shapes of {', '.join(names)} "
            f"(world {', '.join(map(str, worlds))}, {', '.join(options.ops_precisions)})"
        )
    if options.calibrate_plans:
        precisions = options.calibrate_precisions or options.ops_precisions
        print(f"inside the distributed program ({', '.join(precisions)}): {prof.corrections.describe()}")
    return str(write_profile(prof, raw, out or Path(f"profile_{prof.name}.json")))


def device_only(options: ProfileOptions, out: Path | None) -> int:
    """One process and nothing to merge: print the device's rates (a profile needs collectives) and
    return the exit status, 2 when ``out`` was asked for (nothing is written)."""
    device = _default_device()
    budget = options.budget()
    rates = device_rates(device, options.dtypes, options.matmul_sizes, budget_s=budget)
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
