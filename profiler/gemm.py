"""The measured rate of a matmul by its shape: a grid of ``(m, n, k)`` GEMMs per dtype.

A matmul ``C[m, n] = A[m, k] @ B[k, n]`` does ``2 m n k`` FLOPs, but its rate depends on the shape,
not only on the FLOPs: a tall, skinny GEMM (``m = 8192`` tokens against ``n = k = 768``) fills the
tensor cores worse than the square matmul of equal FLOPs, and a wide one (``n = 4096``) better.  A
profile's :class:`GemmGrid` holds, for one dtype, the rate measured at every point of a grid
``sizes x sizes x sizes`` (:func:`hidup.profiler.device.gemm_grid` times ``A[m, k] @ B[n, k]^T``,
a linear's forward), and prices any shape by interpolating between the grid points:

    log rate(m, n, k) = trilinear interpolation of log rate over (log m, log n, log k)

each coordinate clamped to ``[sizes[0], sizes[-1]]`` (outside the grid a dim is priced as the
nearest measured one: a GEMM longer than the largest size runs at that size's rate).

A linear's backward is two GEMMs of the same FLOPs with the dims permuted: the input's gradient
``dX[m, k] = dY[m, n] @ W[n, k]`` is the shape ``(m, k, n)`` (rows ``m``, columns ``k``, inner
``n``), the weight's ``dW[n, k] = dY^T[n, m] @ X[m, k]`` is ``(n, k, m)``; the cost model prices each
at its own shape (:meth:`hidup.search.cost.CostModel.gemm_shape`).

Serialized in a profile's ``gemm`` field as ``{dtype: {"sizes": [s0, s1, ...], "rates": [...]}}``
with ``rates`` in ``(m, n, k)`` order, ``k`` fastest.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["GemmGrid"]


@dataclass(frozen=True)
class GemmGrid:
    """Rates [FLOP/s] of the GEMMs ``(m, n, k)`` for ``m, n, k`` in ``sizes`` (module docstring)."""

    sizes: tuple[int, ...]
    rates: tuple[float, ...]  # len(sizes) ** 3, (m, n, k) order, k fastest

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0:
            raise ValueError(f"GEMM grid sizes must be distinct positive integers, increasing; got {self.sizes}")
        if len(self.rates) != len(self.sizes) ** 3:
            raise ValueError(
                f"GEMM grid of {len(self.sizes)} sizes needs {len(self.sizes) ** 3} rates, got {len(self.rates)}"
            )
        if not all(r > 0 and math.isfinite(r) for r in self.rates):
            raise ValueError("GEMM grid rates must be positive and finite")
        object.__setattr__(self, "_logs", tuple(math.log(s) for s in self.sizes))
        object.__setattr__(self, "_log_rates", tuple(math.log(r) for r in self.rates))

    def _at(self, i: int, j: int, h: int) -> float:
        n = len(self.sizes)
        return self._log_rates[(i * n + j) * n + h]

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

    def rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s of the GEMM ``(m, n, k)``: trilinear in the logs (module docstring)."""
        (i0, i1, wi), (j0, j1, wj), (l0, l1, wl) = self._bracket(m), self._bracket(n), self._bracket(k)
        total = 0.0
        for i, a in ((i0, 1.0 - wi), (i1, wi)):
            for j, b in ((j0, 1.0 - wj), (j1, wj)):
                for h, c in ((l0, 1.0 - wl), (l1, wl)):
                    if a * b * c:
                        total += a * b * c * self._at(i, j, h)
        return math.exp(total)

    def scaled(self, factor: float) -> "GemmGrid":
        """Every rate times ``factor`` (a perturbed profile keeps the grid's shape)."""
        return GemmGrid(self.sizes, tuple(r * factor for r in self.rates))

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "rates": list(self.rates)}

    @staticmethod
    def from_dict(d: object) -> "GemmGrid":
        """Build from :meth:`to_dict`'s form; ``ValueError`` naming what is wrong."""
        if not isinstance(d, dict) or set(d) != {"sizes", "rates"}:
            raise ValueError('expected {"sizes": [...], "rates": [...]}')
        sizes, rates = d["sizes"], d["rates"]
        if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ValueError(f"sizes must be a list of integers, got {sizes!r}")
        numbers = all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates or ())
        if not isinstance(rates, list) or not numbers:
            raise ValueError("rates must be a list of numbers")
        return GemmGrid(tuple(sizes), tuple(float(r) for r in rates))
