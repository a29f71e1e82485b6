"""The measured rate of a matmul by its shape and layout: a grid of ``(m, n, k)`` GEMMs per dtype.

A matmul ``C[m, n] = A[m, k] @ B[k, n]`` does ``2 m n k`` FLOPs, but its rate depends on the shape,
not only on the FLOPs: a tall, skinny GEMM (``m = 8192`` tokens against ``n = k = 768``) fills the
tensor cores worse than the square matmul of equal FLOPs, and a wide one (``n = 4096``) better.  It
also depends on the layout, how the operands lie in memory (row-major storage):

* ``nt``: ``A[m, k] @ B[n, k]^T`` -- a linear's forward ``X W^T``, the weight read transposed;
* ``nn``: ``A[m, k] @ B[k, n]`` -- a linear's input gradient ``dY W``;
* ``tn``: ``A[k, m]^T @ B[k, n]`` -- a linear's weight gradient ``dY^T X``, the reduction over the
  rows of both operands.

(In tf32 on an H100 the ``tn`` GEMMs of a small model's linears run up to about 1.9x slower than the
``nt`` GEMMs of the same shape, the ``nn`` ones up to about 1.4x; in bf16 the three agree.)

A profile's :class:`GemmGrid` holds, for one dtype, the rate measured at every point of a grid
``sizes x sizes x sizes`` in each layout (:func:`hidup.profiler.measure.device.gemm_grid`), and prices any
shape by interpolating between the grid points of its layout:

    log rate(m, n, k) = trilinear interpolation of log rate over (log m, log n, log k)

each coordinate clamped to ``[sizes[0], sizes[-1]]`` (outside the grid a dim is priced as the
nearest measured one: a GEMM longer than the largest size runs at that size's rate).  A grid measured
in the ``nt`` layout only prices every layout at the ``nt`` rates.

A linear's backward is two GEMMs of the same FLOPs with the dims permuted: the input's gradient
``dX[m, k] = dY[m, n] @ W[n, k]`` is the shape ``(m, k, n)`` (rows ``m``, columns ``k``, inner
``n``), the weight's ``dW[n, k] = dY^T[n, m] @ X[m, k]`` is ``(n, k, m)``; the cost model prices each
at its own shape and layout (:meth:`hidup.search.cost.CostModel.gemm_shape`).

Measured shapes
---------------
Between grid points the interpolation can be far off: cuBLAS picks its kernel by the exact shape, and
a dim of ``768`` (between ``512`` and ``1024``) or a leading dim that is not a multiple of 16 bytes (a
vocabulary of 30522) can run on a slower kernel than either neighbour.  A grid may therefore also
hold *points*: GEMMs timed at exact ``(layout, m, n, k)`` shapes (``exp/gemm_check.py --points``
times the GEMMs of given plans, operands cold in memory as inside a training step).  A point is the
rate of its shape in its layout and takes precedence over the interpolation; every other shape is
interpolated from the grid alone:

    rate(m, n, k, layout) = points[(layout, m, n, k)]   if measured, else the interpolation above

Serialized in a profile's ``gemm`` field as ``{dtype: {"sizes": [s0, s1, ...], "rates": [...],
"nn": [...], "tn": [...], "points": [[layout, m, n, k, rate], ...]}}`` with ``rates`` the ``nt``
layout's, each list in ``(m, n, k)`` order, ``k`` fastest; ``nn``, ``tn`` and ``points`` are optional.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["GemmGrid", "LAYOUTS"]

LAYOUTS = ("nt", "nn", "tn")  # module docstring; "nt" is the grid's ``rates``


@dataclass(frozen=True)
class GemmGrid:
    """Rates [FLOP/s] of the GEMMs ``(m, n, k)`` for ``m, n, k`` in ``sizes`` (module docstring)."""

    sizes: tuple[int, ...]
    rates: tuple[float, ...]  # the nt layout's; len(sizes) ** 3, (m, n, k) order, k fastest
    layouts: tuple[tuple[str, tuple[float, ...]], ...] = ()  # (layout, rates) of the measured "nn", "tn"
    points: tuple[tuple[str, int, int, int, float], ...] = ()  # (layout, m, n, k, rate) measured exactly

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise ValueError(f"GEMM grid sizes must be distinct positive integers, increasing; got {self.sizes}")
        extra = dict(self.layouts)
        if len(extra) != len(self.layouts) or set(extra) - set(LAYOUTS[1:]):
            raise ValueError(f"GEMM grid layouts must be distinct ones of {LAYOUTS[1:]}, got {list(extra)}")
        for name, rates in self.by_layout.items():
            if len(rates) != len(self.sizes) ** 3:
                want = len(self.sizes) ** 3
                raise ValueError(f"GEMM grid of {len(self.sizes)} sizes needs {want} rates ({name}), got {len(rates)}")
            if not all(r > 0 and math.isfinite(r) for r in rates):
                raise ValueError(f"GEMM grid {name} rates must be positive and finite")
        exact = {}
        for point in self.points:
            layout, *dims, rate = point
            if layout not in LAYOUTS or len(dims) != 3 or not all(isinstance(d, int) and d > 0 for d in dims):
                raise ValueError(f"GEMM point must be [layout of {LAYOUTS}, m, n, k, rate], got {list(point)}")
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"GEMM point {list(point)}: the rate must be positive and finite")
            exact[(layout, *dims)] = float(rate)
        object.__setattr__(self, "_points", exact)
        object.__setattr__(self, "_logs", tuple(math.log(s) for s in self.sizes))
        logs = {name: tuple(math.log(r) for r in rates) for name, rates in self.by_layout.items()}
        object.__setattr__(self, "_log_rates", logs)

    @staticmethod
    def of(sizes, by_layout: dict, points=()) -> "GemmGrid":
        """The grid of ``by_layout`` (layout -> its rates; ``nt`` required, ``nn`` and ``tn`` optional) and
        the exact ``points`` (``(layout, m, n, k, rate)``, module docstring)."""
        others = tuple((name, tuple(r)) for name, r in by_layout.items() if name != "nt")
        return GemmGrid(tuple(sizes), tuple(by_layout["nt"]), others, tuple(tuple(p) for p in points))

    def with_points(self, points) -> "GemmGrid":
        """This grid with ``points`` (``(layout, m, n, k, rate)``) added; a new point replaces an old one
        of the same shape and layout."""
        merged = {(p[0], *p[1:4]): p for p in (*self.points, *(tuple(p) for p in points))}
        return GemmGrid.of(self.sizes, self.by_layout, sorted(merged.values()))

    @property
    def by_layout(self) -> dict[str, tuple[float, ...]]:
        """Layout -> its rates, for the layouts measured (``nt`` first)."""
        return {"nt": self.rates, **dict(self.layouts)}

    def _at(self, logs: tuple[float, ...], i: int, j: int, h: int) -> float:
        n = len(self.sizes)
        return logs[(i * n + j) * n + h]

    def _bracket(self, x: float) -> tuple[int, int, float]:
        """(lower index, upper index, weight of the upper) of size ``x`` on the grid, clamped."""
        logs = self._logs
        if x <= self.sizes[0]:
            return 0, 0, 0.0
        if x >= self.sizes[-1]:
            return len(logs) - 1, len(logs) - 1, 0.0
        hi = bisect.bisect_right(self.sizes, x)
        lo = hi - 1
        return lo, hi, (math.log(x) - logs[lo]) / (logs[hi] - logs[lo])

    def rate(self, m: float, n: float, k: float, layout: str = "nt") -> float:
        """FLOP/s of the GEMM ``(m, n, k)`` in ``layout``: trilinear in the logs (module docstring); the
        ``nt`` rates where the grid has no rates of ``layout``."""
        if layout not in LAYOUTS:
            raise ValueError(f"GEMM layout must be one of {LAYOUTS}, got {layout!r}")
        exact = self._points.get((layout, m, n, k)) if self._points else None
        if exact is not None:
            return exact
        logs = self._log_rates.get(layout, self._log_rates["nt"])
        (i0, i1, wi), (j0, j1, wj), (l0, l1, wl) = self._bracket(m), self._bracket(n), self._bracket(k)
        total = 0.0
        for i, a in ((i0, 1.0 - wi), (i1, wi)):
            for j, b in ((j0, 1.0 - wj), (j1, wj)):
                for h, c in ((l0, 1.0 - wl), (l1, wl)):
                    if a * b * c:
                        total += a * b * c * self._at(logs, i, j, h)
        return math.exp(total)

    def scaled(self, factor: float) -> "GemmGrid":
        """Every rate times ``factor`` (a perturbed profile keeps the grid's shape)."""
        by_layout = {name: [r * factor for r in rates] for name, rates in self.by_layout.items()}
        return GemmGrid.of(self.sizes, by_layout, [(*p[:4], p[4] * factor) for p in self.points])

    def to_dict(self) -> dict:
        points = {"points": [list(p) for p in self.points]} if self.points else {}
        return {"sizes": list(self.sizes), "rates": list(self.rates), **{n: list(r) for n, r in self.layouts}, **points}

    @classmethod
    def from_dict(cls, d: object) -> "GemmGrid":
        """Build from :meth:`to_dict`'s form; ``ValueError`` naming what is wrong."""
        if not isinstance(d, dict) or not {"sizes", "rates"} <= set(d) <= {"sizes", "rates", "points", *LAYOUTS[1:]}:
            raise ValueError(
                'expected {"sizes": [...], "rates": [...]} and optionally "nn": [...], "tn": [...], "points": [...]'
            )
        sizes = d["sizes"]
        if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ValueError(f"sizes must be a list of integers, got {sizes!r}")
        by_layout = {}
        for key in ("rates", *(n for n in LAYOUTS[1:] if n in d)):
            rates = d[key]
            numbers = all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates or ())
            if not isinstance(rates, list) or not numbers:
                raise ValueError(f"{key} must be a list of numbers")
            by_layout["nt" if key == "rates" else key] = [float(r) for r in rates]
        points = d.get("points", [])
        if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 5 for p in points):
            raise ValueError("points must be a list of [layout, m, n, k, rate]")
        return cls.of(sizes, by_layout, [tuple(p) for p in points])
