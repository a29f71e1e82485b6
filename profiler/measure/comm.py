"""Collective latency and bandwidth, measured inside an initialized process group.

Size convention
---------------
``nbytes`` is the size of the *logical full tensor* the collective moves between forms, the
quantity the cost model knows (``Tensor.nbytes``); with ``g`` ranks in the group and ``S = nbytes``:

=================  =========================  =========================
collective         input per rank             output per rank
=================  =========================  =========================
``all_reduce``     ``S`` (partial sums)       ``S``
``all_gather``     ``S / g``                  ``S``
``reduce_scatter`` ``S`` (partial sums)       ``S / g``
``all_to_all``     ``S / g`` (gather_a)       ``S / g`` (gather_b)
=================  =========================  =========================

This is the nccl-tests convention for the first three; for ``all_to_all`` nccl-tests counts the
per-rank buffer, here it is the logical tensor (``g`` times larger).  The algorithmic bandwidth is
``algbw(S) = S / t(S)`` [bytes/s].

Timing
------
For one (collective, size, group size) point every rank runs the same schedule: one warm-up call;
one trial call whose time ``t1`` is max-reduced over the world so that every rank derives the same
``k = ceil(sample_s / t1)`` calls per sample and the same number of samples (bounded by
``budget_s``); before each sample a world barrier; each sample's per-call time is
``elapsed / k`` on each rank, max-reduced over the world (a collective is as slow as its slowest
rank); ``t(S)`` is the median over samples.  Two concurrent calls on two communicators (what two
duplicated copies do) are sampled in turns with the single call, and their time is ``t(S)`` times
the median ratio of each pair of samples, so that the network's drift stays out of the ratio.
Sub-groups of ``g`` consecutive ranks (``{0,1}``, ``{2,3}``, ...) run their collectives
concurrently, as a plan's sub-group collectives would.

Nodes
-----
On several nodes of ``K`` ranks each (rank = node * K + local) the two levels of a profile are
measured on two families of groups, every group of a family at once (:func:`node_groups`,
:func:`network_groups`): the node level on ``g`` consecutive ranks inside each node (``{0..g-1}``,
``{g..2g-1}``, ... never across a node boundary), the network level on ``g`` ranks of the same
local index on ``g`` consecutive nodes, one rank per node (``{l, l+K, ..., l+(g-1)K}`` for every
``l``): every GPU's NIC carries one group, as a mesh axis across nodes does.  Every rank creates
every group of a family in the same order (``new_group`` is collective).

Monotone times
--------------
Moving more bytes never takes less time, so a time that comes out below a larger size's is noise
(a busy host, a clock boost); the curve keeps ``t(S_i) <- min_{j >= i} t(S_j)`` (the raw medians
stay in ``CommCurve.raw_seconds``).

Latency fit
-----------
On the ``n_fit`` smallest sizes the time is fitted by least squares to ``t = alpha + S / beta``;
``alpha`` (seconds) is the intercept, clamped to ``[0, min t]`` (noise can make the fitted
intercept negative or larger than the smallest observation).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from hidup.codegen.timing import Timer, max_over_ranks
from hidup.ir import COLLECTIVES
from hidup.optionset import OptionSet

__all__ = [
    "CommCurve",
    "CommOptions",
    "Communicator",
    "Sampling",
    "fit_alpha",
    "monotone",
    "default_comm_sizes",
    "default_group_sizes",
    "node_groups",
    "network_groups",
    "time_collective",
    "profile_collectives",
    "collective_call",
]

# Newer torch renames the tensor-in/tensor-out collectives; same signatures.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCurve:
    """Measured time of one collective on groups of ``group_size`` ranks, per logical size."""

    op: str
    group_size: int
    sizes: list[int] = field(default_factory=list)  # logical bytes, ascending
    seconds: list[float] = field(default_factory=list)  # median time per call, made monotone
    raw_seconds: list[float] = field(default_factory=list)  # the medians as measured
    alpha: float = 0.0  # latency fitted on the smallest sizes [s]
    pair_seconds: list[float] = field(default_factory=list)  # two calls at once on two communicators
    round_seconds: list[list[float]] = field(default_factory=list)  # per size, each pass's time (rounds)

    @property
    def pair_speedup(self) -> list[float]:
        """Aggregate throughput of two concurrent calls relative to one, ``2 t(S) / t_pair(S)``, per
        size (empty when pairs were not measured)."""
        return [2.0 * t / max(p, 1e-12) for t, p in zip(self.raw_seconds, self.pair_seconds)]

    @property
    def algbw(self) -> list[float]:
        """Algorithmic bandwidth ``S / t(S)`` [bytes/s] per size."""
        return [s / t for s, t in zip(self.sizes, self.seconds)]

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "group_size": self.group_size,
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "raw_seconds": list(self.raw_seconds),
            "algbw": self.algbw,
            "alpha": self.alpha,
            "pair_seconds": list(self.pair_seconds),
            "pair_speedup": self.pair_speedup,
            "round_seconds": [list(r) for r in self.round_seconds],
        }


@dataclass(frozen=True)
class Sampling:
    """How one point is sampled (module docstring, "Timing"): about ``sample_s`` seconds per sample,
    ``budget_s`` for the point's samples together, at least ``min_samples`` and at most ``max_samples``."""

    sample_s: float = 0.02
    budget_s: float = 0.25
    min_samples: int = 3
    max_samples: int = 20


@dataclass(frozen=True)
class Communicator:
    """Where :func:`time_collective` runs a collective: ``group``, this rank's process group of ``size``
    ranks (None: the world's); ``member=False`` on a rank in no group, which only takes part in the
    agreement collectives; ``pair_with``, a second communicator over the same ranks (every rank a
    member), on which a second call runs together with the first."""

    group: object
    size: int
    member: bool = True
    pair_with: object = None


@dataclass(frozen=True)
class CommOptions(OptionSet):
    """What :func:`profile_collectives` measures (it takes them as keywords too): every collective of
    ``ops`` at every size of ``sizes`` (logical bytes; None: :func:`default_comm_sizes`) on groups of
    each size of ``group_sizes`` (None: :func:`default_group_sizes` of the world), ``budget_s``
    seconds per point, buffers of ``dtype``, the latency fitted on the ``n_fit`` smallest sizes.
    ``groups(g)`` lists the groups of size ``g`` that run at once (None: :func:`consecutive_groups`);
    with ``pairs``, the groups of size ``pair_group`` (None: the world) also time two calls at once;
    ``rounds`` passes over each group size's table keep each point's median."""

    sizes: list[int] | None = None
    ops: tuple[str, ...] = COLLECTIVES
    group_sizes: list[int] | None = None
    budget_s: float = 0.25
    n_fit: int = 3
    dtype: torch.dtype = torch.float32
    pairs: bool = True
    rounds: int = 1
    groups: Callable[[int], list[list[int]]] | None = None
    pair_group: int | None = None
    WHAT = "profile_collectives"


def monotone(seconds: list[float]) -> list[float]:
    """``t_i <- min_{j >= i} t_j`` for times listed by ascending size (see the module docstring)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def fit_alpha(sizes: list[int], seconds: list[float], n_fit: int = 3) -> float:
    """Intercept of the least-squares line ``t = alpha + S / beta`` on the ``n_fit`` smallest sizes,
    clamped to ``[0, min t]`` (see the module docstring)."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError(
            f"fit_alpha needs equally long non-empty lists, got {len(sizes)} sizes and {len(seconds)} times"
        )
    pts = sorted(zip(sizes, seconds))[: max(1, n_fit)]
    t_min = min(t for _, t in pts)
    if len(pts) < 2:
        return t_min
    xs = [float(s) for s, _ in pts]
    ys = [t for _, t in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return t_min
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    alpha = my - slope * mx
    return min(max(alpha, 0.0), t_min)


def default_comm_sizes(device: torch.device | str, quick: bool = False) -> list[int]:
    """Logical sizes in bytes: 4 KiB .. 256 MiB (powers of 2) on a GPU, 4 KiB .. 4 MiB on a CPU.

    ``quick`` keeps every other power of 4 on a GPU (4 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB) and
    three sizes on a CPU.
    """
    if torch.device(device).type == "cuda":
        exps = range(12, 29, 4) if quick else range(12, 29)
    else:
        exps = (12, 16, 20) if quick else range(12, 23, 2)
    return [1 << e for e in exps]


def default_group_sizes(world: int) -> list[int]:
    """The whole world, plus pairs when the world has more than two ranks."""
    if world < 2:
        return []
    return [world, 2] if world > 2 else [world]


def _elements(nbytes: int, g: int, op: str, elem: int) -> int:
    """Element count of the logical tensor: ``nbytes / elem`` rounded up to a multiple that splits
    evenly (``g`` chunks; ``g^2`` for all_to_all, whose local ``S/g`` is split ``g`` ways again)."""
    unit = g * g if op == "all_to_all" else g
    n = max(1, math.ceil(nbytes / elem))
    return max(unit, math.ceil(n / unit) * unit)


def collective_call(
    op: str, numel: int, group, g: int, device: torch.device, dtype: torch.dtype = torch.float32, async_op: bool = False
) -> Callable[[], object]:
    """A zero-argument function that runs ``op`` once on preallocated buffers (logical ``numel``);
    with ``async_op`` it returns the collective's work handle."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}")
    full = torch.ones(numel, device=device, dtype=dtype)
    part = torch.ones(numel // g, device=device, dtype=dtype)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group, async_op=async_op)
    if op == "all_gather":
        return lambda: _all_gather_tensor(full, part, group=group, async_op=async_op)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_tensor(part, full, group=group, async_op=async_op)
    out = torch.empty_like(part)
    return lambda: dist.all_to_all_single(out, part, group=group, async_op=async_op)


def _barrier(device: torch.device) -> None:
    """A world barrier that works on every backend: a tiny all-reduce, waited for."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair_call(op: str, numel: int, groups, g: int, device: torch.device, dtype: torch.dtype):
    """Two ``op`` calls issued together on two communicators of the same ranks, then both awaited."""
    calls = [collective_call(op, numel, grp, g, device, dtype, async_op=True) for grp in groups]

    def run():
        for work in [call() for call in calls]:
            work.wait()

    return run


def _sampled(
    fns: list[Callable[[], object]], timer: "Timer", device: torch.device, sampling: Sampling
) -> list[list[float]]:
    """Per-call seconds of each of ``fns``, per sample, max over the world, sampled in turns.

    Each function is warmed up once and timed once to fix its calls per sample ``k`` (from the
    world's slowest trial, so every rank derives the same schedule); the number of samples fits
    ``sampling.budget_s`` for all of them together.  Sample ``i`` of every function is taken before
    sample ``i + 1`` of any, each after a world barrier, in turns that reverse every round (A B, B A,
    A B, ...): drift of the host or the network between samples then reaches every function alike."""
    _barrier(device)
    for fn in fns:
        fn()  # warm-up: communicator setup, buffer registration
    timer.sync()
    trials = []
    for fn in fns:
        _barrier(device)
        trials.append(timer.measure(fn, 1))
    trials = [max(t, 1e-6) for t in max_over_ranks(trials, None, device)]
    ks = [max(1, min(int(math.ceil(sampling.sample_s / t)), 1000)) for t in trials]
    per_round = sum(k * t for k, t in zip(ks, trials)) + 1e-4 * len(fns)
    n_samples = int(min(sampling.max_samples, max(sampling.min_samples, sampling.budget_s // per_round)))
    local: list[list[float]] = [[] for _ in fns]
    for i in range(n_samples):
        for j in range(len(fns)) if i % 2 == 0 else reversed(range(len(fns))):
            _barrier(device)
            local[j].append(timer.measure(fns[j], ks[j]) / ks[j])
    return [max_over_ranks(samples, None, device) for samples in local]


def time_collective(
    op: str,
    nbytes: int,
    communicator: Communicator,
    device: torch.device,
    *,
    sampling: Sampling | None = None,
    dtype: torch.dtype = torch.float32,
):
    """Median seconds of one ``op`` of logical size ``nbytes`` on ``communicator``'s group, max over
    the world, sampled as ``sampling`` says (default :class:`Sampling`).  Every rank of the world must
    call this with the same arguments; ranks outside any group pass a communicator with
    ``member=False`` and only take part in the agreement collectives.

    With ``communicator.pair_with`` (a second communicator over the same ranks; every rank a member)
    it returns ``(t, t_pair)``: ``t`` as above and ``t_pair`` the time of two calls issued together,
    one on each communicator.  The single and the paired calls are sampled in turns, and ``t_pair = t *
    median_i(pair_i / single_i)``: over a network whose speed drifts (sockets can move a quarter
    from one second to the next), separate measurements would put the drift into the ratio, which
    is what the cost model uses (``CommCurve.pair_speedup``)."""
    device = torch.device(device)
    elem = torch.empty((), dtype=dtype).element_size()
    group, g, pair_with = communicator.group, communicator.size, communicator.pair_with
    numel = _elements(nbytes, g, op, elem)
    timer = Timer(device)
    if not communicator.member:
        if pair_with is not None:
            raise ValueError("time_collective: a paired measurement needs every rank in the group")
        fns = [lambda: None]
    else:
        fns = [collective_call(op, numel, group, g, device, dtype)]
        if pair_with is not None:
            fns.append(_pair_call(op, numel, (group, pair_with), g, device, dtype))
    samples = _sampled(fns, timer, device, sampling or Sampling())
    single = statistics.median(samples[0])
    if pair_with is None:
        return single
    ratio = statistics.median(p / max(t, 1e-12) for t, p in zip(*samples))
    return single, single * ratio


def consecutive_groups(world: int, g: int) -> list[list[int]]:
    """Groups of ``g`` consecutive ranks (``{0..g-1}``, ``{g..2g-1}``, ...); ranks past the last
    whole group sit out."""
    return [list(range(start, start + g)) for start in range(0, world - world % g, g)]


def _check_nodes(world: int, gpus_per_node: int, g: int, span: int, what: str) -> None:
    if gpus_per_node < 1 or world % gpus_per_node:
        raise ValueError(f"{world} ranks do not split into nodes of {gpus_per_node}; give a divisor of {world}")
    if not 2 <= g <= span:
        raise ValueError(f"group size {g} is not in [2, {span}] ({what})")


def node_groups(world: int, gpus_per_node: int, g: int) -> list[list[int]]:
    """Groups of ``g`` consecutive ranks inside each node of ``gpus_per_node`` ranks (module
    docstring, "Nodes"); a node's ranks past its last whole group sit out."""
    _check_nodes(world, gpus_per_node, g, gpus_per_node, f"{gpus_per_node} ranks per node")
    return [
        [node * gpus_per_node + local for local in range(start, start + g)]
        for node in range(world // gpus_per_node)
        for start in range(0, gpus_per_node - gpus_per_node % g, g)
    ]


def network_groups(world: int, gpus_per_node: int, g: int) -> list[list[int]]:
    """Groups of ``g`` ranks one per node: the same local index on ``g`` consecutive nodes (module
    docstring, "Nodes"); nodes past the last whole block of ``g`` sit out."""
    nnodes = world // max(gpus_per_node, 1)
    _check_nodes(world, gpus_per_node, g, nnodes, f"{nnodes} nodes")
    return [
        [local + (first + k) * gpus_per_node for k in range(g)]
        for local in range(gpus_per_node)
        for first in range(0, nnodes - nnodes % g, g)
    ]


def _make_groups(groups: list[list[int]]):
    """Every rank creates every group of ``groups`` in order (``new_group`` is collective); a group
    of the whole world is the world's.  Returns (this rank's group or None, whether this rank is in
    one, the groups to destroy)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if groups == [list(range(world))]:
        return dist.group.WORLD, True, []
    mine, created = None, []
    for ranks in groups:
        grp = dist.new_group(ranks)
        if rank in ranks:
            mine = grp
            created.append(grp)
    return mine, mine is not None, created


def profile_collectives(
    device: torch.device | str,
    options: CommOptions | None = None,
    *,
    on_point: Callable[[str, int, int], None] | None = None,
    **changes,
) -> list[CommCurve]:
    """Time every collective of ``options.ops`` at every size on groups of each group size
    (:class:`CommOptions`, updated by the keyword ``changes``); return one :class:`CommCurve` per (op,
    group size), identical on every rank.  ``groups(g)`` lists the groups of size ``g`` that run at
    once (default: ``g`` consecutive ranks, :func:`consecutive_groups`; :func:`node_groups` and
    :func:`network_groups` for the two levels of several nodes).  With ``pairs``, the groups of size
    ``pair_group`` (default: the world), which must hold every rank, also time two calls at once on
    two communicators (``CommCurve.pair_seconds``): what two duplicated copies communicating together
    get.

    With ``rounds`` > 1 the whole table of a group size is measured that many times, one pass after
    the other, and each point keeps the median of its passes (the passes' own times in
    ``CommCurve.round_seconds``): a network whose speed drifts over seconds (NCCL over sockets) is
    then described by its typical speed rather than by the one moment each point was taken.

    Must be called by every rank of an initialized process group.  ``on_point(op, g, nbytes)`` is
    called after each point (for progress bars).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "profile_collectives needs an initialized process group; call "
            "torch.distributed.init_process_group first (or use hidup.profiler.measure.machine."
            "profile_machine, which profiles only the device when world size is 1)"
        )
    opts = CommOptions.of(options, **changes)
    device = torch.device(device)
    world = dist.get_world_size()
    sizes, group_sizes = _checked(opts, device, world)
    curves: list[CommCurve] = []
    for g in group_sizes:
        curves += _group_curves(g, sizes, opts, device, on_point)
    return curves


def _checked(opts: CommOptions, device: torch.device, world: int) -> tuple[list[int], list[int]]:
    """(sizes, group sizes) of ``opts`` on ``world`` ranks, checked."""
    sizes = sorted(set(int(s) for s in (opts.sizes or default_comm_sizes(device))))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"collective sizes must be positive byte counts, got {sizes}")
    group_sizes = list(default_group_sizes(world) if opts.group_sizes is None else opts.group_sizes)
    for g in group_sizes:
        if g < 2 or g > world:
            raise ValueError(f"group size {g} is not in [2, world={world}]")
    for op in opts.ops:
        if op not in COLLECTIVES:
            raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}")
    if opts.rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {opts.rounds}")
    return sizes, group_sizes


def _group_curves(g: int, sizes: list[int], opts: CommOptions, device: torch.device, on_point) -> list[CommCurve]:
    """The curves of every collective on the groups of size ``g``, which are created, timed and destroyed."""
    world = dist.get_world_size()
    ranks = (opts.groups or (lambda n: consecutive_groups(world, n)))(g)
    if any(len(r) != g for r in ranks):
        raise ValueError(f"groups({g}) returned groups of other sizes: {ranks}")
    communicator, created = _communicator(ranks, g, opts)
    single, ratio = _timed_rounds(communicator, sizes, opts, device, on_point)
    elem = torch.empty((), dtype=opts.dtype).element_size()
    curves = [_curve(op, g, sizes, single, ratio, opts.n_fit, elem) for op in opts.ops]
    _barrier(device)
    for grp in created:
        dist.destroy_process_group(grp)
    return curves


def _communicator(ranks: list[list[int]], g: int, opts: CommOptions) -> tuple[Communicator, list]:
    """This rank's :class:`Communicator` on the groups ``ranks`` of size ``g`` (with a second
    communicator where pairs are timed), and the groups created for it, to destroy."""
    world = dist.get_world_size()
    group, member, created = _make_groups(ranks)
    second = None
    if opts.pairs and g == (world if opts.pair_group is None else opts.pair_group):
        if sorted(r for grp in ranks for r in grp) != list(range(world)):
            raise ValueError(f"pairs are timed on groups that hold every rank once; groups({g}) = {ranks}")
        if ranks == [list(range(world))]:  # the first communicator is the world's: a second one
            second = dist.new_group(list(range(world)))
            created.append(second)
        else:  # a second communicator for each group
            second, _, again = _make_groups(ranks)
            created += again
    return Communicator(group, g, member, second), created


def _timed_rounds(communicator: Communicator, sizes: list[int], opts: CommOptions, device, on_point):
    """(op, size) -> per round the single call's time, and (op, size) -> per round the pair's time over
    the single's (empty without pairs)."""
    single: dict[tuple[str, int], list[float]] = {}
    ratio: dict[tuple[str, int], list[float]] = {}
    sampling = Sampling(budget_s=opts.budget_s)
    for _ in range(opts.rounds):
        for op in opts.ops:
            for s in sizes:
                t = time_collective(op, s, communicator, device, sampling=sampling, dtype=opts.dtype)
                if communicator.pair_with is not None:
                    t, pair = t
                    ratio.setdefault((op, s), []).append(pair / max(t, 1e-12))
                single.setdefault((op, s), []).append(t)
                if on_point is not None:
                    on_point(op, communicator.size, s)
    return single, ratio


def _curve(op: str, g: int, sizes: list[int], single: dict, ratio: dict, n_fit: int, elem: int) -> CommCurve:
    """The curve of ``op`` on groups of ``g`` from each point's rounds (:func:`_timed_rounds`)."""
    curve = CommCurve(op, g)
    for s in sizes:
        t = statistics.median(single[(op, s)])
        curve.sizes.append(_elements(s, g, op, elem) * elem)
        curve.raw_seconds.append(t)
        curve.round_seconds.append(single[(op, s)])
        if ratio:
            curve.pair_seconds.append(t * statistics.median(ratio[(op, s)]))
    curve.seconds = monotone(curve.raw_seconds)
    curve.alpha = fit_alpha(curve.sizes, curve.seconds, n_fit)
    return curve
