"""Prefetched weight gathers: a stored-split parameter's form change issued one unit ahead.

A parameter stored split (``gather_d``, or a layout with a gather axis) is converted -- all-gathered,
as a rule -- right before the op that reads it, and the op waits for the collective.  FSDP2 instead
issues the next layer's all-gather while the current layer computes.  This pass does the same to a
rank program (:func:`hidup.codegen.program.build_rank_program`, ``CompileOptions.prefetch``).

Units.  The program's op nodes, in program order, fall into *units*: maximal runs of nodes of one
repeated layer (``meta[LAYER]``, :func:`hidup.ir.block_label`; the nodes outside any layer -- the
embedding, the head -- form units too), numbered by :func:`hidup.ir.prefetch_units`, which the cost
model reads as well (:mod:`hidup.search.problem`, "Prefetched gathers").  The form change of a
parameter (a chain of :func:`~hidup.codegen.program.hidup_convert` calls starting at the stored
shard, one per mesh axis on a device mesh) charged to a node of unit ``u > 0`` becomes

* ``h = hidup_prefetch(shard, chain)`` placed before the first node of unit ``u - 1``, and
* ``w = hidup_prefetch_wait(h)`` where the chain was, its users reading ``w``.

``hidup_prefetch`` runs the same chain of conversions -- the same collectives, on the process group
active then (a duplicated copy's), under autograd -- so the values, the gradient (the chain's own
backward) and the order in which every rank issues its collectives are those of the program without
prefetch: only *when* each is issued changes.  On CUDA, eagerly, the chain runs on a side stream that
first waits for the current stream, and records an event; ``hidup_prefetch_wait`` makes the current
stream wait for that event and records the copy's use on the current stream (so the allocator does not
hand its memory back to the side stream early).  The collective thus runs while the current stream
computes unit ``u - 1``; this is the fork/join pattern CUDA-graph capture accepts (no host
synchronization).  Autograd runs the chain's backward on the side stream, after its gradient is ready.
On the CPU (gloo), and under ``torch.compile``, ``hidup_prefetch`` runs the chain in place and returns
its tensor, and the wait is the identity: under compilation the conversion is the custom op
``hidup::convert`` (:mod:`hidup.codegen.compiled`), which inductor keeps in program order, so it is
issued where the pass put it, one unit early.

Under ``torch.compile`` a resharded parameter's chain is not moved: the compiled program frees its
copy by a checkpoint region the partitioner recomputes in the backward (:mod:`hidup.codegen.reshard`),
which it can do only inside the graph that reads the copy, and a prefetch may cross into an earlier
graph (a duplication stage, a gradient-bucket segment); there ``hidup_prefetch`` passes the shard on
and ``hidup_prefetch_wait`` runs the chain.

Backward.  A resharded parameter's copy is made again in the backward (:mod:`hidup.codegen.reshard`).
The pass gives each resharded conversion its unit (an argument of
:func:`~hidup.codegen.program.hidup_reshard_convert`); when the backward first unpacks a copy of unit
``u``, the copies of unit ``u - 1`` that the backward will unpack are made ahead, in the order the
forward registered them (the same on every rank): on a side stream with an event on CUDA, held until
their first unpack.  So unit ``u - 1``'s gathers run while unit ``u``'s backward computes, as FSDP2's
backward prefetch does.

Not prefetched: a form change inside a recomputed layer (its region makes it again in the backward,
:mod:`hidup.codegen.recompute`) and of a unit-0 node (nothing precedes it).

Memory: the prefetched copy of unit ``u``'s weights exists while unit ``u - 1`` runs, and in the
backward unit ``u - 1``'s resharded copies while unit ``u``'s backward runs: a resharded parameter's
copies, held one at a time without prefetch, are held two neighbouring units at a time (the memory
model counts three, :mod:`hidup.search.memory`, "Prefetched gathers"); a kept copy lives until its
backward anyway.
"""

from __future__ import annotations

import torch
import torch.fx

from hidup.codegen.compiled import LAYER
from hidup.codegen.recompute import REGION
from hidup.ir import prefetch_units

__all__ = ["CONVERTS", "hidup_prefetch", "hidup_prefetch_wait", "prefetch_gathers", "Pending"]

# name -> conversion function of the generated code that may be prefetched (hidup.codegen.program fills it)
CONVERTS: dict[str, object] = {}
# the generated code's call that starts a forward's session of resharded copies (hidup.codegen.program)
BEGIN = None

# the conversions of resharded parameters (hidup.codegen.reshard), among CONVERTS
RESHARDED = frozenset({"hidup_reshard_convert", "hidup_reshard_convert_step"})

# (device index, current stream id) -> the side stream prefetches of that stream run on
_SIDE: dict[tuple, torch.cuda.Stream] = {}


class Pending:
    """A prefetched conversion in flight on a side stream: its output and the event that ends it."""

    __slots__ = ("value", "event")

    def __init__(self, value: torch.Tensor, event):
        self.value, self.event = value, event


def _run(x: torch.Tensor, chain: tuple) -> torch.Tensor:
    for name, args, kwargs in chain:
        x = CONVERTS[name](x, *args, **dict(kwargs))
    return x


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    current = torch.cuda.current_stream(device)
    key = (device.index, current.stream_id)
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE[key] = torch.cuda.Stream(device=device)
    return side


def _deferred(chain: tuple) -> bool:
    """Whether the chain is left where it was under ``torch.compile``: a resharded parameter's, whose
    copy the partitioner makes again in the backward only inside the graph that reads it."""
    return torch.compiler.is_compiling() and any(name in RESHARDED for name, *_ in chain)


def hidup_prefetch(x: torch.Tensor, chain: tuple) -> "torch.Tensor | Pending":
    """Issue the conversions ``chain`` (``((function name, extra args, keywords), ...)``) of the shard ``x``
    (module docstring): on a side stream eagerly on CUDA, in place otherwise."""
    if _deferred(chain):
        return x
    if torch.compiler.is_compiling() or x.device.type != "cuda":
        return _run(x, chain)
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        out = _run(x, chain)
        event = torch.cuda.Event()
        event.record(side)
    return Pending(out, event)


def hidup_prefetch_wait(p: "torch.Tensor | Pending", chain: tuple) -> torch.Tensor:
    """The prefetched tensor, once the current stream may read it (the chain run here where
    :func:`hidup_prefetch` left it)."""
    if _deferred(chain):
        return _run(p, chain)
    if isinstance(p, torch.Tensor):
        return p
    current = torch.cuda.current_stream(p.value.device)
    current.wait_event(p.event)
    p.value.record_stream(current)
    return p.value


def _chain(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The conversion chain ending at ``node`` when it starts at a stored parameter (a ``get_attr``) and
    every link but the last has ``node``'s chain as its only user; else None."""
    chain = [node]
    while True:
        head = chain[0]
        if not head.args or not isinstance(head.args[0], torch.fx.Node):
            return None
        src = head.args[0]
        if src.op == "get_attr":
            return chain
        if src.op != "call_function" or getattr(src.target, "__name__", None) not in CONVERTS or len(src.users) != 1:
            return None
        chain.insert(0, src)


def prefetch_gathers(graph: torch.fx.Graph) -> int:
    """Issue every prefetchable parameter conversion of ``graph`` one unit early (module docstring);
    returns how many.  Run before the recomputed regions are outlined (their nodes carry ``REGION``)."""
    ops = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    units = prefetch_units([n.meta.get(LAYER, "") for n in ops])
    first: dict[int, torch.fx.Node] = {}
    unit_of: dict[torch.fx.Node, int] = {}
    resharded = False
    for n, u in zip(ops, units):
        first.setdefault(u, n)
        unit_of[n] = u
        if getattr(n.target, "__name__", None) in RESHARDED and n.meta.get(REGION) is None:
            n.kwargs = {**n.kwargs, "unit": u}  # its unit: the backward makes the copy again ahead of it
            resharded = True
    if resharded:  # each forward's copies are a session of their own (hidup.codegen.reshard.begin_forward)
        with graph.inserting_before(ops[0]):
            begin = graph.call_function(BEGIN, ())
        begin.meta.update({"stage": ops[0].meta.get("stage", 0), REGION: None, LAYER: ops[0].meta.get(LAYER, "")})
    # the last link of each chain: a conversion whose users are not conversions of the same chain
    ends = [
        n
        for n in ops
        if n.op == "call_function"
        and getattr(n.target, "__name__", None) in CONVERTS
        and n.meta.get(REGION) is None
        and unit_of[n] > 0
        and not (len(n.users) == 1 and getattr(next(iter(n.users)).target, "__name__", None) in CONVERTS)
    ]
    # the anchors exist until every start is placed: a chain may itself open the unit it prefetches into
    moves = []
    for end in ends:
        chain = _chain(end)
        if chain is not None and all(n.meta.get(REGION) is None for n in chain):
            moves.append((chain, first[unit_of[chain[0]] - 1]))
    starts = []
    for chain, anchor in moves:
        spec = tuple((n.target.__name__, tuple(n.args[1:]), tuple(n.kwargs.items())) for n in chain)
        with graph.inserting_before(anchor):
            shard = graph.get_attr(chain[0].args[0].target)
            start = graph.call_function(hidup_prefetch, (shard, spec))
        for new in (shard, start):
            new.meta.update({"stage": anchor.meta.get("stage", 0), REGION: None, LAYER: anchor.meta.get(LAYER, "")})
        starts.append(start)
    for (chain, _), start in zip(moves, starts):
        end, attr = chain[-1], chain[0].args[0]
        with graph.inserting_after(end):
            wait = graph.call_function(hidup_prefetch_wait, (start, start.args[1]))
        wait.meta.update({k: end.meta[k] for k in ("stage", REGION, LAYER) if k in end.meta})
        end.replace_all_uses_with(wait)
        for n in reversed(chain):
            graph.erase_node(n)
        if not attr.users:
            graph.erase_node(attr)
    return len(moves)
