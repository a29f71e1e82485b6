"""Memory per rank of a plan: the sum of independent per-node terms (so the ILP stays linear).

For a tensor ``t`` in form ``f`` on ``N`` ranks, ``local(t, f) = bytes(t) / N`` if ``f`` is
``gather_d`` else ``bytes(t)`` (``full``, ``reduce`` and ``replicate`` keep the whole tensor).

* ``param`` node producing ``t`` in form ``f``: parameters ``local(t, f)``; if ``t`` requires a
  gradient also gradients ``local(t, f)`` and optimizer state ``optimizer_factor * local(t, f)``
  (Adam keeps two moments: factor 2);
* ``input`` node: inputs ``local(t, f)``;
* ``call`` node with at least one input that requires a gradient: activations kept for the
  backward pass ``sum_j local(out_j, s.outputs[j])``;
* other nodes: 0.

Not counted: temporaries of conversions (an all-gathered weight lives only around its use),
workspace, the CUDA context and fragmentation; keep a margin below the device size.
"""

from __future__ import annotations

from dataclasses import dataclass

from hidup.ir import Graph, Node, Signature

__all__ = ["MemoryModel", "MEMORY_PARTS"]

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "inputs")


@dataclass
class MemoryModel:
    graph: Graph
    optimizer_factor: float = 2.0

    def local_bytes(self, tid: int, form) -> float:
        t = self.graph.tensors[tid]
        return t.nbytes / self.graph.world_size if form.kind == "gather" else float(t.nbytes)

    def breakdown(self, node: Node, sig: Signature) -> tuple[float, float, float, float, float]:
        """(params, grads, optimizer, activations, inputs) bytes per rank of ``node`` under ``sig``."""
        g = self.graph
        if node.op == "param":
            p = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
            grad = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs)
                       if g.tensors[t].requires_grad)
            return p, grad, self.optimizer_factor * grad, 0.0, 0.0
        if node.op == "input":
            return 0.0, 0.0, 0.0, 0.0, sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
        if node.op == "call" and any(g.tensors[t].requires_grad for t in node.inputs):
            return 0.0, 0.0, 0.0, sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs)), 0.0
        return 0.0, 0.0, 0.0, 0.0, 0.0

    def total(self, node: Node, sig: Signature) -> float:
        return sum(self.breakdown(node, sig))
