"""The search problem compiled from a graph, a profile and the options.

Order
-----
Nodes are visited in the graph's topological order, except that every node without inputs (model
inputs, parameters, constants) is moved to just before its first consumer: its signature is then
decided next to the op that reads it, and the search never carries the choices of all parameters at
once.

State of a tensor
-----------------
Before position ``i`` the *live* tensors (produced before ``i``, read at or after ``i``) are fixed
by the order alone.  Each live tensor carries ``(produced form, set of converted forms)``, encoded as
``(form id, bitmask of form ids)``.  A consumer needing form ``f`` of tensor ``t``:

* finds it available (the produced form, or converted earlier): no cost;
* otherwise pays ``conversion(produced form, f)`` once; ``f`` joins the converted set and later
  consumers reuse it.  A converted form that no later reader can need is dropped from the state
  (canonical keys: two situations with the same possible futures are one state).  Every form is
  made directly from the produced form (one collective per form change; ``ir.conversion`` covers
  every pair except ``-> replicate``, which is infeasible).

The conversion is charged to the first consumer needing it: its forward collective runs just
before that consumer, its backward collective just after that consumer's backward (by then every
reader of that form has contributed its gradient).
The memory copies the runtime makes around a conversion (:mod:`hidup.search.cost`, "Memory copies
around a form change") and the gradient bucket copies of a replicated parameter are that consumer's
compute: they count in ``Step.compute`` and, per copy, in the stage items' ``cA``/``cB``.

A transition (position ``i``, signature ``k``, state of the node's inputs) yields a :class:`Step`:
no-duplication forward and backward seconds (compute + communication), the per-copy stage items
``(mA, mB, cA, cB)`` of the forward and of the backward pass for duplication, and memory.

Recomputation
-------------
With ``recompute`` (block labels of repeated layers, :mod:`hidup.codegen.recompute`) a ``call`` node
of a recomputed layer runs its forward again before its backward: its backward compute becomes
``t_bwd + t_fwd`` (per copy ``hb + hf``, fixed cost included), and the conversions charged to it run
their forward collectives and copies again, blocking, in the backward (``bwd += fwd``, per copy
``bA += fA``, ``bB += fB``).  Its memory is :class:`~hidup.search.memory.MemoryModel`'s with the same
``recompute``.

A ``call`` node of a layer recomputed *selectively* (``recompute.selective``, :mod:`hidup.codegen.recompute`,
"Selective recomputation") runs again only what the policy does not save: a matmul or attention op
(:func:`hidup.search.memory.saves_output`) keeps its backward ``t_bwd``, any other op pays
``t_bwd + t_fwd`` as above (the norms, elementwise ops, softmax, casts between the matmuls: cheap
next to them).  The conversions charged to such a node: an activation's is saved, so its forward runs
once and its converted copy, ``local(t, f)``, joins the step's memory (``Step.copies``); a parameter's
is made again, its forward collectives and copies running again, blocking, in the backward, as
above.  So the price of a selective layer is its non-matmul forward and its parameters' gathers; a
whole recomputed layer pays its matmuls and its activations' collectives besides.

Gathered copies of parameters, and resharding
---------------------------------------------
The converted copy of a parameter that its converting consumer saves for its backward (the
all-gathered weight of a matmul, of a norm; :mod:`hidup.frontend.saved`, an input saved as itself) lives
until that backward: the step adds its bytes per rank, ``numel(local shape in the form made) *
itemsize``, to its memory (``Step.copies``, part of ``Step.mem`` and of the evaluation's
activations), except inside a recomputed layer (its region makes the copy again).  With ``reshard``
(True: every parameter stored split; or a set of ``param`` node names, :mod:`hidup.codegen.reshard`)
the conversion of such a parameter from a form split on some axis keeps no copy and runs its forward
collectives and copies again in the backward, blocking, as a recomputed node's conversions do.

Prefetched gathers
------------------
With ``prefetch`` (the default, as :mod:`hidup.codegen.prefetch` runs the program) the form change of a
parameter charged to a ``call`` node of unit ``u > 0`` (:func:`hidup.ir.prefetch_units` over the ``call``
nodes' :func:`~hidup.ir.block_label`, in this order; not in a recomputed layer, whose region gathers
again) is issued at the start of unit ``u - 1`` and overlaps that unit's forward compute.  Its forward
communication is charged as exposed only beyond a *window*::

    W(u)      = sum over the call nodes i of unit u of  min over the node's signatures s of compute_fwd(i, s)
    w(i, t)   = W(u - 1) * numel(t) / sum of numel(t') over the parameters t' the call nodes of unit u read
    fwd(conv) = copies + max(0, comm - w(i, t))            (instead of copies + comm)

``W`` is the least forward compute unit ``u - 1`` can have under any of its signatures (a search's
restriction aside), so it does not depend on the plan and the price stays a sum over transitions: the DP, the ILP and
:func:`hidup.search.schedule.evaluate` all read it from :meth:`Problem.forward_charge`.  The window is
shared among the unit's parameters by size, as the network serves the unit's gathers one after the
other: with gather times proportional to bytes, ``sum max(0, g_t - w_t)`` is then
``max(0, sum g_t - W)``, and in general it is no less (an upper bound of the overlapped time, never
below it).  A resharded parameter's gather made again in the backward is made ahead too, when the
backward of unit ``u + 1`` unpacks its first copy (:mod:`hidup.codegen.prefetch`, "Backward"): it is
charged ``copies + max(0, comm - w_b(i, t))`` there, ``w_b`` the same share of ``W_b(u + 1)``, the least
backward compute of unit ``u + 1`` (:meth:`Problem.again_charge`).  What it leaves out: the network
is shared with the blocking collectives of the overlapped unit (tensor-parallel all-reduces would delay
the gathers), and the gathers issued a unit before may still occupy it.  The backward's other
collectives are priced as without prefetch, and so is duplication's schedule (its items are
unchanged: its copies already overlap communication with the other copy's compute).  Where the ILP charges a form
change to the first reader that may need the form (:mod:`hidup.search.ilp`), it reads that reader's
window.  A compiled program (a profile priced ``compiled``) gets the same window for a form change whose
only collective is an all-gather (:func:`hidup.ir.async_gather_link`, the condition codegen issues it
by): it issues that gather a unit early as torch's functional collective and waits for it at the
consumer, so the compiled graph overlaps it with the unit's compute as the eager side stream does.  Any
other change of a parameter (an all-to-all, a layout change of two collectives) runs in place under
compilation and gets no window, nor does a resharded parameter's gather, forward or backward (the
compiled program leaves it where it was and lets the partitioner make it again: :mod:`hidup.codegen.prefetch`).
A program compiled in several graphs (gradient-bucket segments) issues the gathers into a segment's first
unit where they are waited for, blocking; they keep their window here (optimistic by at most one unit's
gathers per extra graph).
Either way a prefetched copy lives a unit longer (:meth:`~hidup.search.memory.MemoryModel.plan_prefetched`).

The backward collectives of a prefetched gather -- the reduce-scatter of the weight's gradient --
overlap the rest of the backward instead of blocking it (:meth:`Problem.scatters_async`): eagerly the
chain ran on a side stream, and autograd runs its backward on that stream too; compiled, the
asynchronous all-gather's adjoint is issued as torch's functional reduce-scatter whose wait inductor
sinks past the rest of the graph's backward (:mod:`hidup.codegen.compiled`).  So for a form change of
a parameter with a window (compiled: one that runs as one asynchronous all-gather) whose copy is kept
(not made again: not resharded, recomputed or selective), ``Step.bwd_async`` holds its backward
communication and ``Step.bwd_block`` does not; :func:`hidup.search.schedule.overlapped_backward`
prices both as it prices the gradient all-reduces of replicated parameters (the sums the DP and the
ILP minimize are unchanged).  Compiled in several graphs, each graph's backward waits for its own
reduce-scatters at its end; the evaluation prices that (:func:`hidup.search.schedule.graph_ends`), the
DP's sums do not see it.

Caches shared by the problems of one search
-------------------------------------------
The order and the liveness it fixes depend on the graph alone: one :class:`Positions` per search,
the graph validated once.
The problems built from one :class:`Models` (a search's) number forms alike (one id per form, in
the order the search meets them), so a state key means the same in each.  A transition from a key
depends only on the key and on the position's *shape* (:meth:`Problem._transition_caches`: its
signatures' form ids, prices and memory, the conversion classes of its inputs, which of them are
parameters and resharded, its liveness and the forms later readers may need), so positions of one
shape share one cache, across the problems of one cost model too.  A penalty matrix
(:meth:`Problem.penalties`) is a sum over the forms later readers may need, added up in the order
the problem met those forms (the order ids of its own would give), and is shared under that order:
every value is the one a problem built alone computes, bit for bit.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hidup.errors import UserError
from hidup.frontend.saved import as_used
from hidup.ir import (
    DTYPE_BYTES,
    FULL,
    REDUCE,
    Form,
    Graph,
    Node,
    Signature,
    async_gather_link,
    axis_forms,
    block_label,
    prefetch_units,
)
from hidup.search.cost import CostModel
from hidup.search.memory import MemoryModel, Recompute, saves_output

__all__ = ["Problem", "Models", "Positions", "Step", "SearchError", "block_label"]


class SearchError(UserError, ValueError):
    """The search cannot produce a plan; the message says why and what to change."""


class LazySearchError(SearchError):
    """A :class:`SearchError` whose message is worked out when it is first read: saying how much
    memory any plan needs takes an ILP solve, which a caller that recovers from the error (the search
    trying recomputation next) should not pay.  Pickled (from a worker process) with its message."""

    def __init__(self, make_message: Callable[[], str]):
        super().__init__()
        self._make, self._text = make_message, None

    def __str__(self) -> str:
        if self._text is None:
            self._text, self._make = self._make(), None
        return self._text

    def __reduce__(self):
        return (SearchError, (str(self),))


@dataclass(frozen=True)
class Step:
    """Cost of one transition (see the module docstring)."""

    fwd: float  # no duplication: forward compute + forward communication
    bwd: float  # no duplication: backward compute + backward communication
    # duplication's item of the node, (comm A, comm B, compute A, compute B) of the two half-batch
    # copies, as the stage recurrence reads it (:mod:`hidup.search.schedule`): forward, and backward
    # (in reversed time)
    fwd_item: tuple[float, float, float, float]
    bwd_item: tuple[float, float, float, float]
    mem: float
    compute: float  # no duplication: forward + backward compute
    convs: tuple[tuple[int, int, int, int], ...]  # (tensor id, input index, src form id, dst form id)
    bwd_compute: float = 0.0  # no duplication: backward compute (part of ``bwd``)
    # no duplication: what overlaps the backward, the gradient all-reduce of replicated parameters and the
    # reduce-scatters of prefetched gathers (part of ``bwd``, :meth:`Problem.scatters_async`)
    bwd_async: float = 0.0
    bwd_block: float = 0.0  # no duplication: backward collectives the compute stream waits for (part of ``bwd``)
    copies: float = 0.0  # bytes of the parameters' converted copies its backward keeps (part of ``mem``)
    bwd_scatter: float = 0.0  # the reduce-scatters of prefetched gathers (part of ``bwd_async``)


def _charge(windows: tuple[float, ...], inp: int, c) -> float:
    """``c.fwd`` less the part of its communication the window ``windows[inp]`` hides."""
    if not windows or not windows[inp]:
        return c.fwd
    return c.fwd - min(windows[inp], max(c.fwd - c.fwd_copies, 0.0))


@functools.lru_cache(maxsize=None)
def _async_gather(conv) -> bool:
    """Whether a compiled program runs the prefetched form change ``conv`` (a :class:`~hidup.ir.Conversion`
    or :class:`~hidup.ir.MeshConversion`) as one asynchronous all-gather (:func:`hidup.ir.async_gather_link`)."""
    steps = getattr(conv, "steps", None)
    return async_gather_link([conv.forward] if steps is None else [s.conv.forward for s in steps]) is not None


def _getter(idx: list[int]):
    """A fast ``lambda seq: tuple(seq[j] for j in idx)``."""
    if not idx:
        return lambda seq: ()
    if len(idx) == 1:
        j = idx[0]
        return lambda seq: (seq[j],)
    return operator.itemgetter(*idx)


def _order(graph: Graph) -> list[Node]:
    producer = {t: n for n in graph.nodes for t in n.outputs}
    first_use: dict[str, str] = {}
    for n in graph.nodes:
        for t in n.inputs:
            first_use.setdefault(producer[t].name, n.name)
    order, done = [], set()
    for n in graph.nodes:
        if not n.inputs and n.name in first_use:
            continue  # placed before its first consumer
        for t in n.inputs:
            p = producer[t]
            if p.name not in done and not p.inputs:
                order.append(p)
                done.add(p.name)
        order.append(n)
        done.add(n.name)
    return order


class Positions:
    """A graph's nodes in the problems' order (module docstring, "Order") and what that order alone fixes:
    which tensors are live before each position (``live``, ``live_index``), where each entry of the next
    position's live tensors comes from (``carry``: ``(1, output index)`` or ``(0, index in live[i])``),
    the kept entries' getter (``keep``, ``kept_idx``) and the places of a node's inputs in the state
    (``input_idx``, ``sub``).  The same for every problem of the graph (:meth:`Models.positions`)."""

    def __init__(self, graph: Graph):
        graph.validate()
        self.order = _order(graph)
        self.n = len(self.order)
        self.pos_of = {node.name: i for i, node in enumerate(self.order)}
        self.last_use: dict[int, int] = {}
        for i, node in enumerate(self.order):
            for t in node.inputs:
                self.last_use[t] = i
        last_use = self.last_use
        self.live: list[tuple[int, ...]] = [()]
        for i, node in enumerate(self.order):
            keep = [t for t in self.live[-1] if last_use[t] > i]
            keep += [t for t in node.outputs if last_use.get(t, -1) > i]
            self.live.append(tuple(keep))
        self.live_index = [{t: j for j, t in enumerate(lv)} for lv in self.live]
        self.carry: list[tuple[tuple[int, int], ...]] = []
        for i, node in enumerate(self.order):
            src = []
            outs = {t: j for j, t in enumerate(node.outputs)}
            for t in self.live[i + 1]:
                src.append((1, outs[t]) if t in outs else (0, self.live_index[i][t]))
            self.carry.append(tuple(src))
        # live[i+1] = the entries of live[i] still read later, in order, then the node's live outputs
        self.keep = []
        self.kept_idx = []
        for i in range(self.n):
            keep = [a for kind, a in self.carry[i] if kind == 0]
            if len(keep) != len(self.carry[i]) and any(kind == 0 for kind, _ in self.carry[i][len(keep) :]):
                raise AssertionError("live order: kept tensors must precede new outputs")
            self.keep.append(_getter(keep))
            self.kept_idx.append(tuple(keep))
        self.input_idx = [tuple(self.live_index[i][t] for t in node.inputs) for i, node in enumerate(self.order)]
        self.sub = [_getter(list(idx)) for idx in self.input_idx]


class Models:
    """The cost and memory models of one graph, shared by the problems of one search.

    A search may build many problems of one graph: the axis-by-axis mesh search one per step
    (:mod:`hidup.search.api`, "Meshes"), recomputation one per set of recomputed layers.  A node's
    price under a signature and a form change's cost do not depend on the problem's signature filter
    or on which layers it recomputes (recomputation is applied on top, by :class:`Problem`), and the
    models keep them once computed (:meth:`CostModel.device_compute`, :meth:`CostModel.conversion`,
    :meth:`MemoryModel.breakdown`): so each later problem reads the prices instead of working them out
    again.  One :class:`CostModel` per (profile, precision), one :class:`MemoryModel` per (optimizer
    factor, precision, recomputed layers)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._cost: dict[tuple, CostModel] = {}
        self._memory: dict[tuple, MemoryModel] = {}
        self._saved: dict[str, dict] = {}  # precision -> MemoryModel.saved_memo
        self._physical: dict[int, tuple] = {}
        self._kept: dict[tuple, dict] = {}  # table -> (node name, id(signature)) -> (signature, value)
        # form ids, one numbering for every problem of the search, so that what one problem works out
        # of its states holds in another: the caches of :meth:`caches`
        self.forms: list[Form] = []
        self.form_id: dict[Form, int] = {}
        self._caches: dict[int, tuple] = {}  # id(cost model) -> (cost model, its caches)
        self._positions: Positions | None = None

    def positions(self) -> "Positions":
        """The graph validated, its nodes in the problems' order and the liveness that order fixes: one
        per search (the graph does not change while it runs)."""
        if self._positions is None:
            self._positions = Positions(self.graph)
        return self._positions

    def physical(self, profile):
        """``profile`` without its corrections, one copy per profile (so its cost model is shared too)."""
        hit = self._physical.get(id(profile))
        if hit is None or hit[0] is not profile:
            hit = self._physical[id(profile)] = (profile, profile.without_corrections())
        return hit[1]

    def cost(self, profile, precision: str, zero: int = 0, reduce_dtype: str = "fp32") -> CostModel:
        key = (id(profile), precision, zero, reduce_dtype)
        hit = self._cost.get(key)
        if hit is None or hit.profile is not profile:  # (the model holds its profile: an id is not reused)
            hit = self._cost[key] = CostModel(self.graph, profile, precision, zero=zero, reduce_dtype=reduce_dtype)
        return hit

    def kept(self, table: tuple, node: Node, sig: Signature, make: Callable[[Node, Signature], Any]) -> Any:
        """``make(node, sig)``, kept in the table ``table`` per (node, signature): what depends only on
        the node, the signature and what names the table (a precision, a cost model)."""
        entries = self._kept.setdefault(table, {})
        key = (node.name, id(sig))
        hit = entries.get(key)
        if hit is None or hit[0] is not sig:
            hit = entries[key] = (sig, make(node, sig))
        return hit[1]

    def caches(self, cost: CostModel) -> dict:
        """The caches of states that the problems priced by ``cost`` share (:meth:`Problem.transitions`,
        :meth:`Problem.penalties`, :meth:`Problem.conversion`): their keys say everything the cached
        value depends on besides the cost model and the form numbering, which these problems share."""
        hit = self._caches.get(id(cost))
        if hit is None or hit[0] is not cost:
            caches = {"transitions": {}, "inputs": {}, "penalty rows": {}, "penalties": {}, "conversions": {}}
            caches["classes"] = None
            hit = self._caches[id(cost)] = (cost, caches)
        return hit[1]

    def memory(
        self, optimizer_factor: float, precision: str, recompute=frozenset(), zero: int = 0, offload: bool = False
    ) -> MemoryModel:
        """The memory model with the layers ``recompute`` (a :class:`~hidup.search.memory.Recompute`, or
        labels recomputed whole) recomputed, the replicated weights at ZeRO stage ``zero`` and the optimizer
        state on the host where ``offload``."""
        recompute = Recompute.of(recompute)
        key = (optimizer_factor, precision, recompute, zero, offload)
        hit = self._memory.get(key)
        if hit is None:
            memo = self._saved.setdefault(precision, {})  # what a node saves: the same whatever is recomputed
            hit = MemoryModel(
                self.graph,
                optimizer_factor,
                precision,
                recompute.whole,
                selective=recompute.selective,
                zero=zero,
                offload=offload,
                saved_memo=memo,
            )
            self._memory[key] = hit
        return hit


class Problem:
    """Positions, allowed signatures, per-signature costs and tensor liveness of one search."""

    def __init__(
        self,
        graph: Graph,
        profile,
        precision: str = "fp32",
        restrict: Callable[[Node, Signature], bool] | None = None,
        optimizer_factor: float = 2.0,
        recompute: "Recompute | frozenset | set | tuple" = frozenset(),
        models: "Models | None" = None,
        reshard: "bool | frozenset | set | tuple" = False,
        zero: int = 0,
        reduce_dtype: str = "fp32",
        prefetch: bool = True,
        offload: bool = False,
    ):
        self.graph, self.profile, self.world = graph, profile, graph.world_size
        self.offload = offload  # Adam's state on the host (hidup.search.schedule prices its step)
        self.prefetch = prefetch  # parameters' gathers issued a unit early (module docstring, "Prefetched gathers")
        if models is None:
            models = Models(graph)
        elif models.graph is not graph:
            raise ValueError("Problem: the shared models were built for another graph")
        self.models = models
        positions = models.positions()  # the graph validated, ordered, and the liveness of that order
        self.zero = zero  # the ZeRO stage of the replicated parameters (hidup.search.cost, "ZeRO")
        self.cost = models.cost(profile, precision, zero, reduce_dtype)
        # prefetched gathers overlap the previous unit, eager or compiled (module docstring, "Prefetched gathers")
        self.prefetch_overlaps = bool(prefetch)
        self.order, self.n, self.pos_of = positions.order, positions.n, positions.pos_of
        # parameters' tensors, and those whose converted copies are made again in the backward
        self.reshard = reshard if reshard is True else frozenset(reshard or ())
        params = [n for n in graph.nodes if n.op == "param"]
        self.param_tids = frozenset(t for n in params for t in n.outputs)
        self.reshardable = frozenset(t for n in params if reshard is True or n.name in self.reshard for t in n.outputs)

        self.forms: list[Form] = models.forms  # shared: one numbering per search (Models)
        self.form_id: dict[Form, int] = models.form_id
        self._shared = models.caches(self.cost)
        # form id -> the order in which this problem meets it (the ids a numbering of its own would give):
        # the penalties add up their forms in this order, so they are those of a problem of its own to the bit
        self._rank: dict[int, int] = {}
        self._rel_forms: dict[int, tuple[int, ...]] = {}  # relevant forms' mask -> its form ids in that order
        self.sigs: list[list[Signature]] = []
        self.in_forms: list[list[tuple[int, ...]]] = []
        self.out_forms: list[list[tuple[int, ...]]] = []
        self._plain_device: list[list[tuple[float, float]]] = []  # device_compute without recomputation
        # per signature: ((input index, itemsize), ...) of the parameter inputs its backward keeps as they are
        self.saved_in: list[tuple[tuple, ...]] = []
        memory = models.memory(optimizer_factor, precision, recompute, zero, offload)
        # id(signature) -> (signature, form ids of its inputs / outputs): the ops of identical layers share
        # their signatures, so each is numbered once (in the order it would be, form by form)
        in_ids: dict[int, tuple] = {}
        out_ids: dict[int, tuple] = {}

        def saved_inputs(node: Node, sig: Signature) -> tuple[tuple[int, int], ...]:
            return self._saved_inputs(node, sig, memory.record)

        for node in self.order:
            sigs = self._allowed(node, restrict)
            self.sigs.append(sigs)
            self.in_forms.append([self._fids(s, s.inputs, in_ids) for s in sigs])
            self.out_forms.append([self._fids(s, s.outputs, out_ids) for s in sigs])
            self._plain_device.append([self.cost.device_compute(node, s) for s in sigs])
            twin = memory.twin(node)  # the nodes of one record keep the same inputs
            self.saved_in.append(tuple(models.kept(("saved in", precision), twin, s, saved_inputs) for s in sigs))
        self.node_batch = [self.cost.node_is_batch(node) for node in self.order]
        self._plain_fixed = [self.cost.fixed(node) for node in self.order]
        # per copy compute (CostModel.copy_compute): half-batch times of batch nodes, whole otherwise
        self._plain_copy = [
            [models.kept(("copy", id(self.cost)), twin, s, self._copy_compute) for s in sigs]
            for twin, sigs in zip(map(self.cost.twin, self.order), self.sigs)
        ]
        self._liveness(positions)
        self._recomputing(memory)

    def derive(self, recompute: "Recompute | frozenset | set | tuple") -> "Problem":
        """This problem with the layers ``recompute`` recomputed instead: signatures, liveness and the
        plain prices are shared, what recomputation changes (times, memory, transitions) is new."""
        other = copy.copy(self)
        memory = self.memory
        other._recomputing(
            self.models.memory(memory.optimizer_factor, memory.precision, recompute, self.zero, self.offload)
        )
        return other

    def _recomputing(self, memory: MemoryModel) -> None:
        """What depends on the recomputed layers: times, memory and the caches of transitions."""
        self.memory = memory
        self.recompute = memory.recomputing
        # positions whose forward runs again in the backward (module docstring, "Recomputation"): of
        # layers recomputed whole, of layers recomputed selectively, and whose own op runs again
        self.selective = [memory.is_selective(node) for node in self.order]
        self.recomputed = [bool(memory.layer_of(node)) and not sel for node, sel in zip(self.order, self.selective)]
        self.rerun = [
            whole or (sel and not saves_output(node))
            for node, whole, sel in zip(self.order, self.recomputed, self.selective)
        ]
        self.device_compute = [[self._again(i, d) for d in row] for i, row in enumerate(self._plain_device)]
        self.compute = [[self.cost.in_program(d) for d in row] for row in self.device_compute]
        self.mem_parts = [[memory.breakdown(node, s) for s in sigs] for node, sigs in zip(self.order, self.sigs)]
        # the budget's terms (:mod:`hidup.search.memory`, "The budget"): each node's memory and its transient
        # beyond the floor T0, which the first position adds once, with the prefetched resharded copies' ceiling,
        # less the slack L every plan's terms keep above its peak bound
        self.mem = [[memory.bound(node, s) for s in sigs] for node, sigs in zip(self.order, self.sigs)]
        if self.mem:
            once = memory.budget_constant(self.reshardable, self.prefetch)
            once = max(once, -min(self.mem[0]))  # no term below 0 (the ILP drops those)
            self.mem[0] = [m + once for m in self.mem[0]]
        self.fixed = [self._again(i, f) for i, f in enumerate(self._plain_fixed)]
        self.compute_copy = [[self._again(i, c) for c in row] for i, row in enumerate(self._plain_copy)]
        self.windows, self.back_windows = self._prefetch_windows()
        self.min_mem_suffix = [0.0] * (self.n + 1)
        for i in range(self.n - 1, -1, -1):
            self.min_mem_suffix[i] = self.min_mem_suffix[i + 1] + min(self.mem[i])
        self._step_cache: dict[tuple, tuple[Step, tuple] | None] = {}
        # (conversion class, relevant forms, state) -> cost of making each relevant form available; and
        # (class, relevant forms, states) -> penalties: shared by the problems of one cost model (Models.caches)
        self._pen_cache: dict[tuple, np.ndarray] = self._shared["penalty rows"]
        self._pen_matrices: dict[tuple, np.ndarray] = self._shared["penalties"]
        self._trans_cache: list[dict[tuple, tuple]] = self._transition_caches(self._kept_idx)
        # beside each transition cache, what its positions' signatures make of the states of the node's
        # inputs alone (transitions): ``sub -> ((k, step, updates, outputs), ...)``; many keys share one
        self._by_inputs: list[dict[tuple, tuple]] = []
        beside = self._shared["inputs"]
        for cache in self._trans_cache:
            hit = beside.get(id(cache))
            if hit is None or hit[0] is not cache:
                hit = beside[id(cache)] = (cache, {})
            self._by_inputs.append(hit[1])
        # (duplication, beam) -> the DP's answer without a memory budget (hidup.search.dp.solve):
        # a budgeted search asks for it again, first to see whether the budget binds
        self.free_solutions: dict[tuple, tuple[tuple[int, ...], float]] = {}
        # the repeated layers' occurrences (hidup.search.segments.find_blocks), found by the first DP
        self.occurrences: list | None = None

    def _prefetch_windows(self) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
        """Per position, per input, the windows ``w(i, t)`` of a prefetched gather of that input charged
        there, forward and (a resharded parameter's gather made again) backward (module docstring,
        "Prefetched gathers"); ``()`` where nothing is prefetched."""
        if not self.prefetch_overlaps:
            return [()] * self.n, [()] * self.n
        compiled = self.cost.compiled
        calls = [i for i, node in enumerate(self.order) if node.op == "call"]
        unit_of = dict(zip(calls, prefetch_units([block_label(self.order[i].module) for i in calls])))
        windows: dict[int, list[float]] = {}
        sizes: dict[int, dict[int, int]] = {}
        for i, u in unit_of.items():
            node = self.order[i]  # over all its signatures, not the ones a restriction allows: a plan's price
            times = [self.cost.in_program(self.cost.device_compute(node, s)) for s in node.signatures] or [(0.0, 0.0)]
            w = windows.setdefault(u, [0.0, 0.0])
            w[0] += min(t[0] for t in times)
            w[1] += min(t[1] for t in times)
            for t in self.order[i].inputs:
                if t in self.param_tids:
                    sizes.setdefault(u, {})[t] = self.graph.tensors[t].numel
        fwd: list[tuple[float, ...]] = []
        bwd: list[tuple[float, ...]] = []
        for i, node in enumerate(self.order):
            u = unit_of.get(i)
            if u is None or self.recomputed[i] or self.selective[i]:
                fwd.append(())
                bwd.append(())
                continue
            share, total = sizes.get(u, {}), sum(sizes.get(u, {}).values()) or 1
            before, after = windows.get(u - 1, (0.0, 0.0))[0], windows.get(u + 1, (0.0, 0.0))[1]
            # compiled, a resharded parameter's gathers stay where they were, forward and backward
            stays = self.reshardable if compiled else frozenset()
            ahead_of = frozenset() if compiled else self.reshardable
            ours = [0.0 if t in stays else before * share.get(t, 0) / total for t in node.inputs]
            fwd.append(tuple(ours) if before else ())
            ahead = [after * share.get(t, 0) / total if t in ahead_of else 0.0 for t in node.inputs]
            bwd.append(tuple(ahead) if any(ahead) else ())
        return fwd, bwd

    def forward_charge(self, i: int, inp: int, c) -> float:
        """Forward seconds a form change ``c`` (:class:`~hidup.search.cost.ConvCost`) of input ``inp`` of
        position ``i`` costs there: ``c.fwd``, its communication less the prefetch window (module docstring,
        "Prefetched gathers"; compiled, only a change that runs as one asynchronous all-gather).  The DP,
        the ILP and the evaluation all price it here."""
        windows = self.windows[i]
        if self.cost.compiled and windows and windows[inp] and not _async_gather(c.conv):
            return c.fwd
        return _charge(windows, inp, c)

    def scatters_async(self, i: int, inp: int, src: int, c) -> bool:
        """Whether the backward collectives of form change ``c`` of input ``inp`` of position ``i`` (from
        form id ``src``) overlap the rest of the backward instead of blocking it: those of a prefetched
        gather (one with a window; compiled, one that runs as an asynchronous all-gather, whose
        reduce-scatter the backward issues asynchronously too) of a parameter whose copy is kept, not made
        again (module docstring, "Prefetched gathers").  The DP, the ILP and the evaluation all read it here."""
        windows = self.windows[i]
        if not windows or not windows[inp] or (self.cost.compiled and not _async_gather(c.conv)):
            return False
        return not self.made_again(i, self.order[i].inputs[inp], src)

    def again_charge(self, i: int, inp: int, c) -> float:
        """Backward seconds a resharded parameter's form change ``c`` of input ``inp`` of position ``i``
        costs when the backward makes it again: ``c.fwd``, its communication less the window of the next
        unit's backward (module docstring, "Prefetched gathers")."""
        return _charge(self.back_windows[i], inp, c)

    def _liveness(self, positions: "Positions") -> None:
        """Which tensors are live before each position and where each comes from (``positions``, the
        same for every problem of the graph), and the forms their later readers may need (module
        docstring, "State of a tensor")."""
        self.last_use, self.live, self.live_index = positions.last_use, positions.live, positions.live_index
        self.carry, self._keep, self._kept_idx = positions.carry, positions.keep, positions.kept_idx
        self.input_idx, self._sub = positions.input_idx, positions.sub
        # relevant[i][j]: forms that readers at positions >= i may still need of tensor live[i][j];
        # converted forms outside it are forgotten, so equal futures get equal keys.
        need_from: dict[int, int] = {}
        self.relevant: list[tuple[int, ...]] = [()] * (self.n + 1)
        for i in range(self.n - 1, -1, -1):
            node = self.order[i]
            for inp, t in enumerate(node.inputs):
                m = 0
                for fs in self.in_forms[i]:
                    m |= 1 << fs[inp]
                need_from[t] = need_from.get(t, 0) | m
            self.relevant[i] = tuple(need_from[t] for t in self.live[i])
        # tensors of one conversion class convert alike (CostModel.conversion_class): numbered here, the
        # class keys the conversion and penalty caches, so equal tensors of repeated layers share them
        # (the same numbers in every problem of the graph and cost model: the order is the graph's)
        if self._shared["classes"] is None:
            classes: dict[tuple, int] = {}
            self._shared["classes"] = {
                t: classes.setdefault(self.cost.conversion_class(t), len(classes)) for t in self.last_use
            }
        self._conv_class = self._shared["classes"]
        # (class number, src id, dst id) -> cost, shared by the problems of one cost model
        self._conv_ids: dict[tuple[int, int, int], object] = self._shared["conversions"]

    def drop_caches(self) -> None:
        """Let go of the transition, step and penalty caches (they are rebuilt on demand): a search that
        failed keeps its problem only to explain the failure, if asked.  The caches other problems share
        (:meth:`Models.caches`) are left to them."""
        self._step_cache.clear()
        self._trans_cache = [{} for _ in self._trans_cache]
        self._by_inputs = [{} for _ in self._trans_cache]
        self._pen_cache, self._pen_matrices = {}, {}

    # ------------------------------------------------------------------------------------ setup
    def _saved_inputs(self, node: Node, sig: Signature, record) -> tuple[tuple[int, int], ...]:
        """``(input index, itemsize)`` of each parameter input that ``node``'s backward keeps as it is
        under ``sig`` (:mod:`hidup.frontend.saved`, ``record``); () without a record."""
        if record is None or node.op != "call":
            return ()
        items, _ = record.items(node, sig)
        out = {}
        for it in items:
            if it.slot == "in" and it.how == "input" and node.inputs[it.index] in self.param_tids:
                out.setdefault(it.index, DTYPE_BYTES.get(it.dtype, 4))
        return tuple(sorted(out.items()))

    def resharded(self, tid: int, src: int) -> bool:
        """Whether a conversion of tensor ``tid`` from form id ``src`` keeps no copy and runs again in the
        backward (module docstring, "Gathered copies of parameters, and resharding")."""
        return tid in self.reshardable and any(f.is_gather for f in axis_forms(self.forms[src]))

    def _again(self, i: int, times: tuple[float, float]) -> tuple[float, float]:
        """``(forward, backward)`` seconds of position ``i``, its forward repeated in the backward
        when its op runs again (module docstring, "Recomputation")."""
        return (times[0], times[1] + times[0]) if self.rerun[i] else times

    @functools.cached_property
    def call_layout(self) -> tuple[list[int], list[str], list[tuple[int, ...]], list[int], list[int]]:
        """What :func:`hidup.search.schedule.graph_ends` reads whatever the plan: the call positions,
        their block labels and inputs (each tensor once), the trainable parameters' positions and the
        indices (among the calls) of the routed-experts nodes."""
        order, tensors = self.order, self.graph.tensors
        calls = [i for i, node in enumerate(order) if node.op == "call"]
        labels = [block_label(order[i].module) for i in calls]
        inputs = [tuple(dict.fromkeys(order[i].inputs)) for i in calls]
        trainable = [n.op == "param" and n.outputs and tensors[n.outputs[0]].requires_grad for n in order]
        params = [i for i, keep in enumerate(trainable) if keep]
        experts = [k for k, i in enumerate(calls) if order[i].target.split(".", 1)[0] == "routed_experts"]
        return calls, labels, inputs, params, experts

    def made_again(self, i: int, tid: int, src: int) -> bool:
        """Whether the conversion of tensor ``tid`` from form id ``src`` charged to position ``i`` runs its
        forward again in the backward: at a node recomputed whole, at a node recomputed selectively
        for a parameter, or for a resharded parameter (module docstring)."""
        if self.recomputed[i]:
            return True
        if self.selective[i] and self.graph.tensors[tid].is_param:
            return True
        return self.resharded(tid, src)

    def _copy_compute(self, node: Node, sig: Signature) -> tuple[float, float]:
        """:meth:`CostModel.copy_compute` of ``node`` under ``sig`` (its device time read from the cost model)."""
        return self.cost.copy_compute(node, sig, self.cost.device_compute(node, sig), self.cost.node_is_batch(node))

    def _fids(self, sig: Signature, forms: tuple[Form, ...], memo: dict[int, tuple]) -> tuple[int, ...]:
        """The form ids of ``forms`` (``sig``'s inputs or outputs), kept in ``memo`` per signature."""
        hit = memo.get(id(sig))
        if hit is None or hit[0] is not sig:
            hit = memo[id(sig)] = (sig, tuple(self._fid(f) for f in forms))
        return hit[1]

    def _fid(self, f: Form) -> int:
        if f not in self.form_id:
            self.form_id[f] = len(self.forms)
            self.forms.append(f)
        fid = self.form_id[f]
        self._rank.setdefault(fid, len(self._rank))
        return self.form_id[f]

    def _allowed(self, node: Node, restrict) -> list[Signature]:
        sigs = list(node.signatures)
        if node.op == "output" and not sigs:
            sigs = [
                Signature(tuple(REDUCE for _ in node.inputs), (), 0.0, "replicated"),
                Signature(tuple(FULL for _ in node.inputs), (), 0.0, "replicated"),
            ]
        if restrict is not None:
            kept = [s for s in sigs if restrict(node, s)]
            if not kept:
                raise SearchError(
                    f"node {node.name} ({node.target}, {node.source or 'no source'}): the restriction "
                    f"rejects all {len(sigs)} signatures ({', '.join(map(str, sigs))}). Fix: let the "
                    "restriction accept at least one of them."
                )
            sigs = kept
        return sigs

    # ------------------------------------------------------------------------------------ transitions
    def step(self, i: int, k: int, key: tuple) -> tuple[Step, tuple] | None:
        """Apply signature ``k`` at position ``i`` to state ``key`` (aligned with ``live[i]``).

        Returns (step cost, new key aligned with ``live[i+1]``), or None if infeasible."""
        sub = self._sub[i](key)
        ck = (i, k, sub)
        hit = self._step_cache.get(ck, ck)
        if hit is ck:
            hit = self._make_step(i, k, self.input_idx[i], sub)
            self._step_cache[ck] = hit
        if hit is None:
            return None
        step, updates, outs = hit
        if not updates:
            return step, self._keep[i](key) + outs
        new = list(key)
        for j, st in updates:
            new[j] = st
        return step, self._keep[i](new) + outs

    def _transition_caches(self, kept_idx: list[tuple[int, ...]]) -> list[dict]:
        """One transition cache per position, shared by the positions that transition alike: the same
        signatures (forms, prices, memory), inputs of the same conversion classes at the same places
        of the state, and the same liveness and relevant forms after them (the same layer's positions
        in repeated layers).  From equal keys such positions reach equal new keys at equal cost."""
        caches: dict[tuple, dict] = self._shared["transitions"]  # and by the problems of this cost model
        out = []
        for i, node in enumerate(self.order):
            li, rel, live = self.live_index[i + 1], self.relevant[i + 1], self.live[i]
            after = tuple(
                (li[live[j]], rel[li[live[j]]]) if live[j] in li else None for j in dict.fromkeys(self.input_idx[i])
            )
            shape = (
                len(live),
                self.input_idx[i],
                tuple(self._conv_class[t] for t in node.inputs),
                tuple(self.in_forms[i]),
                tuple(self.out_forms[i]),
                tuple(self.compute[i]),
                tuple(self.compute_copy[i]),
                tuple(self.mem[i]),
                self.recomputed[i],
                self.selective[i],
                self.saved_in[i],
                tuple(t in self.param_tids for t in node.inputs),
                tuple(t in self.reshardable for t in node.inputs),
                self.windows[i],
                self.back_windows[i],
                kept_idx[i],
                after,
                tuple(t in li for t in node.outputs),
            )
            out.append(caches.setdefault(shape, {}))
        return out

    def transitions(self, i: int, key: tuple) -> tuple[tuple[int, Step, tuple], ...]:
        """Every feasible ``(k, step, new key)`` of :meth:`step` at position ``i`` from ``key``, in
        signature order, for the DP; cached per (position, key), so the DP's passes share them, and
        shared by the positions that transition alike (:meth:`_transition_caches`): a step's costs are
        then those of position ``i``, its ``convs`` name the tensors of the first such position that
        met ``key`` (:meth:`step` names position ``i``'s own)."""
        cache = self._trans_cache[i]
        hit = cache.get(key)
        if hit is None:
            sub = self._sub[i](key)
            rows = self._by_inputs[i].get(sub)
            if rows is None:  # as step() makes them, per signature
                rows = []
                steps = self._step_cache
                for k in range(len(self.sigs[i])):
                    ck = (i, k, sub)
                    made = steps.get(ck, ck)
                    if made is ck:
                        made = steps[ck] = self._make_step(i, k, self.input_idx[i], sub)
                    if made is not None:
                        rows.append((k, *made))
                rows = self._by_inputs[i][sub] = tuple(rows)
            keep = self._keep[i]
            out = []
            for k, step, updates, outs in rows:
                if not updates:
                    out.append((k, step, keep(key) + outs))
                    continue
                new = list(key)
                for j, st in updates:
                    new[j] = st
                out.append((k, step, keep(new) + outs))
            hit = cache[key] = tuple(out)
        return hit

    def _make_step(self, i: int, k: int, idx: tuple, sub: tuple):
        node = self.order[i]
        states = dict(zip(idx, sub))
        need = self.in_forms[i][k]
        ff = fb = fb_async = fb_block = fb_scatter = lf = lb = 0.0
        fA = fB = bA = bB = 0.0
        lfA = lfB = lbA = lbB = 0.0
        rf = rlf = rfA = rfB = rlfA = rlfB = copies = 0.0  # conversions made again in the backward; kept copies
        saved = dict(self.saved_in[i][k]) if self.saved_in[i] else {}
        convs = []
        for inp, (j, f) in enumerate(zip(idx, need)):
            prod, mask = states[j]
            if prod < 0:
                raise AssertionError(f"tensor {node.inputs[inp]} has no state at {node.name}")
            if f == prod or mask >> f & 1:
                continue
            c = self.conversion(node.inputs[inp], prod, f)
            if c is None:
                return None
            ff += self.forward_charge(i, inp, c)
            fb += c.bwd
            scatter = c.bwd_block if self.scatters_async(i, inp, prod, c) else 0.0  # a prefetched gather's adjoint
            fb_async += c.bwd_async + scatter  # the gradient all-reduce; packing the bucket runs on the compute stream
            fb_block += c.bwd_block - scatter
            fb_scatter += scatter
            lf += c.fwd_copies
            lb += c.bwd_copies
            lfA += c.fwd_copies_a
            lfB += c.fwd_copies_b
            lbA += c.bwd_copies_a
            lbB += c.bwd_copies_b
            fA += c.fwd_comm_a
            fB += c.fwd_comm_b
            bA += c.bwd_comm_a
            bB += c.bwd_comm_b
            states[j] = (prod, mask | (1 << f))
            convs.append((node.inputs[inp], inp, prod, f))
            if self.recomputed[i]:
                continue
            t = node.inputs[inp]
            kept = self.memory.kept_conversion(node, t, self.forms[f]) if self.selective[i] else 0.0
            if kept:  # an activation's form change in a selective layer: saved, not made again
                copies += kept
            elif self.made_again(i, t, prod):
                again = self.again_charge(i, inp, c)  # a resharded gather made ahead hides behind the next unit
                rf, rlf, rfA, rfB = rf + again, rlf + c.fwd_copies, rfA + c.fwd_comm_a, rfB + c.fwd_comm_b
                rlfA, rlfB = rlfA + c.fwd_copies_a, rlfB + c.fwd_copies_b
            elif inp in saved and as_used(self.forms[prod]) != self.forms[f]:  # not replicate -> full: a copy
                shape = self.graph.tensors[t].shape
                copies += math.prod(self.forms[f].local_shape(shape, self.graph.mesh)) * saved[inp]
        if self.recomputed[i]:  # the forward conversions run again before the backward
            rf, rlf, rfA, rfB, rlfA, rlfB = ff, lf, fA, fB, lfA, lfB
        if rf or rlf:  # resharded or recomputed: those forward conversions run again, blocking, in the backward
            fb += rf
            fb_block += rf - rlf
            lb, lbA, lbB = lb + rlf, lbA + rlfA, lbB + rlfB
            bA, bB = bA + rfA, bB + rfB
        cf, cb = self.compute[i][k]
        hf, hb = self.compute_copy[i][k]
        fwd_item = (fA, fB, hf + lfA, hf + lfB)
        bwd_item = (bA, bB, hb + lbA, hb + lbB)
        step = Step(
            cf + ff,
            cb + fb,
            fwd_item,
            bwd_item,
            self.mem[i][k] + copies,
            cf + cb + lf + lb,
            tuple(convs),
            cb + lb,
            fb_async,
            fb_block,
            copies,
            fb_scatter,
        )
        rel, li = self.relevant[i + 1], self.live_index[i + 1]
        updates = []
        for j in dict.fromkeys(idx):
            t = self.live[i][j]
            if t in li:  # still live: forget forms no later reader can need
                prod, mask = states[j]
                updates.append((j, (prod, mask & rel[li[t]])))
        outs = tuple((self.out_forms[i][k][j], 0) for j, t in enumerate(node.outputs) if t in li)
        return step, tuple(updates), outs

    def penalties(self, pos: int, j: int, states: list[tuple[int, int]]) -> np.ndarray:
        """``P[a, b]``: an upper bound on the extra conversion time (no duplication) the future pays
        when tensor ``live[pos][j]`` is in state ``states[a]`` instead of ``states[b]``: the sum over
        forms ``f`` a later reader may need of ``max(0, cost_a(f) - cost_b(f))``, ``cost_x(f)`` being 0
        if ``f`` is available in ``x`` and the fwd+bwd time of ``conversion(x's produced form, f)``
        otherwise (infinite when there is none).  Kept per (conversion class, relevant forms, states):
        the same tensor of each repeated layer meets the same states (read-only), and so does each
        problem of the cost model that adds up the forms in the same order (:meth:`Models.caches`)."""
        t = self.live[pos][j]
        rel = self.relevant[pos][j]
        forms = self._rel_forms.get(rel)
        if forms is None:  # in the order this problem met them (the order its own form ids would give)
            forms = [f for f in range(rel.bit_length()) if rel >> f & 1]
            forms = self._rel_forms[rel] = tuple(sorted(forms, key=self._rank.__getitem__))
        mk = (self._conv_class[t], t in self.reshardable, self._may_prefetch(t), forms, tuple(states))
        hit = self._pen_matrices.get(mk)
        if hit is None:
            hit = self._pen_matrices[mk] = self._penalty_matrix(t, forms, states)
            hit.setflags(write=False)
        return hit

    def _may_prefetch(self, t: int) -> bool:
        """Whether a form change of tensor ``t`` may be charged less than its price by a prefetch window."""
        return self.prefetch_overlaps and t in self.param_tids and not (self.cost.compiled and t in self.reshardable)

    def _penalty_matrix(self, t: int, forms: tuple[int, ...], states: list[tuple[int, int]]) -> np.ndarray:
        # a prefetched gather costs between its price less its communication (the whole of it hidden) and
        # its price: state a pays at most the latter, state b at least the former
        rows, lows = [], []
        prefetch = self._may_prefetch(t)
        for st in states:
            ck = (self._conv_class[t], t in self.reshardable, prefetch, forms, st)
            row = self._pen_cache.get(ck)
            if row is None:
                row = self._pen_cache[ck] = np.array(
                    [[self._avail_cost(t, st, f, low) for f in forms] for low in (False, prefetch)], float
                )
            rows.append(row[0])
            lows.append(row[1])
        if not forms:
            return np.zeros((len(states), len(states)))
        a, b = np.stack(rows)[:, None, :], np.stack(lows)[None, :, :]
        with np.errstate(invalid="ignore"):
            extra = np.where(np.isinf(a) & np.isinf(b), 0.0, a - b)
        return np.maximum(extra, 0.0).sum(axis=-1)

    def _avail_cost(self, t: int, st: tuple[int, int], f: int, low: bool = False) -> float:
        """What making form ``f`` of tensor ``t`` available from state ``st`` costs (fwd + bwd); ``low``: the
        least a prefetch window can leave of it (its forward communication hidden)."""
        prod, mask = st
        if prod < 0:
            return math.inf
        if f == prod or mask >> f & 1:
            return 0.0
        c = self.conversion(t, prod, f)
        if c is None:
            return math.inf
        again = self.resharded(t, prod)
        hidden = max(c.fwd - c.fwd_copies, 0.0) if low else 0.0  # in the forward, and where made again
        return (c.fwd - hidden) * (1 + again) + c.bwd

    def conversion(self, tid: int, src: int, dst: int):
        """:meth:`CostModel.conversion` of tensor ``tid`` between form ids ``src`` and ``dst`` (cached by
        the tensor's conversion class and the form ids: hashing layouts costs more than the lookup)."""
        key = (self._conv_class[tid], src, dst)
        hit = self._conv_ids.get(key, self._conv_ids)
        if hit is self._conv_ids:
            hit = self._conv_ids[key] = self.cost.conversion(tid, self.forms[src], self.forms[dst])
        return hit

    def prefetched(self, choices: dict[str, Signature]) -> float:
        """What a prefetching program holds besides the plan's memory sum: three neighbouring units' gathered
        copies of resharded parameters (:meth:`~hidup.search.memory.MemoryModel.plan_prefetched`); 0
        without prefetch."""
        if not self.prefetch:
            return 0.0
        params = [n.name for n in self.graph.nodes if n.op == "param"]
        reshard = frozenset(params if self.reshard is True else self.reshard)
        return self.memory.plan_prefetched(choices, reshard)

    def plan_memory(self, ks) -> float:
        """Bytes per rank of the choices ``ks``: every step's memory, the parameters' kept copies
        included (as :func:`hidup.search.schedule.evaluate` counts it); inf where a form change is
        impossible."""
        key, total = self.initial_key(), 0.0
        for i, k in enumerate(ks):
            res = self.step(i, k, key)
            if res is None:
                return math.inf
            step, key = res
            total += step.mem
        return total

    def initial_key(self) -> tuple:
        return ()

    def sig_label(self, i: int, k: int) -> str:
        return f"{self.order[i].name}: {self.sigs[i][k]}"
