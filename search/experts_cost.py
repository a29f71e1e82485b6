"""Physical price of the routed-experts op (:mod:`hidup.rules.experts`) on one rank.

A rank runs the op's grouped math (:func:`hidup.rules.experts.routed_experts_math`) on its local
shapes ``x[T,D]``, ``top_k_index[T,k]``, ``gate_up_proj[E_l,2F,D]``, ``down_proj[E_l,D,F]`` of a layer
of ``E`` experts.  Routing is *assumed balanced*: every expert gets ``T k / E`` of the ``S = T k``
(token, slot) rows, so the rank's ``E_l`` experts get ``V = S E_l / E`` of them.  The other
``S - V`` rows (other ranks' experts under the expert signature, the all-gather dispatcher) are
sorted last, skipped by the grouped GEMMs but stored and streamed by every pass over the rows.

GEMMs, each expert one GEMM at its own shape (``m = V / E_l`` rows; ``g(m, n, k, layout)`` the
profile's GEMM grid, else its rate at the GEMM's FLOPs)::

    forward  = E_l [g(m, 2F, D, nt) + g(m, D, F, nt)]
    backward = E_l [g(m, D, 2F, nn) + g(2F, D, m, tn) + g(m, F, D, nn) + g(D, F, m, tn)]

(the input and the weight gradient of both projections).  Passes over the rows, with ``c`` the
compute dtype's bytes (autocast's), ``b_x`` x's and ``b_w`` the routing weights' promoted with
``c``; compiled (inductor fuses each into one kernel)::

    gather  S D (b_x + c)           x's rows in pair order, masked, cast
    gate    3 S F c                 act(gate) * up
    combine S D c + T D b_x         masked, weighted, back in token order, summed over the k slots

and eagerly each op is its own pass (:data:`EAGER_PASSES`).  The backward streams each pass's bytes
twice (it reads the gradient and a saved input and writes a gradient).  Then::

    t_fwd = forward GEMMs + B / memory_bandwidth + n o,    t_bwd = backward GEMMs + 2 B / memory_bandwidth + 2 n o

with ``B`` the bytes of the passes, ``n`` the kernels (GEMMs and passes, plus the sort) and ``o``
the profile's per-op cost.  A profile's measured time of the op at its local shapes
(``exp/op_check.py``, ``hidup profile --ops-model``) takes precedence
(:meth:`hidup.search.cost.CostModel.measured`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ExpertsShape", "experts_seconds", "EAGER_PASSES", "COMPILED_PASSES"]

# the passes over the rows, by name (their bytes: ExpertsShape.pass_bytes; module docstring)
COMPILED_PASSES = ("gather", "gate", "combine")
EAGER_PASSES = ("index", "cast_in", "mask", "act", "mul", "mask", "weight", "inverse", "sum", "cast_out")


@dataclass(frozen=True)
class ExpertsShape:
    """One rank's routed-experts call: local tokens, hidden, width, top-k, experts held and in the
    layer, and the bytes of the compute dtype, of x and of the weighted rows."""

    tokens: int
    hidden: int
    ffn: int
    k: int
    local_experts: int
    experts: int
    compute_bytes: int
    x_bytes: int
    weighted_bytes: int

    @property
    def rows(self) -> int:
        return self.tokens * self.k

    @property
    def rows_per_expert(self) -> float:
        return self.rows / self.experts

    def pass_bytes(self, name: str) -> float:
        """Bytes one pass over the rows reads and writes (module docstring)."""
        s, t, d, f = self.rows, self.tokens, self.hidden, self.ffn
        c, bx, bw = self.compute_bytes, self.x_bytes, self.weighted_bytes
        return {
            "gather": s * d * (bx + c),
            "gate": 3 * s * f * c,
            "combine": s * d * c + t * d * bx,
            "index": 2 * s * d * bx,
            "cast_in": s * d * (bx + c),
            "mask": 2 * s * d * c,
            "act": 2 * s * f * c,
            "mul": 3 * s * f * c,
            "weight": s * d * (c + bw),
            "inverse": 2 * s * d * bw,
            "sum": s * d * bw + t * d * bw,
            "cast_out": t * d * (bw + bx),
        }[name]

    def moved_bytes(self, compiled: bool) -> float:
        """Bytes of every pass over the rows in one forward, compiled or eager."""
        return sum(self.pass_bytes(p) for p in (COMPILED_PASSES if compiled else EAGER_PASSES))


def experts_seconds(
    shape: ExpertsShape,
    gemm: Callable[[tuple[int, int, int], str], float],
    memory_bandwidth: float,
    op_overhead: float,
    compiled: bool,
    needs_backward: bool,
) -> tuple[float, float]:
    """(forward, backward) seconds of the op on one rank (module docstring); ``gemm((m, n, k), layout)``
    prices one GEMM."""
    e_l, d, f = shape.local_experts, shape.hidden, shape.ffn
    m = max(1, round(shape.rows_per_expert))
    gemms_fwd = e_l * (gemm((m, 2 * f, d), "nt") + gemm((m, d, f), "nt"))
    moved = shape.moved_bytes(compiled)
    kernels = 2 + 1 + (len(COMPILED_PASSES) if compiled else len(EAGER_PASSES))  # GEMMs, the sort, passes
    stream = moved / memory_bandwidth if memory_bandwidth else 0.0
    fwd = gemms_fwd + stream + kernels * op_overhead
    if not needs_backward:
        return fwd, 0.0
    gemms_bwd = e_l * (
        gemm((m, d, 2 * f), "nn") + gemm((2 * f, d, m), "tn") + gemm((m, f, d), "nn") + gemm((d, f, m), "tn")
    )
    return fwd, gemms_bwd + 2 * stream + 2 * kernels * op_overhead
