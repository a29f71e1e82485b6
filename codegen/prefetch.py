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
On the CPU (gloo), eagerly, ``hidup_prefetch`` runs the chain in place and returns its tensor, and the
wait is the identity.

Under ``torch.compile`` the one stream of the compiled program cannot fork, so the gather itself is made
asynchronous: where the chain's only collective is an all-gather (:func:`hidup.ir.async_gather_link`,
the pass records it as the call's ``link``), ``hidup_prefetch`` runs the links before it in place and
issues the all-gather as torch's functional collective (``_c10d_functional.all_gather_into_tensor``,
:func:`hidup.codegen.compiled.gather_start`), and ``hidup_prefetch_wait`` waits for it
(``wait_tensor``) and runs the links after it.  Inductor lowers the pair to a collective launched on
the process group's communication stream and a wait that makes the compute stream wait for it, with
the compute between them free to run: the compiled form of the side stream.  Its gradient is the
conversion's own backward, the reduce-scatter (cast as :func:`~hidup.codegen.collectives.convert_cast`
casts), so values and gradients are the eager program's.  Inductor's scheduler may reorder the graph
(for peak memory it hoists the waits next to their collectives), so a graph with such gathers is
compiled with inductor's pass that schedules each wait as late as its readers allow
(:data:`hidup.codegen.compiled.SINK_WAITS`); it moves only waits, the same way on every rank.  The
gather's gradient is reduce-scattered the same way in the backward, as torch's functional collective
whose wait sinks past the rest of the graph's backward (:class:`hidup.codegen.compiled._GatherStart`).  An
in-flight collective must be waited for in the graph that issued it: where the program is compiled as
several graphs (gradient-bucket segments, duplication stages, a graph break), a gather whose wait lies
in another graph is issued where it is waited for (:func:`confine_links`): blocking in the forward, its
gradient's reduce-scatter still asynchronous in the backward.  A chain with another collective (an
all-to-all, a layout change of two collectives) runs in place, one unit early, blocking.

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

import inspect

import torch
import torch.fx

from hidup.codegen import compiled
from hidup.codegen.compiled import LAYER
from hidup.codegen.recompute import REGION
from hidup.ir import Form, async_gather_link, conversion, prefetch_units

__all__ = ["CONVERTS", "hidup_prefetch", "hidup_prefetch_wait", "prefetch_gathers", "confine_links", "Pending"]

# name -> conversion function of the generated code that may be prefetched (hidup.codegen.program fills it)
CONVERTS: dict[str, object] = {}
# the generated code's call that starts a forward's session of resharded copies (hidup.codegen.program)
BEGIN = None
# (x, send, reduce) -> (dtype x travels in, dtype its gradient is summed in) or None: the casts of a
# conversion under autocast (hidup.codegen.program fills it)
CAST_DTYPES = None

# the conversions of resharded parameters (hidup.codegen.reshard), among CONVERTS
RESHARDED = frozenset({"hidup_reshard_convert", "hidup_reshard_convert_step"})

# the generated code's calls torch.compile breaks its graph at (hidup.codegen.program.hidup_copy_sum)
BREAKS = frozenset({"hidup_copy_sum"})
LINK = "prefetch_link"  # node.meta key: a prefetch's asynchronous link as the pass made it (confine_links)

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


def _start(x: torch.Tensor, chain: tuple, link: tuple) -> torch.Tensor:
    """Under compilation: the links before ``link``'s in place, then its all-gather issued, not waited for
    (the whole chain in place on torch's fake process group, whose collectives hidup mirrors)."""
    k, axis, src, cast = link
    if not compiled.gathers_async(axis):
        return _run(x, chain)
    x = _run(x, chain[:k])
    return compiled.gather_start(x, Form.parse(src).dim, axis, CAST_DTYPES(x, *cast) if cast else None)


def _finish(h: torch.Tensor, chain: tuple, link: tuple) -> torch.Tensor:
    """Under compilation: wait for :func:`_start`'s all-gather, then run the links after it."""
    k, axis, src, _ = link
    if not compiled.gathers_async(axis):
        return h
    return _run(compiled.gather_wait(h, Form.parse(src).dim), chain[k + 1 :])


def hidup_prefetch(
    x: torch.Tensor, chain: tuple, link: tuple | None = None, at_use: bool = False
) -> "torch.Tensor | Pending":
    """Issue the conversions ``chain`` (``((function name, extra args, keywords), ...)``) of the shard ``x``
    (module docstring): on a side stream eagerly on CUDA; under compilation with ``link`` (its all-gather
    link, :func:`_async_link`) as a functional collective waited for by :func:`hidup_prefetch_wait`, or
    with ``at_use`` there (:func:`confine_links`); in place otherwise."""
    if _deferred(chain):
        return x
    if torch.compiler.is_compiling():
        if link is None:
            return _run(x, chain)
        return x if at_use else _start(x, chain, link)
    if x.device.type != "cuda":
        return _run(x, chain)
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        out = _run(x, chain)
        event = torch.cuda.Event()
        event.record(side)
    return Pending(out, event)


def hidup_prefetch_wait(
    p: "torch.Tensor | Pending", chain: tuple, link: tuple | None = None, at_use: bool = False
) -> torch.Tensor:
    """The prefetched tensor, once the current stream may read it (the chain run here where
    :func:`hidup_prefetch` left it; under compilation with ``link`` the functional collective waited for,
    issued here too with ``at_use``)."""
    if _deferred(chain):
        return _run(p, chain)
    if link is not None and torch.compiler.is_compiling():
        return _finish(_start(p, chain, link) if at_use else p, chain, link)
    if isinstance(p, torch.Tensor):
        return p
    current = torch.cuda.current_stream(p.value.device)
    current.wait_event(p.event)
    p.value.record_stream(current)
    return p.value


def _async_link(chain: list[torch.fx.Node]) -> tuple | None:
    """``(index, mesh axis or None, source form, (send, reduce) or None)`` of the link of ``chain`` that a
    compiled program issues as an asynchronous all-gather (:func:`hidup.ir.async_gather_link`), the cast
    flags where it is a cast conversion; None where there is none (the chain then runs in place) or the
    parameter is resharded (its chain stays put under compilation)."""
    if any(n.target.__name__ in RESHARDED for n in chain):
        return None
    links = [inspect.signature(n.target).bind(None, *n.args[1:], **n.kwargs) for n in chain]
    for bound in links:
        bound.apply_defaults()
    ops = [conversion(Form.parse(b.arguments["src"]), Form.parse(b.arguments["dst"])).forward for b in links]
    k = async_gather_link(ops)
    if k is None:
        return None
    args = links[k].arguments
    cast = (args["send"], args["reduce"]) if "send" in args else None
    return (k, args.get("axis"), args["src"], cast)


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
        link = _async_link(chain)
        with graph.inserting_before(anchor):
            shard = graph.get_attr(chain[0].args[0].target)
            start = graph.call_function(hidup_prefetch, (shard, spec), {"link": link} if link else {})
        for new in (shard, start):
            new.meta.update({"stage": anchor.meta.get("stage", 0), REGION: None, LAYER: anchor.meta.get(LAYER, "")})
        starts.append(start)
    for (chain, _), start in zip(moves, starts):
        end, attr = chain[-1], chain[0].args[0]
        with graph.inserting_after(end):
            wait = graph.call_function(hidup_prefetch_wait, (start, start.args[1]), dict(start.kwargs))
        wait.meta.update({k: end.meta[k] for k in ("stage", REGION, LAYER) if k in end.meta})
        end.replace_all_uses_with(wait)
        for n in reversed(chain):
            graph.erase_node(n)
        if not attr.users:
            graph.erase_node(attr)
    return len(moves)


def confine_links(gm: torch.fx.GraphModule, part_of) -> int:
    """Keep the asynchronous form (``link``) of the prefetched gathers of ``gm`` whose start and wait lie
    in one compiled graph: ``part_of(node)`` names the graph torch.compile makes of each call node (a
    gradient-bucket segment, a duplication stage; a graph break at :data:`BREAKS` starts another); a
    gather whose wait lies in another graph is issued where it is waited for (``at_use``), as an
    in-flight functional collective may not cross graphs: blocking in the forward, its reduce-scatter
    still asynchronous in the backward (:class:`hidup.codegen.compiled._GatherStart`).  Run before the
    program is split and compiled (again at each split: it starts from the pass's links); eager runs
    ignore ``link`` and ``at_use``.  Returns how many gathers are issued where they are waited for."""
    breaks, where = 0, {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in BREAKS:
            breaks += 1
        where[node] = breaks
    placed = 0
    for start in gm.graph.nodes:
        if start.target is not hidup_prefetch:
            continue
        link = start.meta.setdefault(LINK, start.kwargs.get("link"))
        if link is None:
            continue
        waits = [u for u in start.users if u.target is hidup_prefetch_wait]
        here = (part_of(start), where[start])
        kwargs = {"link": link}
        if not all((part_of(w), where[w]) == here for w in waits):
            kwargs["at_use"] = True
            placed += 1
        for node in (start, *waits):
            node.kwargs = kwargs
    gm.recompile()
    return placed
