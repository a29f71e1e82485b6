"""Which parameters travel in autocast's low dtype: the mixed-precision policy of weight gathers.

Under autocast (``--precision bf16`` / ``fp16``) a float32 weight stored split is gathered for its
use, and the op using it -- a matmul, which autocast runs in the low dtype -- casts the gathered
copy to that dtype elementwise.  Casting the slices before the collective instead gives the same
values and moves half the bytes; the gradient is cast back to float32 before its adjoint
collective, so it is summed over ranks in float32 exactly as without the cast
(:func:`hidup.codegen.collectives.convert_cast`; FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``).  That holds only where *every* use of the gathered copy casts it: a
parameter qualifies when it is float32 and each path from it through view ops (``t``, ``view``,
``transpose``, ...) ends in an op of :data:`AUTOCAST_LOW_OPS`.  A norm's weight, an embedding table
or a bias added in float32 do not qualify and travel in float32.

The code generator casts a qualifying parameter's conversion when it runs one collective (a
one-axis plan, or a mesh layout change of one communicating step; a chain of several steps and a
parameter resharded after the forward keep float32), and the cost model prices the same
conversions at the low dtype's bytes forward and float32 backward (:mod:`hidup.search.cost`).
"""

from __future__ import annotations

from hidup.ir import FORM_CHANGE_OPS, Graph
from hidup.rules.fusion import fusion_kind

__all__ = ["AUTOCAST_LOW_OPS", "wire_low_params", "casts_on_wire", "is_collective"]

# IR ops (base names) that autocast runs in its low dtype, casting their float32 inputs: the
# matmuls, convolutions and the routed experts (whose grouped GEMMs run in autocast's dtype)
AUTOCAST_LOW_OPS = frozenset(
    {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "conv1d", "conv2d", "routed_experts"}
)


def wire_low_params(graph: Graph) -> frozenset[int]:
    """Tensor ids of the float32 parameters of ``graph`` whose every use, through view ops, is an op of
    :data:`AUTOCAST_LOW_OPS` (module docstring)."""
    users: dict[int, list] = {}
    for n in graph.nodes:
        for t in n.inputs:
            users.setdefault(t, []).append(n)

    def only_low(tid: int, seen: set[int]) -> bool:
        if tid in seen:
            return True
        seen.add(tid)
        uses = users.get(tid, [])
        for n in uses:
            if n.op != "call":
                return False
            if fusion_kind(n.target) == "view":
                if not all(only_low(t, seen) for t in n.outputs):
                    return False
            elif n.target.split(".", 1)[0] not in AUTOCAST_LOW_OPS:
                return False
        return bool(uses)

    return frozenset(
        tid
        for tid, t in graph.tensors.items()
        if t.is_param and t.dtype == "float32" and t.requires_grad and only_low(tid, set())
    )


def is_collective(op: str) -> bool:
    """Whether form-change op ``op`` (:data:`hidup.ir.FORM_CHANGE_OPS`) communicates."""
    return bool(FORM_CHANGE_OPS[op].collective)


def casts_on_wire(forward_ops) -> bool:
    """Whether a layout change of a qualifying parameter whose steps run ``forward_ops`` sends its
    slices in the low dtype: exactly one of the ops is a collective (module docstring); that one is
    cast, the others are local."""
    return sum(map(is_collective, forward_ops)) == 1
