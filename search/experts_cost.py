"""Physical price of the routed-experts op (:mod:`hidup.rules.experts`) on one rank.

A rank runs the op's grouped math (:func:`hidup.rules.experts.routed_experts_math`) on its local
shapes ``x[T,D]``, ``top_k_index[T,k]``, ``gate_up_proj[E_l,2F,D]``, ``down_proj[E_l,D,F]`` of a layer
of ``E`` experts.  Routing is *assumed balanced*: every expert gets ``T k / E`` of the ``S = T k``
(token, slot) rows, so the rank's ``E_l`` experts get ``V = S E_l / E`` of them.  The other
``S - V`` rows (other ranks' experts under the expert signature, the all-gather dispatcher) are
sorted last and skipped by the grouped GEMMs and by the row steps around them
(:mod:`hidup.rules.expert_rows`), which read the count of own rows on the device.

GEMMs, each expert one GEMM at its own shape (``m = V / E_l`` rows; ``g(m, n, k, layout)`` the
profile's GEMM grid, else its rate at the GEMM's FLOPs)::

    forward  = E_l [g(m, 2F, D, nt) + g(m, D, F, nt)]
    backward = E_l [g(m, D, 2F, nn) + g(2F, D, m, tn) + g(m, F, D, nn) + g(D, F, m, tn)]

(the input and the weight gradient of both projections).  Passes over the rows, with ``c`` the
compute dtype's bytes (autocast's), ``b_x`` x's::

    cast    T D (b_x + c)           x in the compute dtype (none when b_x = c)
    gather  2 V D c                 each own row's token
    gate    3 V F c                 act(gate) * up
    combine V D c + T D b_x         the own rows, weighted, summed per token over its k slots

each its own kernel, compiled or not (the row steps are custom ops).  The backward streams each
pass's bytes twice (it reads the gradient and a saved input and writes a gradient).  Then::

    t_fwd = forward GEMMs + B / memory_bandwidth + n o,    t_bwd = backward GEMMs + 2 B / memory_bandwidth + 2 n o

with ``B`` the bytes of the passes, ``n`` the kernels (GEMMs and passes, plus the sort) and ``o``
the profile's per-op cost.  A profile's measured time of the op at its local shapes
(``exp/op_check.py``, ``hidup profile --ops-model``) takes precedence
(:meth:`hidup.search.cost.CostModel.measured`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ExpertsShape", "experts_seconds", "PASSES"]

# the passes over the rows, by name (their bytes: ExpertsShape.pass_bytes; module docstring)
PASSES = ("cast", "gather", "gate", "combine")


@dataclass(frozen=True)
class ExpertsShape:
    """One rank's routed-experts call: local tokens, hidden, width, top-k, experts held and in the
    layer, and the bytes of the compute dtype and of x."""

    tokens: int
    hidden: int
    ffn: int
    k: int
    local_experts: int
    experts: int
    compute_bytes: int
    x_bytes: int

    @property
    def rows(self) -> int:
        return self.tokens * self.k

    @property
    def rows_per_expert(self) -> float:
        return self.rows / self.experts

    @property
    def own_rows(self) -> float:
        """``V``: the rows of the rank's experts under balanced routing."""
        return self.rows * self.local_experts / self.experts

    def pass_bytes(self, name: str) -> float:
        """Bytes one pass over the rows reads and writes (module docstring)."""
        v, t, d, f = self.own_rows, self.tokens, self.hidden, self.ffn
        c, bx = self.compute_bytes, self.x_bytes
        return {
            "cast": t * d * (bx + c) if bx != c else 0.0,
            "gather": 2 * v * d * c,
            "gate": 3 * v * f * c,
            "combine": v * d * c + t * d * bx,
        }[name]

    def moved_bytes(self) -> float:
        """Bytes of every pass over the rows in one forward."""
        return sum(self.pass_bytes(p) for p in PASSES)


def experts_seconds(
    shape: ExpertsShape,
    gemm: Callable[[tuple[int, int, int], str], float],
    memory_bandwidth: float,
    op_overhead: float,
    needs_backward: bool,
) -> tuple[float, float]:
    """(forward, backward) seconds of the op on one rank (module docstring); ``gemm((m, n, k), layout)``
    prices one GEMM."""
    e_l, d, f = shape.local_experts, shape.hidden, shape.ffn
    m = max(1, round(shape.rows_per_expert))
    gemms_fwd = e_l * (gemm((m, 2 * f, d), "nt") + gemm((m, d, f), "nt"))
    moved = shape.moved_bytes()
    kernels = 2 + 1 + len(PASSES)  # GEMMs, the sort, passes
    stream = moved / memory_bandwidth if memory_bandwidth else 0.0
    fwd = gemms_fwd + stream + kernels * op_overhead
    if not needs_backward:
        return fwd, 0.0
    gemms_bwd = e_l * (
        gemm((m, d, 2 * f), "nn") + gemm((2 * f, d, m), "tn") + gemm((m, f, d), "nn") + gemm((d, f, m), "tn")
    )
    return fwd, gemms_bwd + 2 * stream + 2 * kernels * op_overhead
