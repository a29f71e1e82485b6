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

Gradients reduced in bf16 (``reduce_dtype``)
--------------------------------------------
By default every sum over ranks of a float32 parameter's gradient runs in float32.  With
``reduce_dtype="bf16"`` (:data:`REDUCE_DTYPES`; FSDP2's ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``,
Megatron's bf16 gradient reduction) each of them -- the bucketed all-reduces of the replicated
parameters (:mod:`hidup.codegen.grads`), ZeRO-2's reduce-scatters (:mod:`hidup.codegen.zero`) and the
adjoint of a stored-split parameter's gather (a reduce-scatter, :func:`hidup.codegen.collectives.convert_cast`)
-- casts the gradient to bfloat16 before the collective, sums in bfloat16 on the wire, and casts the
result back to float32::

    g = float32( sum_r^{bf16} bf16(g_r) )

where ``sum^{bf16}`` rounds to bfloat16 after each addition (the order of the additions is the
collective's).  Each ``bf16(.)`` and each addition rounds by at most ``eps / 2`` relatively
(``eps = 2^-7``, bfloat16's 8-bit significand), so for ``N`` ranks
``|g - sum_r g_r| <= N eps sum_r |g_r|`` to first order (:func:`reduce_error_bound`), against float32's
``2^-23`` per step.  Half the bytes travel: the cost model prices those collectives at 2 bytes an
element, plus the two cast kernels (:mod:`hidup.search.cost`, "Gradients reduced in bf16").

It is a policy of autocast's bf16 (``precision="bf16"``): a search asked for it under any other
precision is refused (:func:`check_reduce_dtype`), and the rank program casts only while a bf16
autocast is on for the forward it runs (the module records it per forward), so a plan run in float32
reduces in float32, exactly as without the option.  The parameters it applies to are the float32
trainable ones (:func:`reduce_low_params`), resharded after the forward or not
(:mod:`hidup.codegen.reshard`).
"""

from __future__ import annotations

from hidup.errors import UserError
from hidup.ir import FORM_CHANGE_OPS, Graph
from hidup.rules.fusion import fusion_kind

__all__ = [
    "AUTOCAST_LOW_OPS",
    "REDUCE_DTYPES",
    "ReduceDtypeError",
    "wire_low_params",
    "reduce_low_params",
    "casts_on_wire",
    "is_collective",
    "is_reduction",
    "check_reduce_dtype",
    "reduce_share",
    "reduce_error_bound",
]

# the dtypes a float32 parameter's gradient may be summed over ranks in (module docstring); the first
# is the default
REDUCE_DTYPES = ("fp32", "bf16")
_REDUCE_BYTES = {"fp32": 4, "bf16": 2}
BF16_EPS = 2.0**-7  # bfloat16's machine epsilon (8-bit significand)


class ReduceDtypeError(UserError, ValueError):
    """A gradient reduce dtype that is unknown, or bf16 asked for without bf16 autocast."""


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


def is_reduction(op: str) -> bool:
    """Whether form-change op ``op`` sums over ranks (a reduce-scatter, an all-reduce, a gradient sync)."""
    return FORM_CHANGE_OPS[op].collective in ("reduce_scatter", "all_reduce")


def check_reduce_dtype(reduce_dtype: str, precision: str) -> None:
    """Refuse a ``reduce_dtype`` not in :data:`REDUCE_DTYPES`, and ``"bf16"`` under a ``precision``
    other than bf16 autocast (module docstring)."""
    if reduce_dtype not in REDUCE_DTYPES:
        raise ReduceDtypeError(
            f"reduce_dtype {reduce_dtype!r}: gradients are reduced in one of {', '.join(REDUCE_DTYPES)}"
        )
    if reduce_dtype == "bf16" and precision != "bf16":
        raise ReduceDtypeError(
            f"reduce_dtype bf16 needs bf16 autocast (precision bf16), got precision {precision!r}. Fix: add "
            "--precision bf16, or reduce in fp32 (the default)"
        )


def reduce_share(reduce_dtype: str) -> float:
    """Bytes a float32 gradient's reduction moves per float32 byte under ``reduce_dtype``."""
    return _REDUCE_BYTES[reduce_dtype] / 4


def reduce_low_params(graph: Graph) -> frozenset[int]:
    """Tensor ids of the float32 trainable parameters of ``graph``: those whose gradient reductions
    ``reduce_dtype="bf16"`` casts (module docstring)."""
    return frozenset(tid for tid, t in graph.tensors.items() if t.is_param and t.dtype == "float32" and t.requires_grad)


def reduce_error_bound(terms: int, magnitude: float) -> float:
    """First-order bound on ``|sum in bf16 - exact sum|`` of ``terms`` float32 values whose absolute
    values add up to ``magnitude``: each input's cast and each of the ``terms - 1`` additions rounds
    by at most ``eps / 2`` relatively, and the output's cast to float32 is exact (module docstring)."""
    return terms * BF16_EPS * magnitude
