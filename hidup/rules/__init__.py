"""Sharding rules: for each traced op, the ways it may run on N ranks and what each rank runs.

    rule = find_rule(torch.nn.functional.linear)
    sigs = signatures(ctx)            # list[Signature], or None when no rule knows the op
    call = localize(ctx, sigs[1], 0)  # LocalCall: what rank 0 runs under that signature

Rules are written in the dimension notation of :mod:`hidup.rules.notation` wherever it can express
the op (``dims("...k, nk, n -> ...n")`` for ``linear``) and verified by the simulated-SPMD property
test in ``tests/test_rules.py``: for every signature the per-rank forward rebuilds the unsplit
output and the per-rank backward, under the gradient convention of :mod:`hidup.ir`, rebuilds the
unsplit input gradients.

Op families live in one module each: elementwise, matmul (linear/matmul/bmm/baddbmm/einsum), shape
(view/reshape/transpose/...), indexing (getitem/split/chunk/cat/stack), reduction (sum/mean), norm
(layer_norm/rms_norm/softmax), attention, embedding, loss, conv, leaf (custom ops declared sharded
along the batch), experts (the routed experts of third-party MoE models as one custom op, and
``topk``), and aten (the ATen overloads of an exported graph mapped onto those rules).
"""

from __future__ import annotations

from typing import Any

from hidup.ir import FULL, Signature

# Op families register themselves on import; aten maps the ATen overloads of torch.export graphs onto
# their rules, looked up when a node is annotated, so the order of these imports does not matter.
from hidup.rules import (  # noqa: F401  (imported for registration)
    aten,
    attention,
    conv,
    elementwise,
    embedding,
    experts,
    indexing,
    leaf,
    loss,
    matmul,
    norm,
    random,
    reduction,
    shape,
)
from hidup.rules.base import LocalCall, Rule, RuleContext, TensorMeta
from hidup.rules.embedding import vocab_parallel_embedding
from hidup.rules.leaf import declare_batch_op
from hidup.rules.notation import Dims, SpecError, dims, shard_signatures
from hidup.rules.reduction import scaled_mean
from hidup.rules.registry import Unsupported, default_localize, lookup

__all__ = [
    "find_rule",
    "signatures",
    "variant",
    "localize",
    "kernel_of",
    "declare_batch_op",
    "dims",
    "Dims",
    "shard_signatures",
    "SpecError",
    "RuleError",
    "Unsupported",
    "Rule",
    "RuleContext",
    "TensorMeta",
    "LocalCall",
    "vocab_parallel_embedding",
    "scaled_mean",
]


class RuleError(ValueError):
    """A rule returned signatures that do not fit its node (a bug in the rule)."""


def find_rule(target: Any) -> Rule | None:
    """The rule for a graph target (an ATen or custom op overload, a function or a method name)."""
    return lookup(target)


def signatures(ctx: RuleContext) -> list[Signature] | None:
    """Every valid signature of the node described by ``ctx``; the all-``full`` one comes first.

    ``None`` when no rule handles the op (or this particular call pattern): replicate it.
    """
    rule = find_rule(ctx.target)
    if rule is None:
        return None
    try:
        sigs = rule.signatures(ctx)
    except Unsupported:
        return None
    _validate(ctx, rule, sigs)
    return sigs


def variant(ctx: RuleContext) -> str:
    """The kernel variant the node described by ``ctx`` runs, where a non-tensor argument changes its
    cost (``causal``/``masked`` attention: :mod:`hidup.rules.attention`); empty when its rule names
    none or it has no rule."""
    rule = find_rule(ctx.target)
    if rule is None or rule.variant is None:
        return ""
    try:
        return rule.variant(ctx)
    except Unsupported:
        return ""


def localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """What rank ``rank`` runs for the node under ``sig`` (tensor args kept as given in ``ctx``)."""
    rule = find_rule(ctx.target)
    if rule is None:
        if all(f == FULL for f in sig.inputs + sig.outputs):
            return default_localize(ctx, sig, rank)
        raise RuleError(
            f"node {ctx.node_name or ctx.target!r}: no rule for target {ctx.target!r}, "
            f"so only the all-full signature can run, not {sig}"
        )
    if rule.localize is None:
        return default_localize(ctx, sig, rank)
    return rule.localize(ctx, sig, rank)


def kernel_of(target: Any) -> Any:
    """What runs a local call of ``target``: its rule's ``kernel`` where it names one, else the target."""
    rule = find_rule(target)
    return rule.kernel if rule is not None and rule.kernel is not None else target


def _validate(ctx: RuleContext, rule: Rule, sigs: list[Signature]) -> None:
    where = f"rule {rule.name!r} at node {ctx.node_name or ctx.target!r}"
    full = Signature(tuple(FULL for _ in ctx.inputs), tuple(FULL for _ in ctx.outputs))
    if not any(s.inputs == full.inputs and s.outputs == full.outputs for s in sigs):
        raise RuleError(f"{where}: the all-full signature is missing; every rule must offer it")
    for s in sigs:
        if len(s.inputs) != len(ctx.inputs) or len(s.outputs) != len(ctx.outputs):
            raise RuleError(
                f"{where}: signature {s} has {len(s.inputs)}/{len(s.outputs)} forms for "
                f"{len(ctx.inputs)} inputs / {len(ctx.outputs)} outputs"
            )
        for f, m in list(zip(s.inputs, ctx.inputs)) + list(zip(s.outputs, ctx.outputs)):
            if f.is_gather and (f.dim >= len(m.shape) or m.shape[f.dim] % ctx.world):
                raise RuleError(
                    f"{where}: signature {s} splits shape {m.shape} as {f}, which {ctx.world} ranks do not divide"
                )
