"""Machine profiles: device FLOP rates, measured per-op times and collective alpha-beta tables.

A profile is a JSON document (schema version 1)::

    {"version": 1, "name": "h200x4-nvlink", "host": "...", "gpu": "...", "world_sizes": [2, 4, 8],
     "date": "2025-01-01", "source": "builtin" | "measured" | "perturbed", "notes": "...",
     "flops": {"fp32": 5.1e13, "tf32": 4.07e14, "bf16": 7.74e14, "fp16": 7.74e14},
     "ops": {"<op key>": {"forward": s, "backward": s}, ...},
     "collectives": {"all_reduce": {"4": {"alpha": 1e-5, "sizes": [bytes...], "algbw": [bytes/s...]}},
                     "all_gather": ..., "reduce_scatter": ..., "all_to_all": ...},
     "corrections": {"dist_scale": {"value": 1.09, "multiplies": "...", "provenance": {...}}, ...}}

(plus the optional physical fields below; ``corrections``: :mod:`hidup.profiler.corrections`).

Collective time
---------------
For a collective ``c`` over a group of ``n`` ranks moving a logical buffer of ``b`` bytes (the
nccl-tests convention: the whole gathered / reduced / exchanged tensor)::

    time(c, n, b) = alpha_c + b / algbw_c(b)                       (0 when n == 1 or b == 0)

``algbw_c(b)`` interpolates the measured table linearly in ``log(b)`` between measured sizes and is
clamped to the first / last entry outside the measured range.  ``alpha`` is a fixed per-call launch
latency added on top of the table.

Group sizes without a table are answered from the nearest measured group size ``m`` (ties go to the
larger one) with ring scaling: a ring collective moves ``(n-1)/n`` of the buffer per rank for
all-gather, reduce-scatter and all-to-all and ``2(n-1)/n`` for all-reduce, so at a fixed link (bus)
bandwidth ``algbw_n = algbw_m * ((m-1)/m) / ((n-1)/n)`` for all four collectives; alpha is kept.

Fitted tables (:mod:`hidup.profiler.tables`): the cost model reads collective times from
:meth:`Profile.fitted`, whose ring collectives agree with one link time per size and whose
all-to-all is checked against that link.

Two levels: node and network
----------------------------
A cluster of nodes has two links: inside a node (NVLink) and between nodes (the network).  A
profile may describe both (both fields optional; a profile without them has one level)::

     "gpus_per_node": 8,
     "network": {"collectives": {<as the top level>}, "concurrency": {<as the top level>}}

The top-level ``collectives`` and ``concurrency`` are the *node* level: groups of consecutive
ranks inside one node.  ``network`` holds the same tables measured on groups whose ranks sit on
different nodes, one rank per node (ranks ``local + k * gpus_per_node``); every node's rank of
each local index runs its group at once, as every GPU of a rail-optimized node has its own NIC.
``gpus_per_node`` (0 = unknown or one node: every group is at the node level) numbers the global
ranks ``rank = node * gpus_per_node + local``; a ``network`` section needs it.  The queries
(:meth:`Profile.table`, ``bandwidth``, ``comm_time``, ``pair_speedup``) take ``level="node"``
(the default) or ``level="network"``; the network tables follow the formulas above (nearest
group size, ring scaling), and :meth:`Profile.fitted` and :meth:`Profile.perturb` treat them as
they treat the top level.  :meth:`Profile.group_level` says which level a mesh axis uses: an axis
of ``n`` ranks with stride ``s`` (the product of the sizes of the axes after it) is at the node
level when ``gpus_per_node % (n * s) == 0`` (its ``n * s``-rank blocks never straddle a node) or
the whole world fits on one node, and at the network level otherwise: a ring with one hop across
nodes runs at the network's pace, so a group with several ranks per node is priced from the
network tables at its own size.

Memory-bound ops and launch overhead
------------------------------------
``memory_bandwidth`` (bytes/s, bytes read plus bytes written, as a device-to-device copy counts them)
and ``op_overhead`` (seconds per op: kernel launch plus the host-side dispatch of one generated op)
are optional; with them the cost model prices an unmeasured op as a roofline plus a fixed cost:
``overhead + max(flops / rate, bytes / memory_bandwidth)``.  Without them (0) it uses FLOPs alone.
``matmul_sizes`` (optional) keeps the rate of each measured square matmul size per dtype,
``{dtype: {n: FLOP/s}}``: a small matmul fills the device less, so :meth:`Profile.rate_at` prices an
op of ``F`` FLOPs at the rate of the square matmul with as many, of size ``n = (F / 2)^(1/3)``,
interpolated linearly in ``(log n, log rate)`` between measured sizes (the smallest's rate below
them, the peak above them); without it every op runs at ``flops[dtype]``.  ``gemm`` (optional) keeps,
per dtype, the rates of a grid of ``(m, n, k)`` GEMMs (:class:`hidup.profiler.gemm.GemmGrid`): the cost
model prices a matmul by its shape where the grid has its dtype.  ``attention`` (optional) keeps, per
storage dtype (``fp32``, ``bf16``, ``fp16``), measured times of attention by variant, head dim,
sequence length and rows (:class:`hidup.profiler.attention.AttentionTable`): the cost model prices
an attention from them where the table has its dtype and variant.
``op_overhead_graph`` is the fixed cost per op when the step runs as one captured CUDA graph (no
host dispatch: the GPU's gap between kernels); :meth:`Profile.launched` picks the one that applies
(0 = not measured: the eager figure is used).

Layout copies and gradient buckets
----------------------------------
Around its collectives the runtime copies memory the graph does not show: a collective on a dim
other than the first moves that dim to the front and back (``_to_front`` / ``_from_front`` in
:mod:`hidup.codegen.collectives`), an all-to-all concatenates what it received, and the gradients of
replicated parameters are packed into flat buckets and copied back (:mod:`hidup.codegen.grads`).
``layout_bandwidth`` (bytes/s, read plus written) prices the layout-changing copies (0 = not
measured: ``memory_bandwidth``); a copy that moves the *innermost* dim is a transpose, one side of
it strided element by element, so each element costs a memory sector and its time follows the
element count, not the bytes: ``transpose_bandwidth`` is such a copy's rate on float32 (0 = not
measured: ``layout_bandwidth``), and a tensor of ``s``-byte elements copies at ``s / 4`` of it;
``grad_copy_overhead`` is the fixed cost per parameter of the bucket copies, eagerly, and
``grad_copy_overhead_graph`` inside a CUDA graph (0 = not measured: two op overheads, one kernel
each way); their bytes are priced at ``memory_bandwidth``.

Generated kernels
-----------------
A compiled program's generated kernels mostly stream at ``memory_bandwidth``, with two exceptions
the cost model prices from their own measurements (:mod:`hidup.search.cost`, "Compiled programs"):
the sum of a gradient over its rows (a bias's or a norm weight's), which inductor runs as a looped
reduction over row blocks and then a small kernel adding the blocks' partial sums --
``reduction_bandwidth`` maps a storage dtype (``fp32``, ``bf16``, ``fp16``) to the first kernel's
rate in bytes read per second (it runs below the copy bandwidth, and in bf16 about as long as in
fp32: its time follows the elements) -- and the time of a small generated kernel inside a CUDA
graph, ``kernel_floor_graph`` (seconds; the second kernel of such a sum, a few microseconds against
``op_overhead_graph``'s launch).  Both are measured by compiling the sum with inductor
(:func:`hidup.profiler.measure.device.reduction_bandwidth`, :func:`hidup.profiler.measure.device.kernel_floor`); empty
or 0 = not measured, and the cost model prices the sum as one read at ``memory_bandwidth``.

Per-op times
------------
``ops`` maps :func:`op_key` ``(target, local input shapes, dtype)`` to measured forward and backward
seconds of one rank running the op at those (sharded) shapes, ``dtype`` being the precision the op
computes in (:func:`op_dtype`: ``tf32`` and ``fp32`` float32 matmuls are different keys).  The cost
model uses them in preference to the roofline.  ``ops_timing`` says how they were timed: ``"graph"``
(on GPUs: each op replayed inside a CUDA graph, so a time holds the kernels and the GPU's gaps
between them but no host dispatch; the cost model adds the dispatch cost of an eager step) or
``"eager"`` (wall time of eager calls, dispatch included; on CPUs).  The same measurement times the
optimizer step (Adam) that follows a single-device step: ``optimizer_s_per_byte`` is its time per
byte of trainable parameters, which the plan's evaluation charges on the parameters each rank keeps
(``hidup profile`` also measures it alone, torch's fused Adam over float32 parameters:
:func:`hidup.profiler.measure.device.adam_seconds_per_byte`; unmeasured: the roofline of a fused Adam step,
:meth:`Profile.optimizer_time`).

The optimizer offloaded to the host
-----------------------------------
A plan that keeps Adam's state in host memory (``plan.offload``, :mod:`hidup.codegen.offload`) copies each
stepped gradient to the host, steps there with torch's CPU Adam and copies the weights back:
:meth:`Profile.offload_time` of ``b`` bytes of stepped float32 parameters is

    offload(b) = b / host_bandwidth  +  host_optimizer_s_per_byte * b  +  b / host_bandwidth
                 (gradients to host)    (the CPU's Adam step)              (weights to device)

``host_bandwidth`` (bytes/s, one direction, per GPU) is a pinned host-device copy's rate and
``host_optimizer_s_per_byte`` the CPU Adam step's seconds per byte of parameters on the host cores one
GPU's rank gets (the node's cores and memory bandwidth are shared by its GPUs); ``hidup profile`` measures
both (:func:`hidup.profiler.measure.device.host_copy_bandwidth`,
:func:`hidup.profiler.measure.device.host_adam_seconds_per_byte`).  A document without them (0) is priced
at :data:`DEFAULT_HOST_BANDWIDTH` (25 GB/s: PCIe Gen4 x16's 32 GB/s per direction at the ~80% a pinned
copy reaches) and :data:`DEFAULT_HOST_OPTIMIZER_S_PER_BYTE` (0.5 ns per byte, 0.5 G float32
parameters per second: half of what torch's fused CPU Adam reaches on one x86 core, for a rank that
shares its node's cores and memory bandwidth with the others).

Physical terms and empirical corrections
----------------------------------------
Every field above is a measurement of one mechanism (a FLOP rate, an op at its shapes, one kernel
launch, one copy, one collective, two concurrent collectives).  ``corrections``
(:class:`hidup.profiler.corrections.Corrections`) holds what is fitted instead: factors that make
the cost model's prediction of whole programs equal their measured time (``dist_scale`` and
``dist_dup_scale``, the compute inside the ranks' program), each with the plans, models and device
it was fitted on and the held-out plans it was checked on.  A profile without them is uncalibrated:
the identity.

Two earlier factors are gone: ``ops_scale`` (a whole single-device step over the sum of its ops'
times) and ``dup_scale`` (two-stream copies over the copies priced one after the other) measured
0.955-1.045 and 0.96-1.08 over 16 (model, precision, world) pairs on H200, mean 0.996 and 1.013,
and 1 in every built-in profile.  The profiler still times both as checks and writes the ratios in
the profile's notes; a document that carries either still loads (the value is checked and dropped,
and the notes say so).

Perturbation
------------
:meth:`Profile.perturb` multiplies every FLOP rate, every per-op time and every bandwidth entry by its
own factor drawn uniformly from ``[1-x, 1+x]`` (numpy ``default_rng(seed)``, drawn in sorted key
order so a seed always gives the same profile); bandwidths are further divided by ``comm_scale`` and
alphas multiplied by it (a network ``comm_scale`` times slower).  The corrections are drawn last, one
factor each, and only for a profile with per-op times; the draws of the deleted ``ops_scale`` and
``dup_scale`` are still made and discarded, so that a seed gives every other field what it gave
before.  A profile with network tables draws their factors after all of these (the same order, the
network's concurrency last), so the draws of a one-level profile are those it always had.
"""

from __future__ import annotations

import bisect
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from hidup.errors import UserError
from hidup.files import atomic_write

from .attention import AttentionTable
from .corrections import CorrectionError, Corrections
from .fields import FieldError, number, per_dtype
from .gemm import GemmGrid
from .tables import (
    A2A_TOLERANCE,
    COLLECTIVES,
    RING_LINK,
    RING_TOLERANCE,
    CommTable,
    _ring_factor,
    concurrency_from_dict,
    fit_all_to_all,
    fit_ring_tables,
)

__all__ = [
    "Profile",
    "NetworkTables",
    "CommTable",
    "ProfileError",
    "load",
    "save",
    "builtin_names",
    "op_key",
    "op_dtype",
    "fit_ring_tables",
    "fit_all_to_all",
    "COLLECTIVES",
    "DTYPES",
    "SCHEMA_VERSION",
    "LEVELS",
    "RING_LINK",
    "RING_TOLERANCE",
    "A2A_TOLERANCE",
    "Corrections",
]

SCHEMA_VERSION = 1
DTYPES = ("fp32", "tf32", "bf16", "fp16")
ATTENTION_DTYPES = ("fp32", "bf16", "fp16")  # storage dtypes: float32 attention uses no TF32
REDUCTION_DTYPES = ("fp32", "bf16", "fp16")  # storage dtypes of reduction_bandwidth
SOURCES = ("measured", "builtin", "perturbed")
LEVELS = ("node", "network")
CLUSTER_PROFILE = "h100x64-ib400"  # the built-in profile with network tables
DEFAULTS_DIR = Path(__file__).with_name("defaults")
# the offloaded optimizer's figures of a profile that has none (module docstring, "The optimizer offloaded
# to the host"): PCIe Gen4 x16 at ~80% of its 32 GB/s per direction; 0.5 G float32 parameters/s of CPU Adam
DEFAULT_HOST_BANDWIDTH = 25e9
DEFAULT_HOST_OPTIMIZER_S_PER_BYTE = 0.5e-9


class ProfileError(UserError, ValueError):
    """A profile document is malformed; the message names the field and the fix."""


def op_dtype(torch_dtype: str, precision: str = "fp32") -> str:
    """The dtype part of an :func:`op_key`: a floating dtype as the precision it computes in (float32 ->
    ``precision``: fp32, tf32, or bf16 / fp16 under autocast; bfloat16 -> bf16; float16 -> fp16),
    anything else (integer outputs) as its torch name."""
    if torch_dtype == "float32":
        return precision
    return {"bfloat16": "bf16", "float16": "fp16"}.get(torch_dtype, torch_dtype)


def op_key(target: str, shapes: Iterable[Iterable[int]], dtype: str) -> str:
    """Key of a measured per-op time: ``linear(8x512,1024x512)tf32`` (``dtype`` from :func:`op_dtype`)."""
    dims = ",".join("x".join(str(int(d)) for d in s) for s in shapes)
    return f"{target}({dims}){dtype}"


@dataclass
class NetworkTables:
    """The network level of a profile (module docstring, "Two levels: node and network"): the
    collective tables and the concurrency of groups whose ranks sit on different nodes, one per node."""

    collectives: dict[str, dict[int, CommTable]]
    # collective -> group size -> (sizes, speedup), as Profile.concurrency
    concurrency: dict[str, dict[int, tuple[list[float], list[float]]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "collectives": _tables_to_dict(self.collectives),
            "concurrency": _concurrency_to_dict(self.concurrency),
        }

    @classmethod
    def from_dict(cls, net, gpus_per_node: int) -> "NetworkTables":
        """Build from :meth:`to_dict`'s form (a profile's ``network`` field, whose ``gpus_per_node``
        must be > 0); a :class:`~hidup.profiler.fields.FieldError` names what is wrong."""
        if not isinstance(net, dict):
            raise FieldError("network", "expected an object {collectives, concurrency}")
        extra = set(net) - {"collectives", "concurrency"}
        if extra:
            raise FieldError("network", f"unknown field(s) {sorted(extra)}; expected collectives and concurrency")
        if gpus_per_node == 0:
            raise FieldError(
                "gpus_per_node",
                "a profile with a 'network' section needs the GPUs per node (> 0), which say which groups cross nodes",
            )
        return cls(
            CommTable.tables_from_dict(net.get("collectives"), "network.collectives"),
            concurrency_from_dict(net.get("concurrency", {}), "network.concurrency"),
        )


def _tables_to_dict(collectives: dict[str, dict[int, CommTable]]) -> dict:
    return {c: {str(g): t.to_dict() for g, t in sorted(tabs.items())} for c, tabs in collectives.items()}


def _concurrency_to_dict(concurrency: dict[str, dict[int, tuple[list[float], list[float]]]]) -> dict:
    return {
        c: {str(g): {"sizes": list(sz), "speedup": list(k)} for g, (sz, k) in sorted(tabs.items())}
        for c, tabs in sorted(concurrency.items())
    }


@dataclass
class Profile:
    """A machine profile (see the module docstring for the formulas)."""

    name: str
    flops: dict[str, float]
    collectives: dict[str, dict[int, CommTable]]
    ops: dict[str, tuple[float, float]] = field(default_factory=dict)
    host: str = ""
    gpu: str = ""
    world_sizes: list[int] = field(default_factory=list)
    date: str = ""
    source: str = "measured"
    notes: str = ""
    memory_bandwidth: float = 0.0  # bytes/s (read + written); 0 = unknown, compute priced by FLOPs
    op_overhead: float = 0.0  # seconds per op (launch + host dispatch)
    op_overhead_graph: float = 0.0  # seconds per op inside a captured CUDA graph; 0 = not measured
    # collective -> group size -> (sizes, speedup): aggregate throughput of two equal collectives run
    # at once on two communicators, relative to one (1 = they serialize, 2 = no interference)
    concurrency: dict[str, dict[int, tuple[list[float], list[float]]]] = field(default_factory=dict)
    ops_timing: str = "eager"  # how `ops` were timed: "graph" (device time in a CUDA graph) or "eager"
    optimizer_s_per_byte: float = 0.0  # Adam step seconds per byte of local trainable parameters; 0 = unknown
    layout_bandwidth: float = 0.0  # bytes/s (read + written) of a layout-changing copy; 0 = memory_bandwidth
    grad_copy_overhead: float = 0.0  # seconds per parameter of the gradient bucket copies (eager); 0 = unknown
    grad_copy_overhead_graph: float = 0.0  # the same inside a CUDA graph; 0 = not measured
    # fitted factors over the physical terms above, with their provenance (hidup.profiler.corrections)
    corrections: Corrections = field(default_factory=Corrections)
    gpus_per_node: int = 0  # GPUs per node; 0 = unknown / one node: every group is at the node level
    network: NetworkTables | None = None  # tables of groups across nodes (one rank per node); None = not measured
    # dtype -> square matmul size -> FLOP/s (optional; "Memory-bound ops and launch overhead")
    matmul_sizes: dict[str, dict[int, float]] = field(default_factory=dict)
    # bytes/s (read + written) of a float32 copy that moves the innermost dim; 0 = layout_rate()
    transpose_bandwidth: float = 0.0
    # dtype -> rates of a grid of (m, n, k) GEMMs (optional; hidup.profiler.gemm)
    gemm: dict[str, GemmGrid] = field(default_factory=dict)
    # storage dtype -> measured attention times (optional; hidup.profiler.attention)
    attention: dict[str, AttentionTable] = field(default_factory=dict)
    # storage dtype -> bytes/s read by inductor's sum over rows; seconds of a small generated kernel in a
    # CUDA graph (optional; "Generated kernels")
    reduction_bandwidth: dict[str, float] = field(default_factory=dict)
    kernel_floor_graph: float = 0.0
    # the optimizer offloaded to the host ("The optimizer offloaded to the host"): bytes/s of a pinned
    # host-device copy (one direction, per GPU); CPU Adam seconds per byte of parameters, per GPU; 0 = default
    host_bandwidth: float = 0.0
    host_optimizer_s_per_byte: float = 0.0
    # how the priced program runs (set by :meth:`launched`, never stored): compiled by inductor, so that
    # pointwise chains fuse (hidup.search.cost, "Compiled programs")
    compiled: bool = False

    # ----------------------------------------------------------------------------- queries
    def rate(self, dtype: str) -> float:
        """Device FLOP/s for a profile dtype name (fp32, tf32, bf16, fp16)."""
        try:
            return self.flops[dtype]
        except KeyError:
            raise KeyError(
                f"profile {self.name!r} has no FLOP rate for {dtype!r}; it has {sorted(self.flops)}"
            ) from None

    def rate_at(self, dtype: str, flops: float) -> float:
        """FLOP/s of an op of ``flops`` FLOPs in ``dtype``: the measured square matmul of equal FLOPs
        (``matmul_sizes``, module docstring), else :meth:`rate`."""
        peak = self.rate(dtype)
        points = sorted(self.matmul_sizes.get(dtype, {}).items())
        if not points or flops <= 0:
            return peak
        n = (flops / 2.0) ** (1.0 / 3.0)
        if n <= points[0][0]:
            return points[0][1]
        for (n0, r0), (n1, r1) in zip(points, points[1:]):
            if n <= n1:
                t = math.log(n / n0) / math.log(n1 / n0)
                return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
        return peak

    def op_time(self, target: str, shapes: Iterable[Iterable[int]], dtype: str) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds of an op at local ``shapes``, or None."""
        return self.ops.get(op_key(target, shapes, dtype))

    def _level(self, level: str) -> tuple[dict, dict]:
        """(collective tables, concurrency) of ``level``: ``"node"`` (the top level) or ``"network"``."""
        if level == "node":
            return self.collectives, self.concurrency
        if level != "network":
            raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")
        if self.network is None:
            raise ProfileError(
                f"profile {self.name!r} has no network tables (its 'network' section), so it cannot price "
                "a collective across nodes; it describes one node"
                + (f" of {self.gpus_per_node} GPUs" if self.gpus_per_node else "")
                + ". Fix: measure the profile on several nodes (exp/profiler.py or `hidup profile` with "
                "NNODES/CPN or torchrun; --gpus-per-node simulates nodes on one host), or use the built-in "
                f"cluster profile {CLUSTER_PROFILE!r}"
            )
        return self.network.collectives, self.network.concurrency

    def table(self, collective: str, group: int, level: str = "node") -> tuple[CommTable, float]:
        """(table of the nearest measured group size at ``level``, bandwidth multiplier for ``group``)."""
        collectives, _ = self._level(level)
        if collective not in collectives:
            raise KeyError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
        tables = collectives[collective]
        if group in tables:
            return tables[group], 1.0
        m = min(tables, key=lambda g: (abs(g - group), -g))
        return tables[m], _ring_factor(m, group)

    def bandwidth(self, collective: str, group: int, nbytes: float, level: str = "node") -> float:
        """Algorithmic bandwidth (bytes/s) of ``collective`` over ``group`` ranks at ``nbytes``."""
        tab, factor = self.table(collective, group, level)
        net = tab.net_time(nbytes)
        return (nbytes / net if net > 0 else tab.bandwidth(nbytes)) * factor

    def comm_time(self, collective: str, group: int, nbytes: float, level: str = "node") -> float:
        """alpha + nbytes / algbw(nbytes), within the band of the measured neighbours
        (:meth:`CommTable.net_time`), from the tables of ``level`` ("node" or "network",
        :meth:`group_level`); 0 for a group of one rank or an empty buffer."""
        if level != "node":
            self._level(level)  # a profile without network tables fails here, whatever the size
        if group <= 1 or nbytes <= 0:
            return 0.0
        tab, factor = self.table(collective, group, level)
        return tab.alpha + tab.net_time(nbytes) / factor

    def pair_speedup(self, collective: str, group: int, nbytes: float, level: str = "node") -> float:
        """Aggregate speedup of two concurrent ``collective`` calls of ``nbytes`` each on two
        communicators over ``group`` ranks (see ``concurrency``; the network's at ``level="network"``);
        1.0 where not measured.  Interpolated linearly in log(size), clamped at both ends and to [1, 2]."""
        _, concurrency = self._level(level)
        table = concurrency.get(collective, {}).get(group)
        if not table or nbytes <= 0:
            return 1.0
        sizes, speed = table
        if nbytes <= sizes[0]:
            k = speed[0]
        elif nbytes >= sizes[-1]:
            k = speed[-1]
        else:
            i = bisect.bisect_right(sizes, nbytes)
            w = (math.log(nbytes) - math.log(sizes[i - 1])) / (math.log(sizes[i]) - math.log(sizes[i - 1]))
            k = speed[i - 1] * (1 - w) + speed[i] * w
        return min(2.0, max(1.0, k))

    def group_level(self, stride: int, group: int, world: int | None = None) -> str:
        """The level (``"node"`` or ``"network"``) whose tables price a collective over ``group``
        ranks ``stride`` apart in the global rank order (rank = node * gpus_per_node + local): a
        mesh axis of size ``group`` whose stride is the product of the sizes of the axes after it.

        ``"node"`` when ``gpus_per_node`` is 0 (one level), when ``group <= 1``, when the whole
        ``world`` (if given) fits on one node (``world <= gpus_per_node``), or when
        ``gpus_per_node % (stride * group) == 0``: the ``stride * group`` consecutive ranks that one
        axis and the axes after it span then never straddle a node boundary, so every group of the
        axis sits on one node.  Otherwise some group of the axis spans two nodes (for a mesh whose
        size is a multiple of ``stride * group``, which every mesh is) and the axis is
        ``"network"``: a ring that crosses the network runs at the network's pace.  So
        ``stride * (group - 1) < gpus_per_node`` is necessary but not sufficient: 2 ranks 3 apart on
        8-GPU nodes pair 6 with 9."""
        if stride < 1 or group < 1:
            raise ValueError(f"group_level: stride and group must be >= 1, got stride={stride}, group={group}")
        g = self.gpus_per_node
        if g == 0 or group == 1 or (world is not None and world <= g) or g % (stride * group) == 0:
            return "node"
        return "network"

    # ----------------------------------------------------------------------------- derived profiles
    def fitted(self, tolerance: float = RING_TOLERANCE, a2a_tolerance: float = A2A_TOLERANCE) -> "Profile":
        """A copy whose ring collective tables agree with one link time per size and whose all-to-all
        follows that link's shape (module docstring, "Fitted tables"); the cost model reads
        collective times from it."""
        p = copy.copy(self)
        p.collectives = fit_ring_tables(self.collectives, tolerance, a2a_tolerance)
        if self.network is not None:
            p.network = NetworkTables(
                fit_ring_tables(self.network.collectives, tolerance, a2a_tolerance), self.network.concurrency
            )
        return p

    def launched(self, cuda_graphs: bool, compiled: bool = False) -> "Profile":
        """The profile as seen by a step run eagerly (``cuda_graphs=False``: ``op_overhead``) or
        captured as one CUDA graph (``op_overhead_graph`` when measured, else ``op_overhead``), and
        op by op or ``compiled`` by inductor (:attr:`compiled`)."""
        graphed = cuda_graphs and (self.op_overhead_graph > 0 or self.grad_copy_overhead_graph > 0)
        if not graphed and compiled == self.compiled:
            return self
        p = copy.copy(self)
        p.compiled = compiled
        if graphed and self.op_overhead_graph > 0:
            p.op_overhead = self.op_overhead_graph
        if graphed and self.grad_copy_overhead_graph > 0:
            p.grad_copy_overhead = self.grad_copy_overhead_graph
        return p

    def optimizer_time(self, param_bytes: float) -> float:
        """Seconds of the Adam step over ``param_bytes`` bytes of local trainable parameters: the
        measured ``optimizer_s_per_byte``, else the roofline of a fused Adam step, which reads the
        parameter, its gradient and both moments and writes the parameter and both moments back
        (seven passes over ``param_bytes``) at ``memory_bandwidth``; 0 when neither is known."""
        if self.optimizer_s_per_byte > 0:
            return self.optimizer_s_per_byte * param_bytes
        return 7.0 * param_bytes / self.memory_bandwidth if self.memory_bandwidth > 0 else 0.0

    def offload_time(self, param_bytes: float) -> float:
        """Seconds of an optimizer step offloaded to the host over ``param_bytes`` bytes of stepped
        parameters (module docstring, "The optimizer offloaded to the host"): their gradients copied to
        the host, the CPU's Adam step, the weights copied back, one after the other."""
        bandwidth = self.host_bandwidth or DEFAULT_HOST_BANDWIDTH
        per_byte = self.host_optimizer_s_per_byte or DEFAULT_HOST_OPTIMIZER_S_PER_BYTE
        return param_bytes * (2.0 / bandwidth + per_byte)

    def layout_rate(self) -> float:
        """Bytes/s (read + written) of a layout-changing copy: ``layout_bandwidth``, else
        ``memory_bandwidth`` (0 when neither is known)."""
        return self.layout_bandwidth if self.layout_bandwidth > 0 else self.memory_bandwidth

    def transpose_rate(self, itemsize: float) -> float:
        """Bytes/s (read + written) of a copy that moves the innermost dim of a tensor of ``itemsize``-byte
        elements (module docstring): ``transpose_bandwidth`` per float32 element, so ``itemsize / 4`` of
        it; :meth:`layout_rate` when not measured."""
        return self.transpose_bandwidth * itemsize / 4.0 if self.transpose_bandwidth > 0 else self.layout_rate()

    def grad_copy_fixed(self) -> float:
        """Seconds per parameter of the gradient bucket copies: ``grad_copy_overhead``, else two op
        overheads (one kernel into the bucket, one out)."""
        return self.grad_copy_overhead if self.grad_copy_overhead > 0 else 2.0 * self.op_overhead

    def perturb(self, noise: float, seed: int = 0, comm_scale: float = 1.0) -> "Profile":
        """A copy with each rate, op time and bandwidth scaled by an independent U[1-noise, 1+noise]
        factor; bandwidths divided and alphas multiplied by ``comm_scale``."""
        import numpy as np

        if not 0.0 <= noise < 1.0:
            raise ValueError(f"perturb: noise must be in [0, 1), got {noise}")
        if comm_scale <= 0:
            raise ValueError(f"perturb: comm_scale must be > 0, got {comm_scale}")
        rng = np.random.default_rng(seed)

        def f() -> float:
            return float(rng.uniform(1.0 - noise, 1.0 + noise)) if noise else 1.0

        flops = {k: self.flops[k] * f() for k in sorted(self.flops)}
        ops = {}
        for k in sorted(self.ops):
            fw, bw = self.ops[k]
            ops[k] = (fw * f(), bw * f())

        def tables(collectives: dict[str, dict[int, CommTable]]) -> dict[str, dict[int, CommTable]]:
            out: dict[str, dict[int, CommTable]] = {}
            for c in sorted(collectives):
                out[c] = {}
                for g in sorted(collectives[c]):
                    t = collectives[c][g]
                    bws = [b * f() / comm_scale for b in t.algbw]
                    out[c][g] = CommTable(t.alpha * comm_scale, list(t.sizes), bws)
            return out

        def speedups(concurrency: dict, into: dict) -> None:  # measured like a bandwidth: perturbed like one
            for c in sorted(concurrency):
                for g in sorted(concurrency[c]):
                    sizes, speed = concurrency[c][g]
                    into.setdefault(c, {})[g] = (list(sizes), [min(2.0, max(1.0, k * f())) for k in speed])

        colls = tables(self.collectives)
        suffix = f"+noise{noise:g}-seed{seed}" + (f"-comm{comm_scale:g}" if comm_scale != 1.0 else "")
        out = Profile(
            self.name + suffix,
            flops,
            colls,
            ops,
            self.host,
            self.gpu,
            list(self.world_sizes),
            self.date,
            "perturbed",
            self.notes,
            self.memory_bandwidth * f(),
            self.op_overhead * f(),
            self.op_overhead_graph * f(),
            ops_timing=self.ops_timing,
        )
        if self.ops:
            f()  # the draw of the deleted ops_scale (module docstring, "Perturbation")
        out.optimizer_s_per_byte = self.optimizer_s_per_byte * f() if self.optimizer_s_per_byte else 0.0
        speedups(self.concurrency, out.concurrency)  # kept in [1, 2]
        # drawn last, so that a seed perturbs everything above as it did before these were measured
        out.layout_bandwidth = self.layout_bandwidth * f()
        out.grad_copy_overhead = self.grad_copy_overhead * f()
        out.grad_copy_overhead_graph = self.grad_copy_overhead_graph * f()
        if self.ops:
            f()  # the draw of the deleted dup_scale
        out.corrections = self.corrections.perturb(f) if self.ops else self.corrections
        out.gpus_per_node = self.gpus_per_node
        for d in sorted(self.matmul_sizes):  # one draw per dtype, as its rate: the curve keeps its shape
            k = f()
            out.matmul_sizes[d] = {n: r * k for n, r in self.matmul_sizes[d].items()}
        if self.transpose_bandwidth:  # a profile without it draws what it drew before
            out.transpose_bandwidth = self.transpose_bandwidth * f()
        for d in sorted(self.gemm):  # one draw per dtype, as for matmul_sizes
            out.gemm[d] = self.gemm[d].scaled(f())
        for d in sorted(self.attention):  # a profile without it draws what it drew before
            out.attention[d] = self.attention[d].scaled(f())
        for d in sorted(self.reduction_bandwidth):  # last, for the same reason
            out.reduction_bandwidth[d] = self.reduction_bandwidth[d] * f()
        if self.kernel_floor_graph:
            out.kernel_floor_graph = self.kernel_floor_graph * f()
        for name in ("host_bandwidth", "host_optimizer_s_per_byte"):  # only where given: older draws unchanged
            if getattr(self, name):
                setattr(out, name, getattr(self, name) * f())
        if self.network is not None:  # last: a one-node profile draws what it drew before
            out.network = NetworkTables(tables(self.network.collectives))
            speedups(self.network.concurrency, out.network.concurrency)
        return out

    def with_corrections(self, corrections: Corrections | None = None, **values: float) -> "Profile":
        """A copy with ``corrections`` (default: this profile's), the named values replaced
        (``with_corrections(dist_scale=1.1)``; provenance kept)."""
        p = copy.copy(self)
        p.corrections = (self.corrections if corrections is None else corrections).with_values(**values)
        return p

    def without_corrections(self) -> "Profile":
        """A copy with the identity corrections: the cost model's physical time."""
        return self.with_corrections(Corrections())

    def with_ops(self, ops: dict[str, tuple[float, float]]) -> "Profile":
        """A copy with extra measured per-op times (keys from :func:`op_key`)."""
        p = copy.deepcopy(self)
        p.ops.update({k: (float(a), float(b)) for k, (a, b) in ops.items()})
        return p

    # ----------------------------------------------------------------------------- (de)serialization
    def to_dict(self) -> dict:
        return {
            "version": SCHEMA_VERSION,
            "name": self.name,
            "host": self.host,
            "gpu": self.gpu,
            "world_sizes": list(self.world_sizes),
            "date": self.date,
            "source": self.source,
            "notes": self.notes,
            "flops": dict(self.flops),
            **(
                {"matmul_sizes": {d: {str(n): r for n, r in v.items()} for d, v in self.matmul_sizes.items()}}
                if self.matmul_sizes
                else {}
            ),
            **({"gemm": {d: g.to_dict() for d, g in sorted(self.gemm.items())}} if self.gemm else {}),
            **({"attention": {d: t.to_dict() for d, t in sorted(self.attention.items())}} if self.attention else {}),
            **(
                {"reduction_bandwidth": dict(sorted(self.reduction_bandwidth.items()))}
                if self.reduction_bandwidth
                else {}
            ),
            **({"kernel_floor_graph": self.kernel_floor_graph} if self.kernel_floor_graph else {}),
            **({"host_bandwidth": self.host_bandwidth} if self.host_bandwidth else {}),
            **({"host_optimizer_s_per_byte": self.host_optimizer_s_per_byte} if self.host_optimizer_s_per_byte else {}),
            "memory_bandwidth": self.memory_bandwidth,
            "op_overhead": self.op_overhead,
            "op_overhead_graph": self.op_overhead_graph,
            "ops_timing": self.ops_timing,
            "optimizer_s_per_byte": self.optimizer_s_per_byte,
            "layout_bandwidth": self.layout_bandwidth,
            "transpose_bandwidth": self.transpose_bandwidth,
            "grad_copy_overhead": self.grad_copy_overhead,
            "grad_copy_overhead_graph": self.grad_copy_overhead_graph,
            "corrections": self.corrections.to_dict(),
            "concurrency": _concurrency_to_dict(self.concurrency),
            "ops": {k: {"forward": a, "backward": b} for k, (a, b) in sorted(self.ops.items())},
            "collectives": _tables_to_dict(self.collectives),
            "gpus_per_node": self.gpus_per_node,
            **({"network": self.network.to_dict()} if self.network is not None else {}),
        }

    @staticmethod
    def from_dict(d: dict, where: str = "profile") -> "Profile":
        """Validate and build; errors name the offending field as ``<where>: field '<field>': ...``
        (each part of the document is read by its own ``from_dict``: :mod:`hidup.profiler.fields`)."""
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
        try:
            return Profile._read(d, where)
        except FieldError as e:
            raise ProfileError(f"{where}: field {e.field!r}: {e}") from None

    @staticmethod
    def _read(d: dict, where: str) -> "Profile":
        """:meth:`from_dict` of a JSON object: its fields, read and checked in this order."""
        _check_header(d)
        flops = _flops(d.get("flops"))
        matmul_sizes = _matmul_sizes(d.get("matmul_sizes", {}))
        gemm = per_dtype(d, "gemm", DTYPES, GemmGrid.from_dict, "{sizes, rates}")
        attention = per_dtype(d, "attention", ATTENTION_DTYPES, AttentionTable.from_dict, "{head_dims, seqs, ...}")
        reduction = per_dtype(d, "reduction_bandwidth", REDUCTION_DTYPES, lambda v: v, "bytes/s")
        reduction_bw = {dt: number(v, f"reduction_bandwidth.{dt}") for dt, v in reduction.items()}
        ops = _ops(d.get("ops", {}))
        collectives = CommTable.tables_from_dict(d.get("collectives"), "collectives")
        physical = {key: number(d.get(key, 0.0), key, positive=False) for key in _PHYSICAL}
        notes = _notes_of_dropped_factors(d)
        corrections = _corrections(d, where)
        ops_timing = _ops_timing(d)
        concurrency = concurrency_from_dict(d.get("concurrency", {}), "concurrency")
        gpus_per_node = _gpus_per_node(d)
        network = None if d.get("network") is None else NetworkTables.from_dict(d["network"], gpus_per_node)
        kernels = {key: number(d.get(key, 0.0), key, positive=False) for key in _PHYSICAL_LATER}
        return Profile(
            d["name"],
            flops,
            collectives,
            ops,
            host=d.get("host", ""),
            gpu=d.get("gpu", ""),
            world_sizes=list(d.get("world_sizes", [])),
            date=d.get("date", ""),
            source=d.get("source", "measured"),
            notes=notes,
            concurrency=concurrency,
            ops_timing=ops_timing,
            corrections=corrections,
            gpus_per_node=gpus_per_node,
            network=network,
            matmul_sizes=matmul_sizes,
            gemm=gemm,
            attention=attention,
            reduction_bandwidth=reduction_bw,
            **physical,
            **kernels,
        )


# the optional physical figures (0 = not measured), read in this order ...
_PHYSICAL = (
    "memory_bandwidth",
    "op_overhead",
    "op_overhead_graph",
    "optimizer_s_per_byte",
    "layout_bandwidth",
    "grad_copy_overhead",
    "grad_copy_overhead_graph",
)
# ... and these after the tables (the order decides which error a document with several gets)
_PHYSICAL_LATER = ("transpose_bandwidth", "kernel_floor_graph", "host_bandwidth", "host_optimizer_s_per_byte")


def _check_header(d: dict) -> None:
    """The document's version, name, source, descriptive strings and world sizes."""
    version = d.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise FieldError("version", f"this hidup reads profile schema {SCHEMA_VERSION}, got {version!r}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError("name", "a non-empty string is required")
    source = d.get("source", "measured")
    if source not in SOURCES:
        raise FieldError("source", f"expected one of {SOURCES}, got {source!r}")
    for key in ("host", "gpu", "date", "notes"):
        if not isinstance(d.get(key, ""), str):
            raise FieldError(key, f"expected a string, got {d[key]!r}")
    ws = d.get("world_sizes", [])
    if not isinstance(ws, list) or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in ws):
        raise FieldError("world_sizes", f"expected a list of positive integers, got {ws!r}")


def _flops(fl) -> dict[str, float]:
    """The ``flops`` field: a FLOP rate for every dtype of :data:`DTYPES`, and no other."""
    if not isinstance(fl, dict):
        raise FieldError("flops", "a mapping {fp32, tf32, bf16, fp16} -> FLOP/s is required")
    flops = {}
    for dt in DTYPES:
        if dt not in fl:
            raise FieldError(
                f"flops.{dt}",
                "missing; give the device FLOP/s for this dtype (use the fp32 value if the device has no faster mode)",
            )
        flops[dt] = number(fl[dt], f"flops.{dt}")
    extra = set(fl) - set(DTYPES)
    if extra:
        raise FieldError("flops", f"unknown dtype(s) {sorted(extra)}; expected {DTYPES}")
    return flops


def _matmul_sizes(sizes_in) -> dict[str, dict[int, float]]:
    """The ``matmul_sizes`` field: dtype -> square matmul size -> FLOP/s."""
    if not isinstance(sizes_in, dict) or set(sizes_in) - set(DTYPES):
        raise FieldError("matmul_sizes", f"expected a mapping {{dtype of {DTYPES}: {{size: FLOP/s}}}}")
    matmul_sizes = {}
    for dt, per in sizes_in.items():
        if not isinstance(per, dict):
            raise FieldError(f"matmul_sizes.{dt}", "expected a mapping size -> FLOP/s")
        if not all(str(n).isdigit() and int(n) > 0 for n in per):
            raise FieldError(f"matmul_sizes.{dt}", f"sizes must be positive integers, got {sorted(per)}")
        matmul_sizes[dt] = {int(n): number(r, f"matmul_sizes.{dt}.{n}") for n, r in per.items()}
    return matmul_sizes


def _ops(ops_in) -> dict[str, tuple[float, float]]:
    """The ``ops`` field: op key -> (forward, backward) seconds."""
    if not isinstance(ops_in, dict):
        raise FieldError("ops", "expected a mapping op key -> {forward, backward}")
    ops = {}
    for k, v in ops_in.items():
        if not isinstance(v, dict) or "forward" not in v or "backward" not in v:
            raise FieldError(f"ops[{k!r}]", 'expected {"forward": seconds, "backward": seconds}')
        ops[k] = (
            number(v["forward"], f"ops[{k!r}].forward", positive=False),
            number(v["backward"], f"ops[{k!r}].backward", positive=False),
        )
    return ops


def _notes_of_dropped_factors(d: dict) -> str:
    """The ``notes`` field, saying which deleted factors (``ops_scale``, ``dup_scale``; module
    docstring) the document carries other than 1."""
    notes = d.get("notes", "")
    dropped = {k: number(d[k], k) for k in ("ops_scale", "dup_scale") if k in d}
    dropped = {k: v for k, v in dropped.items() if v != 1.0}
    if dropped:
        notes += (
            ("; " if notes else "")
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(dropped.items()))
            + " not applied (factors about 1 that this hidup no longer has)"
        )
    return notes


def _corrections(d: dict, where: str) -> Corrections:
    """The ``corrections`` field, or the top-level ``dist_scale`` / ``dist_dup_scale`` of an older
    document (:meth:`Corrections.from_legacy`), not both."""
    legacy = {k: number(d[k], k) for k in Corrections.names() if k in d}  # before "corrections"
    if legacy and "corrections" in d:
        raise FieldError(
            "corrections",
            f"given both at the top level ({sorted(legacy)}) and under 'corrections'; keep the 'corrections' object",
        )
    try:
        if "corrections" in d:
            return Corrections.from_dict(d["corrections"], f"{where}: field 'corrections'")
        return Corrections.from_legacy(legacy)
    except CorrectionError as e:
        raise ProfileError(str(e)) from None


def _ops_timing(d: dict) -> str:
    ops_timing = d.get("ops_timing", "eager")
    if ops_timing not in ("graph", "eager"):
        raise FieldError("ops_timing", f"must be 'graph' or 'eager', got {ops_timing!r}")
    return ops_timing


def _gpus_per_node(d: dict) -> int:
    gpus_per_node = d.get("gpus_per_node", 0)
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 0:
        raise FieldError("gpus_per_node", f"expected an integer >= 0 (0 = one node), got {gpus_per_node!r}")
    return gpus_per_node


def builtin_names() -> list[str]:
    return sorted(p.stem for p in DEFAULTS_DIR.glob("*.json"))


def load(name_or_path: str | Path) -> Profile:
    """Load a builtin profile by name (see :func:`builtin_names`) or a profile JSON by path."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    text = str(name_or_path)
    builtin = DEFAULTS_DIR / f"{text}.json"
    path = builtin if (builtin.is_file() and "/" not in text) else Path(text)
    if not path.is_file():
        raise FileNotFoundError(
            f"no profile {text!r}: not a builtin ({', '.join(builtin_names())}) "
            "and no such file. Fix: pass a builtin name or the path of a profile JSON."
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return Profile.from_dict(data, where=str(path))


def save(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (:func:`hidup.files.atomic_write`)."""
    return atomic_write(path, json.dumps(profile.to_dict(), indent=1) + "\n")
