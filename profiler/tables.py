"""Collective tables: one collective at one group size (read from a profile document by
:meth:`CommTable.tables_from_dict`, with :func:`concurrency_from_dict`), and fitting them to one another.

Fitted tables: collectives that share a link
---------------------------------------------
Ring all-gather, reduce-scatter and all-reduce over the same group run on the same link, and a ring
all-reduce *is* a reduce-scatter followed by an all-gather.  At a fixed logical size ``S`` their
bandwidth-bound times ``tau_c(S) = S / algbw_c(S)`` (net of alpha) are therefore three measurements of
one *link time* ``u(S)``: ``tau_c(S) = k_c u(S)`` with ``k = 1`` for all-gather and reduce-scatter and
``k = 2`` for all-reduce.  :meth:`Profile.fitted` (what the cost model reads) estimates, per group
size and measured size, ``log u`` as the weighted median of ``log(tau_c / k_c)`` with weights
``w_c = tau_c / t_c`` (``t_c = alpha_c + tau_c``): the least-absolute-deviation fit in log *time*,
linearized (an error ``e`` in ``log tau_c`` moves ``log t_c`` by ``(tau_c / t_c) e``, so
alpha-dominated points, which carry no bandwidth information, get no weight), and unlike a mean not
dragged by one wrong measurement out of three.  Each collective then keeps its own measurement as long as it
lies within ``tolerance`` (15 %) of the link's consensus, and is pulled back to that band otherwise::

    log tau'_c = log(k_c u) + clip(log tau_c - log(k_c u), -tolerance, +tolerance)

On a consistent measurement nothing changes (the measured sockets and NVLink profiles agree to within
the tolerance at every size that is not alpha-dominated, and their clean plans' predictions move by
less than 0.01 %); a single wrong entry (a noisy sample, a busy host during one point) can no longer
make all-reduce look much dearer or cheaper than the reduce-scatter plus all-gather it consists of,
which is exactly the difference the search would otherwise exploit (sharding weights to replace
gradient all-reduces, or the opposite).  Tables whose sizes differ between the three collectives are
left as measured.

All-to-all follows another pattern (direct exchanges, not a ring: over sockets about 3x the ring's
algbw), so it is not a member of the consensus, but where it is bandwidth-bound it runs on the same
link and its *shape* along the size axis follows the link's.  Per group size, over the sizes where
the all-to-all and the link are both bandwidth-bound (``w >= 1/2``, the link's ``w`` the mean of the
three ring collectives'), ``d(S) = log tau_a2a(S) - log u(S)`` (``log u`` the consensus above) should
be one constant ``k``: ``k`` is the median of ``d`` over those sizes (at least three, so that one
wrong entry cannot set it), and each such entry is pulled back to ``k +- a2a_tolerance``
(``A2A_TOLERANCE`` = 30 %, twice the ring tolerance: another algorithm may ramp up differently)::

    log tau'_a2a(S) = log u(S) + k + clip(d(S) - k, -a2a_tolerance, +a2a_tolerance)

So a single wrong all-to-all entry (one of the two bandwidth-bound sizes that price every large
exchange, 16 and 256 MiB) is checked against three ring measurements at that size instead of
nothing.  Entries within the band, alpha-dominated sizes (where net bandwidths mean nothing) and
groups with fewer than three bandwidth-bound sizes (NVLink: only 256 MiB is) stay as measured.  On
every measured and builtin profile (``exp/records``, ``tests/data``, ``profiler/defaults``) this
changes no all-to-all entry.  A smoother along the size axis alone (a running median of three) is
not used: the measured curves are not monotone (alpha-dominated small sizes, the all-to-all's dip
at 1 MiB, peaks at 16 MiB), sizes are 16x apart, so 1 MiB still sits on the ramp below the plateau,
and the plateau has only two entries; a running median moved the measured sockets tables by up to
54 % (at 64 KiB, next to the all-latency 4 KiB entry) and did not make the search more robust
(docs/robustness.md).

Between measured sizes
----------------------
``algbw`` is interpolated linearly in log(size), which follows the ramp of a bandwidth curve well.
But a bandwidth net of alpha is meaningless where a measured time is all latency: an NVLink
all-to-all of 16 MiB over 4 ranks took 33.9 us with alpha 33.9 us, a net bandwidth of 5e14 B/s,
and interpolating towards it priced a 120 MB exchange at 34.7 us, though 256 MiB took 209 us (in the
step's trace, BERT-SGMoE's exchanges, most of them 120 MB, took 88 us on average).  So the
interpolated time ``t(S)``, ``S_0 < S < S_1``, is kept in the band its measured neighbours
``t_0 = t(S_0)``, ``t_1 = t(S_1)`` allow: a larger message takes no less time, ``t_0 <= t(S) <= t_1``,
and no more time per byte,
``t_1 S / S_1 <= t(S) <= t_0 S / S_0``; each of the two is applied only where the neighbours
themselves obey it (a measured curve may dip).  On a well-conditioned table the interpolation lies
inside the band already and nothing changes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .fields import FieldError, group_size, number

__all__ = [
    "CommTable",
    "concurrency_from_dict",
    "fit_ring_tables",
    "fit_all_to_all",
    "COLLECTIVES",
    "RING_LINK",
    "RING_TOLERANCE",
    "A2A_TOLERANCE",
]

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def _ring_factor(measured: int, wanted: int) -> float:
    """algbw(wanted) / algbw(measured) for a ring collective at fixed bus bandwidth."""
    return ((measured - 1) / measured) / ((wanted - 1) / wanted)


# collective -> link time multiple on a ring (all-reduce = reduce-scatter + all-gather)
RING_LINK = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
RING_TOLERANCE = 0.15  # a ring collective may differ from its link's consensus by this much (in log time)
A2A_TOLERANCE = 2 * RING_TOLERANCE  # all-to-all's shape may differ from its link's by this much (in log time)
A2A_MIN_SIZES = 3  # bandwidth-bound sizes needed to check the all-to-all against its link


def _weighted_median(values: list[float], weights: list[float]) -> float | None:
    """The value where the cumulative weight (values ascending) first reaches half the total;
    the midpoint of the two values when it lands exactly on half; None without weight."""
    total = sum(weights)
    if total <= 0:
        return None
    pairs = sorted(zip(values, weights))
    acc = 0.0
    for j, (v, w) in enumerate(pairs):
        acc += w
        if acc >= 0.5 * total * (1 - 1e-12):
            if abs(acc - 0.5 * total) <= 1e-12 * total and j + 1 < len(pairs):
                return 0.5 * (v + pairs[j + 1][0])
            return v
    return pairs[-1][0]


def _same_sizes(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-9 * y for x, y in zip(a, b))


def _share(table: "CommTable", i: int) -> float:
    """Share of the measured time at entry ``i`` that is bandwidth (tau / (alpha + tau))."""
    tau = table.sizes[i] / table.algbw[i]
    return tau / (table.alpha + tau)


def fit_all_to_all(
    table: "CommTable", link: list[float | None], link_share: list[float], tolerance: float = A2A_TOLERANCE
) -> "CommTable":
    """``table`` (all-to-all of one group size) with each bandwidth-bound entry pulled back to within
    ``tolerance`` (log time) of the link's shape: ``link[i]`` is the log link time at ``table.sizes[i]``
    (None where unknown), ``link_share[i]`` its bandwidth share (module docstring, "Fitted tables").
    Returned unchanged (the same object) when nothing moves."""
    if tolerance < 0:
        raise ValueError(f"fit_all_to_all: tolerance must be >= 0, got {tolerance}")
    bound = [
        i for i in range(len(table.sizes)) if link[i] is not None and link_share[i] >= 0.5 and _share(table, i) >= 0.5
    ]
    if len(bound) < A2A_MIN_SIZES:
        return table
    d = {i: math.log(table.sizes[i] / table.algbw[i]) - link[i] for i in bound}
    ks = sorted(d.values())
    m = len(ks)
    k = ks[m // 2] if m % 2 else 0.5 * (ks[m // 2 - 1] + ks[m // 2])
    algbw = list(table.algbw)
    for i in bound:
        if abs(d[i] - k) > tolerance:
            algbw[i] = table.sizes[i] / math.exp(link[i] + k + math.copysign(tolerance, d[i] - k))
    if algbw == table.algbw:
        return table
    return CommTable(table.alpha, list(table.sizes), algbw)


def fit_ring_tables(
    collectives: dict[str, dict[int, "CommTable"]],
    tolerance: float = RING_TOLERANCE,
    a2a_tolerance: float = A2A_TOLERANCE,
) -> dict[str, dict[int, "CommTable"]]:
    """Tables with the ring collectives of each group size made consistent with one link time per
    size, and the all-to-all of that group checked against the link's shape (see "Fitted tables" in
    the module docstring; ``a2a_tolerance=math.inf`` leaves all-to-all as measured); other tables
    are returned unchanged."""
    if tolerance < 0:
        raise ValueError(f"fit_ring_tables: tolerance must be >= 0, got {tolerance}")
    if a2a_tolerance < 0:
        raise ValueError(f"fit_ring_tables: a2a_tolerance must be >= 0, got {a2a_tolerance}")
    out = {c: dict(tabs) for c, tabs in collectives.items()}
    if not all(c in collectives for c in RING_LINK):
        return out
    groups = set.intersection(*(set(collectives[c]) for c in RING_LINK))
    for g in sorted(groups):
        tabs = {c: collectives[c][g] for c in RING_LINK}
        sizes = tabs["all_gather"].sizes
        if any(not _same_sizes(t.sizes, sizes) for t in tabs.values()):
            continue
        new = {c: list(t.algbw) for c, t in tabs.items()}
        centers: list[float | None] = []
        shares: list[float] = []
        for i, size in enumerate(sizes):
            logs, weights = {}, {}
            for c, t in tabs.items():
                tau = size / t.algbw[i]
                logs[c] = math.log(tau / RING_LINK[c])
                weights[c] = tau / (t.alpha + tau)
            center = _weighted_median([logs[c] for c in tabs], [weights[c] for c in tabs])
            centers.append(center)
            shares.append(sum(weights.values()) / len(weights))
            if center is None:
                continue
            for c in tabs:
                y = center + min(max(logs[c] - center, -tolerance), tolerance)
                new[c][i] = size / (RING_LINK[c] * math.exp(y))
        for c, t in tabs.items():
            out[c][g] = CommTable(t.alpha, list(t.sizes), new[c])
        a2a = out.get("all_to_all", {}).get(g)
        if a2a is not None and math.isfinite(a2a_tolerance) and _same_sizes(a2a.sizes, sizes):
            out["all_to_all"][g] = fit_all_to_all(a2a, centers, shares, a2a_tolerance)
    return out


@dataclass
class CommTable:
    """One collective at one group size: latency plus a size -> algorithmic bandwidth table."""

    alpha: float
    sizes: list[float]
    algbw: list[float]

    def __post_init__(self):
        self._logs = [math.log(s) for s in self.sizes]

    def bandwidth(self, nbytes: float) -> float:
        """Interpolated algbw in bytes/s, linear in log(size), clamped at both ends."""
        if nbytes <= self.sizes[0]:
            return self.algbw[0]
        if nbytes >= self.sizes[-1]:
            return self.algbw[-1]
        x = math.log(nbytes)
        i = bisect.bisect_right(self._logs, x)
        x0, x1 = self._logs[i - 1], self._logs[i]
        w = (x - x0) / (x1 - x0)
        return self.algbw[i - 1] * (1 - w) + self.algbw[i] * w

    def net_time(self, nbytes: float) -> float:
        """Seconds beyond ``alpha`` of a call on ``nbytes``: ``nbytes / bandwidth(nbytes)``, kept
        within what the two measured neighbours allow (module docstring, "Between measured sizes")."""
        if nbytes <= 0:
            return 0.0
        t = self.alpha + nbytes / self.bandwidth(nbytes)
        if self.sizes[0] < nbytes < self.sizes[-1]:
            i = bisect.bisect_right(self.sizes, nbytes)
            s0, s1 = self.sizes[i - 1], self.sizes[i]
            t0, t1 = self.alpha + s0 / self.algbw[i - 1], self.alpha + s1 / self.algbw[i]
            lo, hi = 0.0, math.inf
            if t0 <= t1:  # a larger message does not take less time
                lo, hi = t0, t1
            if t0 / s0 >= t1 / s1:  # nor more time per byte
                lo, hi = max(lo, t1 * nbytes / s1), min(hi, t0 * nbytes / s0)
            t = min(max(t, lo), hi)
        return t - self.alpha

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha + self.net_time(nbytes)

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "sizes": list(self.sizes), "algbw": list(self.algbw)}

    @classmethod
    def from_dict(cls, t, field: str) -> "CommTable":
        """Build from :meth:`to_dict`'s form, found at ``field`` of a profile document; a
        :class:`~hidup.profiler.fields.FieldError` names what is wrong."""
        if not isinstance(t, dict):
            raise FieldError(field, "expected {alpha, sizes, algbw}")
        for key in ("alpha", "sizes", "algbw"):
            if key not in t:
                raise FieldError(f"{field}.{key}", "missing")
        alpha = number(t["alpha"], f"{field}.alpha", positive=False)
        sizes, bws = t["sizes"], t["algbw"]
        if not isinstance(sizes, list) or not sizes:
            raise FieldError(f"{field}.sizes", "expected a non-empty list of byte counts")
        if not isinstance(bws, list) or len(bws) != len(sizes):
            raise FieldError(f"{field}.algbw", f"expected a list as long as sizes ({len(sizes)} entries)")
        sizes = [number(s, f"{field}.sizes[{i}]") for i, s in enumerate(sizes)]
        bws = [number(b, f"{field}.algbw[{i}]") for i, b in enumerate(bws)]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise FieldError(f"{field}.sizes", f"must be strictly increasing, got {sizes}")
        return cls(alpha, sizes, bws)

    @classmethod
    def tables_from_dict(cls, cin, prefix: str) -> dict[str, dict[int, "CommTable"]]:
        """The tables ``{collective: {group size: table}}`` of ``cin``, found at ``prefix`` of a profile
        document (``collectives``, ``network.collectives``): every collective of :data:`COLLECTIVES`
        with at least one group size, and no other."""
        if not isinstance(cin, dict):
            raise FieldError(prefix, f"a mapping with {COLLECTIVES} is required")
        colls: dict[str, dict[int, CommTable]] = {}
        for c in COLLECTIVES:
            if c not in cin:
                raise FieldError(f"{prefix}.{c}", "missing; every collective needs at least one group size")
            groups = cin[c]
            if not isinstance(groups, dict) or not groups:
                raise FieldError(f"{prefix}.{c}", "expected a non-empty mapping group size -> table")
            colls[c] = {}
            for g, t in groups.items():
                f = f"{prefix}.{c}.{g}"
                gi = group_size(g, f)
                colls[c][gi] = cls.from_dict(t, f)
        extra = set(cin) - set(COLLECTIVES)
        if extra:
            raise FieldError(prefix, f"unknown collective(s) {sorted(extra)}; expected {COLLECTIVES}")
        return colls


def concurrency_from_dict(cc, prefix: str) -> dict[str, dict[int, tuple[list[float], list[float]]]]:
    """The concurrency tables ``{collective: {group size: (sizes, speedup)}}`` of ``cc`` (None: none),
    found at ``prefix`` of a profile document (``concurrency``, ``network.concurrency``); a
    :class:`~hidup.profiler.fields.FieldError` names what is wrong."""
    concurrency: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    cc = cc or {}
    if not isinstance(cc, dict):
        raise FieldError(prefix, "expected an object {collective: {group size: {sizes, speedup}}}")
    for c, groups in cc.items():
        if c not in COLLECTIVES or not isinstance(groups, dict):
            raise FieldError(prefix, f"unknown collective {c!r} or malformed entry; expected {COLLECTIVES}")
        for g, entry in groups.items():
            f = f"{prefix}.{c}.{g}"
            gi = group_size(g, f)
            if not isinstance(entry, dict):
                raise FieldError(f, "expected {sizes, speedup}")
            sizes = [number(x, f + ".sizes") for x in entry.get("sizes", [])]
            speed = [number(x, f + ".speedup") for x in entry.get("speedup", [])]
            if not sizes or len(sizes) != len(speed) or any(b <= a for a, b in zip(sizes, sizes[1:])):
                raise FieldError(f, "sizes must be strictly increasing and as many as the speedups")
            concurrency.setdefault(c, {})[gi] = (sizes, speed)
    return concurrency
