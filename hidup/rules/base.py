"""The contract between the tracer, the sharding rules and the code generator.

A *rule* answers two questions about one torch.fx node:

1. ``signatures(ctx)``: in which ways may this op run on ``ctx.world`` ranks?  It returns a list
   of :class:`hidup.ir.Signature`, each with one form per tensor input (in ``ctx.inputs`` order)
   and one per tensor output (in ``ctx.outputs`` order) plus the per-rank forward FLOPs.  The
   all-``full`` signature (every rank computes the whole op) must always be among them.
2. ``localize(ctx, sig, rank)``: what does one rank run under ``sig``?  It returns a
   :class:`LocalCall` -- a target and args/kwargs in which the tensor arguments are kept as they
   came (fx Nodes in code generation, real tensors in the property tests) and only the
   non-tensor arguments are rewritten (a ``view``'s shape becomes the local shape, a ``mean``
   over a sharded dim gets a 1/N scale, a vocabulary-sharded embedding gets its own function).

Tensor inputs are the tensor-valued entries of ``(args, kwargs)`` in the order
``torch.fx.node.map_aggregate`` visits them; tensor outputs are the node's value if it is a tensor,
else the tensors of its (flat) tuple/list value in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from hidup.fxvalues import map_value
from hidup.ir import Signature


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor as seen on a single device (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", ...
    requires_grad: bool = False
    is_param: bool = False  # a parameter or buffer of the model (not an activation)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class RuleContext:
    """Everything a rule may look at.  ``args``/``kwargs`` hold :class:`TensorMeta` in place of
    tensors and plain Python values elsewhere (ints already folded to their traced values)."""

    target: Any  # the fx target: a function, a method name (str), or an nn.Module class for leaves
    args: tuple
    kwargs: dict
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    world: int
    module: Any = None  # the nn.Module instance for call_module leaves
    node_name: str = ""

    def with_tensors(self, tensors: list) -> "RuleContext":
        """This context with its :class:`TensorMeta` slots (``args`` then ``kwargs``, in fx's visiting
        order, the order of ``inputs``) holding ``tensors`` -- fx Nodes in code generation, real
        tensors when an op is timed -- so that :func:`hidup.rules.localize` returns a call on them.
        The slots are filled *before* localizing: a rule may reorder its arguments
        (``aten.embedding(weight, indices)`` runs as ``F.embedding(indices, weight)``)."""
        it = iter(tensors)
        count = 0

        def fill(v):
            nonlocal count
            if isinstance(v, TensorMeta):
                count += 1
                return next(it)
            return v

        args, kwargs = map_value(tuple(self.args), fill), map_value(dict(self.kwargs), fill)
        if count != len(tensors):
            raise ValueError(f"node {self.node_name}: its call has {count} tensor arguments, given {len(tensors)}")
        return replace(self, args=args, kwargs=kwargs)


@dataclass
class LocalCall:
    """What one rank runs: ``target(*args, **kwargs)``; for call_module leaves ``target`` is the
    (possibly rewritten) module instance."""

    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass
class Rule:
    """A registered rule.  ``localize`` defaults to running the original op unchanged; ``variant``
    (optional) names the kernel a call runs where a non-tensor argument changes its cost
    (:func:`hidup.rules.variant`); ``typical`` (optional) replaces synthetic inputs of an op's local
    shapes by values of the kind a run sees, where the op's cost depends on the values (routing indices
    spread evenly over the experts, :mod:`hidup.profiler.measure.ops`); ``kernel`` (optional) is what a rank
    runs for the op's local call where that is not the op itself (the routed experts' differentiable
    grouped math for their opaque export op): local calls keep the op as their target, so that the
    rules see it axis after axis on a mesh, and whatever runs them goes through
    :func:`hidup.rules.kernel_of`."""

    name: str
    signatures: Callable[[RuleContext], list[Signature]]
    localize: Callable[[RuleContext, Signature, int], LocalCall] | None = None
    variant: Callable[[RuleContext], str] | None = None
    typical: Callable[[RuleContext, list], list] | None = None
    kernel: Callable | None = None
