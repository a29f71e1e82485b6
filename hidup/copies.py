"""When duplication is exact: the two copies as a second, local axis of sharding.

Duplication runs a rank's program twice, each time on one half of the batch (copy ``c`` holds
rows ``c`` of every batch input), and adds the two losses.  That is exact exactly when the loss is
the sum of a *partial* loss per copy -- the copy axis is a split of size 2, and the loss must come
out of it in ``reduce`` form, as it must come out of the ranks.  This module decides that by
propagating one form per tensor along the copy axis through the traced graph, with the same
signatures the rules give the ranks (a signature says how forms flow through an op whatever the
split count):

* a batch input is ``gather_d`` on its batch dim ``d``, any other input and every parameter ``full``;
* a node takes the signature whose input forms are the copy forms of its inputs, and its outputs
  get that signature's output forms (``sum`` over the batch dim: ``gather_0 -> reduce``; a linear
  layer keeps ``gather_0``; ``div(reduce, full) -> reduce``);
* where no signature fits as the forms stand, a ``reduce`` input that carries no gradient (a count of
  labels, say) may become ``full`` by adding the two copies' values: the copies' programs are run
  first on the side (:mod:`hidup.codegen.rewrite`) to compute it, and both use the sum; and a
  ``full`` input without gradient may be taken as split (see :func:`_adapted`).  Any other
  mismatch -- a ``gather`` needed ``full`` (the op needs the whole batch at once), a ``reduce`` that
  carries a gradient needed ``full`` (``mean(x) ** 2``) -- makes duplication inexact, and the reason
  names the node;
* the loss must end ``reduce``.

A ``mean`` whose copy-axis signature turns a ``gather`` input into a ``reduce`` output averages over
half the batch in each copy; its value is halved (``scaled``) so that the copies' partial means sum
to the mean over the whole batch, as a rank's local mean is scaled by ``1/N``.  Everything here
reads the IR (:class:`hidup.ir.Graph`) only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hidup.ir import FULL, REDUCE, Form, Graph, Node, Signature, gather

__all__ = ["CopyAxis", "copy_axis", "MEAN_TARGETS"]

# IR target names of means (torch.mean / Tensor.mean from torch.fx, aten.mean.* from torch.export)
MEAN_TARGETS = frozenset({"mean", "mean.dim", "scaled_mean"})


@dataclass
class CopyAxis:
    """Result of :func:`copy_axis`: ``reason`` is empty when duplication is exact."""

    reason: str = ""
    forms: dict[int, Form] = field(default_factory=dict)
    summed: set[int] = field(default_factory=set)  # tensors whose two copies are added before use
    scaled: dict[str, float] = field(default_factory=dict)  # node name -> factor on its outputs

    @property
    def exact(self) -> bool:
        return not self.reason


def _plain(f: Form) -> Form:
    return FULL if f.kind == "replicate" else f


def _one_axis(node: Node) -> list[Signature]:
    """The node's signatures for one axis of ranks: on a mesh, the distinct outer-axis factors (the
    rule's own signatures for the whole op), which say how forms flow whatever the split count."""
    if not any(s.axes for s in node.signatures):
        return node.signatures
    return list(dict.fromkeys(s.axes[0] for s in node.signatures if s.axes))


def _fitting(node: Node, forms: tuple[Form, ...]) -> Signature | None:
    for s in _one_axis(node):
        if tuple(_plain(f) for f in s.inputs) == forms:
            return s
    return None


def _adapted(node: Node, forms: tuple[Form, ...], grad: dict[int, bool]) -> Signature | None:
    """The first signature the inputs reach without a gradient crossing the copies: a ``reduce``
    input without gradient summed over the copies, or a ``full`` one taken as split.  The second
    holds because a ``full`` tensor reads no batch input: if it has a batch-sized dim, it was built
    from constants at the copy's half batch (an expanded buffer, the embedding of constant token
    types) and has the same rows in both copies, so each copy holding its half is the split."""
    for s in _one_axis(node):
        if all(
            _plain(want) == have
            or (have == REDUCE and _plain(want) == FULL and not grad[t])
            or (have == FULL and want.is_gather)
            for t, want, have in zip(node.inputs, s.inputs, forms)
        ):
            return s
    return None


def copy_axis(graph: Graph, batch_dims: dict[str, int | None] | None = None) -> CopyAxis:
    """Copy-axis forms of ``graph`` (see module docstring); ``batch_dims`` maps an input node's name
    to its batch dim (default 0; None keeps the input whole in both copies)."""
    batch_dims = batch_dims or {}
    out = CopyAxis()
    grad: dict[int, bool] = {}
    for node in graph.nodes:
        if node.op == "input":
            tid = node.outputs[0]
            d = batch_dims.get(node.name, 0)
            shape = graph.tensors[tid].shape
            out.forms[tid] = gather(d) if d is not None and d < len(shape) and shape[d] > 1 else FULL
            grad[tid] = False
        elif node.op == "param":
            tid = node.outputs[0]
            out.forms[tid] = FULL
            grad[tid] = graph.tensors[tid].requires_grad
        elif node.op == "call":
            forms = tuple(out.forms[t] for t in node.inputs)
            sig = _fitting(node, forms)
            if sig is None:
                sig = _adapted(node, forms, grad)
                if sig is None:
                    return CopyAxis(_why(node, forms, grad), out.forms)
                out.summed |= {
                    t for t, f, want in zip(node.inputs, forms, sig.inputs) if f == REDUCE and _plain(want) == FULL
                }
            carries = any(grad[t] for t in node.inputs) or any(graph.tensors[t].requires_grad for t in node.outputs)
            for tid, f in zip(node.outputs, sig.outputs):
                out.forms[tid] = f
                grad[tid] = carries
            if node.target in MEAN_TARGETS and any(f.is_gather for f in sig.inputs) and REDUCE in sig.outputs:
                out.scaled[node.name] = 0.5
        elif node.op == "output":
            loss = node.inputs[0]
            if out.forms[loss] != REDUCE:
                return CopyAxis(
                    f"the loss ({graph.tensors[loss].producer}) is {out.forms[loss]} across the two "
                    "copies, not a sum of a part per copy: it does not reduce over the batch",
                    out.forms,
                )
    return out


def _why(node: Node, forms: tuple[Form, ...], grad: dict[int, bool]) -> str:
    need = []
    for t, f in zip(node.inputs, forms):
        if f.is_gather:
            need.append(f"input {t} is split by batch ({f}) but no signature of the op takes it so")
        elif f == REDUCE:
            need.append(f"input {t} is a partial sum per copy{' carrying a gradient' if grad[t] else ''}")
    where = f"{node.name} ({node.target}{' at ' + node.source if node.source else ''})"
    return (
        f"node {where} cannot run on half the batch in each copy: {'; '.join(need) or 'no signature fits'}. "
        "The two copies would each see only their half, so duplication is off for this model"
    )
