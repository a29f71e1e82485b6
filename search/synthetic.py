"""Synthetic graphs for testing and timing the search without tracing a model.

``random_graph(seed)`` builds a small random DAG: one batch input ``x`` of shape ``(B, D)``, call
nodes reading one or two earlier tensors (and sometimes a parameter of shape ``(D, D)``), each
with the all-``full`` signature plus up to ``max_sigs - 1`` random ones over the forms
``full, gather_0, gather_1, reduce``; a scalar ``loss`` node and the ``output`` node.  A signature
that shards work has per-rank FLOPs ``flops / N``.

``layered_graph(layers, nodes_per_layer)`` repeats one random block ``layers`` times in a chain
(module paths ``layers.<i>.op<j>``) with a residual tensor live across each block: the shape of a
transformer, used for the repeated-layer reuse and the search-time benchmark.
"""

from __future__ import annotations

import random

from hidup.ir import FULL, REDUCE, REPLICATE, Graph, Node, Signature, Tensor, gather

__all__ = ["random_graph", "layered_graph"]

_FORMS = (FULL, gather(0), gather(1), REDUCE)
_KINDS = ("data", "tensor", "expert", "replicated")


class _Builder:
    def __init__(self, world: int, shape: tuple[int, int], dtype: str):
        self.world, self.shape, self.dtype = world, shape, dtype
        self.nodes: list[Node] = []
        self.tensors: dict[int, Tensor] = {}

    def tensor(self, producer: str, shape=None, requires_grad=False, is_param=False) -> int:
        tid = len(self.tensors)
        self.tensors[tid] = Tensor(
            tid, tuple(self.shape if shape is None else shape), self.dtype, producer, requires_grad, is_param
        )
        return tid

    def input(self, name: str) -> int:
        t = self.tensor(name)
        sigs = [
            Signature((), (FULL,), 0.0, "replicated"),
            Signature((), (gather(0),), 0.0, "data"),
            Signature((), (gather(1),), 0.0, "data"),
        ]
        self.nodes.append(Node(name, "input", "input", [], [t], sigs))
        return t

    def param(self, name: str, module: str) -> int:
        t = self.tensor(name, requires_grad=True, is_param=True)
        sigs = [
            Signature((), (REPLICATE,), 0.0, "param"),
            Signature((), (gather(0),), 0.0, "param"),
            Signature((), (gather(1),), 0.0, "param"),
        ]
        self.nodes.append(Node(name, "param", "parameter", [], [t], sigs, module=module))
        return t

    def call(
        self,
        name: str,
        inputs: list[int],
        sigs: list[Signature],
        module: str,
        flops: float,
        target: str = "op",
        shape=None,
    ) -> int:
        rg = any(self.tensors[t].requires_grad for t in inputs)
        t = self.tensor(name, shape=shape, requires_grad=rg)
        self.nodes.append(Node(name, "call", target, list(inputs), [t], sigs, flops, module=module))
        return t


def _random_sigs(rng: random.Random, n_in: int, flops: float, world: int, count: int) -> list[Signature]:
    sigs = [Signature(tuple(FULL for _ in range(n_in)), (FULL,), flops, "replicated")]
    seen = {sigs[0].inputs + sigs[0].outputs}
    tries = 0
    while len(sigs) < count and tries < 50:
        tries += 1
        ins = tuple(rng.choice(_FORMS) for _ in range(n_in))
        out = rng.choice(_FORMS)
        if (ins + (out,)) in seen:
            continue
        seen.add(ins + (out,))
        sharded = any(f.kind != "full" for f in ins + (out,))
        sigs.append(Signature(ins, (out,), flops / world if sharded else flops, rng.choice(_KINDS)))
    return sigs


def _loss(b: _Builder, src: int) -> None:
    flops = float(b.tensors[src].numel)
    sigs = [
        Signature((FULL,), (FULL,), flops, "replicated"),
        Signature((gather(0),), (REDUCE,), flops / b.world, "data"),
        Signature((gather(1),), (REDUCE,), flops / b.world, "data"),
    ]
    loss = b.call("loss", [src], sigs, "", flops, target="sum", shape=())
    b.nodes.append(
        Node(
            "output",
            "output",
            "output",
            [loss],
            [],
            [Signature((REDUCE,), (), 0.0, "replicated"), Signature((FULL,), (), 0.0, "replicated")],
        )
    )


def random_graph(
    seed: int,
    calls: int = 5,
    world: int = 4,
    max_sigs: int = 3,
    params: bool = True,
    shape: tuple[int, int] = (256, 512),
    dtype: str = "float32",
    flops_scale: float = 1e9,
) -> Graph:
    """A random small graph (see the module docstring); same seed, same graph."""
    rng = random.Random(seed)
    b = _Builder(world, shape, dtype)
    pool = [b.input("x")]
    for i in range(calls):
        ins = rng.sample(pool, k=min(len(pool), rng.choice((1, 1, 2))))
        if params and rng.random() < 0.5:
            ins.append(b.param(f"w{i}", f"m{i}"))
        flops = flops_scale * rng.uniform(0.1, 10.0)
        sigs = _random_sigs(rng, len(ins), flops, world, rng.randint(1, max_sigs))
        pool.append(b.call(f"op{i}", ins, sigs, f"m{i}", flops))
    _loss(b, pool[-1])
    return Graph(b.nodes, b.tensors, world, model=f"random-{seed}")


def layered_graph(
    layers: int = 48,
    nodes_per_layer: int = 20,
    world: int = 4,
    sigs: tuple[int, int] = (3, 5),
    seed: int = 0,
    shape: tuple[int, int] = (1024, 1024),
    dtype: str = "float32",
    flops_scale: float = 1e10,
) -> Graph:
    """``layers`` copies of one random block of ``nodes_per_layer`` call nodes (see the docstring)."""
    rng = random.Random(seed)
    template = []  # per call: (input refs, has param, flops, signatures)
    for j in range(nodes_per_layer):
        if j == 0:
            refs = ["in"]
        elif j == nodes_per_layer - 1:
            refs = [j - 1, "in"]  # residual: the block input is live through the block
        else:
            refs = [j - 1] + ([rng.randrange(j)] if j > 1 and rng.random() < 0.3 else [])
        has_param = rng.random() < 0.4
        flops = flops_scale * rng.uniform(0.1, 4.0)
        template.append(
            (refs, has_param, flops, _random_sigs(rng, len(refs) + has_param, flops, world, rng.randint(*sigs)))
        )
    b = _Builder(world, shape, dtype)
    x = b.input("x")
    for layer in range(layers):
        outs: list[int] = []
        for j, (refs, has_param, flops, sg) in enumerate(template):
            mod = f"layers.{layer}.op{j}"
            ins = [x if r == "in" else outs[r] for r in refs]
            if has_param:
                ins.append(b.param(f"layers_{layer}_w{j}", mod))
            outs.append(b.call(f"layers_{layer}_op{j}", ins, sg, mod, flops))
        x = outs[-1]
    _loss(b, x)
    return Graph(b.nodes, b.tensors, world, model=f"layered-{layers}x{nodes_per_layer}")
