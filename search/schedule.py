"""Iteration time of a plan, without and with duplication, and the evaluation of a full plan.

Without duplication
-------------------
The forward adds up: ``forward = sum(compute_f + comm_f)``, where a prefetched gather of a parameter
(issued one unit early, :mod:`hidup.codegen.prefetch`) counts only the communication its window does
not hide: ``comm_f = copies + max(0, comm - w)``, ``w`` the window of the previous unit's least forward
compute allotted to it (:mod:`hidup.search.problem`, "Prefetched gathers"; one function,
:meth:`~hidup.search.problem.Problem.forward_charge`, prices it for the DP, the ILP and
:func:`evaluate` alike, through ``Step.fwd``; a resharded weight's second gather, blocking in the
backward below, is ``copies + max(0, comm - w_b)`` likewise,
:meth:`~hidup.search.problem.Problem.again_charge`).  With duplication the stage items are not changed
by prefetch: the copies' schedule below overlaps their collectives already.  In the backward, the gradient
all-reduces of replicated parameters are bucketed and asynchronous (:mod:`hidup.codegen.grads`), and so
are the reduce-scatters of a prefetched gather's gradient (a stored-split weight's, as FSDP2 runs them on
a stream of their own; :meth:`~hidup.search.problem.Problem.scatters_async` says which, ``Step.bwd_async``
holds both): they overlap the backward of the nodes before them, sharing the network (one communicator,
first come first served) with the blocking backward collectives of form changes.  Over the nodes in
reverse order, with ``Tc`` the compute stream's time and ``Tn`` the network's::

    Tc += compute_b                                        (the node's backward)
    blocking collectives:   Tc = Tn = max(Tc, Tn) + comm   (the stream waits for them)
    asynchronous:           Tn = max(Tn, Tc) + comm        (launched, not waited for)

and ``backward = max(Tc, Tn)`` (the optimizer waits for every gradient).  A compiled program waits for
a prefetched gather's reduce-scatter where the backward of the graph that issued it ends (the start of
a gradient-bucket segment, the node after an all-to-all dispatcher's graph break: :func:`graph_ends`)::

    end of a graph's backward:  Tc = max(Tc, the Tn its last reduce-scatter ended at)

The DP minimizes the serialized sum ``sum(compute + comm)`` of both passes, an upper bound of this time
(:attr:`Evaluation.objective`), and a second DP the same sum without the asynchronous collectives, a
lower bound (``hide_grad_sync``, :func:`hidup.search.dp.solve`): the first undervalues plans whose
gradient sync overlaps the backward (data parallelism), the second overvalues them; the search
times both answers with this recurrence and compares candidate plans on ``total = forward +
backward``.

With duplication: stages and the (time, debt, slack) recurrence
----------------------------------------------------------------
The rank runs two half-batch copies A and B on two streams; the GPU's compute and its network each
serve one task at a time.  A *stage* starts at every node that needs communication (its input
conversions) and extends over the following nodes that need none.  Per copy a stage is
``(mA, mB, cA, cB)``: the communication of A and of B and the computation of A and of B
(:mod:`hidup.search.cost` says how each splits).  Within a stage A communicates, then A computes
while B communicates, then B computes while the next stage's communication of A runs.

The state after a stage is ``(T, d, s)``: ``T`` the time at which B's communication of the stage
ends, ``d`` (the *debt*) B's pending computation of the stage, ``s`` (the *slack*) how long B's
communication outlasts A's computation (room for A's computation of later comm-free nodes).

* a node with communication opens a stage::

      T' = T + max(mA, d) + max(cA, mB)     d' = cB     s' = max(0, mB - cA)

* a node without communication joins the open stage::

      T' = T + max(0, cA - s)               d' = d + cB  s' = max(0, s - cA)

* the pass ends at ``T + d``.

Each equation describes a feasible two-stream schedule, so the prediction is an achievable time.
The future cost grows with ``T`` and ``d`` and shrinks with ``s``.  More precisely, ``T`` only adds
to the end time, and the end time grows by at most ``x`` when ``d`` grows by ``x`` (an open stage
adds ``max(mA, d)``, a joining node carries ``d`` on, the pass ends at ``T + d``) or when ``s``
shrinks by ``x`` (a joining node turns lost slack into at most as much ``T``, keeps the rest as
slack; an open stage forgets ``s``).  So ``(T, d, s)`` is never worse than ``(T', d', s')`` when
``T + max(0, d - d') + max(0, s' - s) <= T'`` (in particular when it is no worse in all three), and
since the two passes add, the DP compares the sum of both passes' sides: that dominance defines the
Pareto set the DP keeps.

The backward pass runs the nodes in reverse: node ``n``'s backward compute, then the backward
collectives of the conversions charged to ``n``.  Reversing time turns that sequence into a forward
one with "communication before compute" per node, and the makespan of a two-resource schedule is
unchanged by time reversal; so the backward pass uses the same recurrence over the nodes in forward
order with the backward items ``(mA, mB, cA, cB)``, with its own ``(T, d, s)``.
Iteration time with duplication = forward ``T + d`` + backward ``T + d``.

The optimizer step follows both passes and overlaps nothing: ``optimizer = optimizer_s_per_byte *
local trainable parameter bytes`` (the profile's measured Adam step; sharded parameters update only
their slice), or, where the profile has not measured it, a fused Adam step's roofline, ``7 * bytes /
memory_bandwidth`` (:meth:`~hidup.profiler.Profile.optimizer_time`).  The DP does not see it (its
objective covers the two passes); candidate plans are compared on ``total = forward + backward +
optimizer``.

Under ZeRO (:mod:`hidup.search.cost`, "ZeRO") the optimizer steps ``1/N`` of each split parameter
(:meth:`~hidup.search.memory.MemoryModel.stepped`) and the updated rows are then all-gathered, exposed:
``zero_gather = sum of A(b)`` over the split parameters, added to ``total`` (and reported when it is
not 0).  The DP does not see it either.

With the optimizer offloaded to the host (``problem.offload``, :mod:`hidup.codegen.offload`) the step is
priced by :meth:`~hidup.profiler.Profile.offload_time` of the same stepped bytes instead: their gradients
copied to the host, the CPU's Adam step and the weights copied back, one after the other and exposed.

Predicted times reported for a plan: ``forward``, ``backward``, ``optimizer``, ``total``; ``comm``
the summed collective time (both copies; without duplication the exposed part of prefetched gathers);
``exposed_comm = max(0, forward + backward - compute)`` with ``compute`` the summed compute time (with
duplication the two half-batch copies' ``cA + cB``, so a copy's slower half-size kernels are not
counted as communication).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hidup.ir import DTYPE_BYTES, REPLICATE, graph_segments
from hidup.search.memory import MEMORY_PARTS
from hidup.search.problem import Problem, SearchError, Step

__all__ = [
    "dup_apply",
    "dup_apply_stages",
    "recurrence_source",
    "generate",
    "Evaluation",
    "evaluate",
    "overlapped_backward",
    "peak",
    "graph_ends",
    "compress_steps",
    "ZERO_DUP",
]

ZERO_DUP = (0.0, 0.0, 0.0)  # (T, d, -s)


# One node of the duplicated recurrence (module docstring), as source over variable names, so that
# the reference function below and the DP's inlined loops (:mod:`hidup.search.dp`) are generated
# from this one statement of it.  ``ns`` is minus the slack (lower is better); ``opens``: whether the
# node has communication (it opens a stage).
_RECURRENCE = """\
if {opens}:
    {T} = {T} + ({mA} if {mA} > {d} else {d}) + ({cA} if {cA} > {mB} else {mB})
    {d}, {ns} = {cB}, ({cA} - {mB} if {mB} > {cA} else 0.0)
else:
    _s = -{ns}
    {T}, {d}, {ns} = {T} + ({cA} - _s if {cA} > _s else 0.0), {d} + {cB}, ({cA} - _s if _s > {cA} else 0.0)
"""


def recurrence_source(
    indent: int, T: str = "T", d: str = "d", ns: str = "ns", item: str = "mA mB cA cB", opens: str | None = None
) -> str:
    """Python source applying one item ``(mA, mB, cA, cB)`` (variable names in ``item``) to the
    state variables ``T, d, ns`` in place, indented by ``indent`` spaces."""
    mA, mB, cA, cB = item.split()
    body = _RECURRENCE.format(T=T, d=d, ns=ns, mA=mA, mB=mB, cA=cA, cB=cB, opens=opens or f"{mA} > 0.0 or {mB} > 0.0")
    return "".join(" " * indent + line + "\n" for line in body.splitlines())


def generate(name: str, source: str, namespace: dict | None = None):
    """The function ``name`` defined by ``source`` (generated from :func:`recurrence_source`)."""
    scope = dict(namespace or {})
    exec(compile(source, f"<hidup.search.schedule: {name}>", "exec"), scope)  # our own template
    return scope[name]


dup_apply = generate(
    "dup_apply",
    "def dup_apply(T, d, ns, item):\n    mA, mB, cA, cB = item\n" + recurrence_source(4) + "    return T, d, ns\n",
)
dup_apply.__doc__ = """One node of the duplicated recurrence: ``(T, d, ns)`` after ``item = (mA, mB, cA, cB)``;
``ns`` is minus the slack (lower is better)."""


def compress_steps(items: list[tuple[float, float, float, float]]) -> tuple[tuple[float, float, float, float], ...]:
    """Merge comm-free items into the preceding stage (exact: a stage's items only add up)."""
    out: list[list[float]] = []
    for mA, mB, cA, cB in items:
        if (mA > 0.0 or mB > 0.0) or not out:
            out.append([mA, mB, cA, cB])
        else:
            out[-1][2] += cA
            out[-1][3] += cB
    return tuple(tuple(x) for x in out)


def dup_apply_stages(T: float, d: float, ns: float, stages) -> tuple[float, float, float]:
    """Apply a compressed item list (see :func:`compress_steps`)."""
    for st in stages:
        T, d, ns = dup_apply(T, d, ns, st)
    return T, d, ns


@dataclass
class Evaluation:
    """Predictions for one complete assignment of signatures."""

    ks: list[int]
    duplication: bool
    forward: float
    backward: float
    compute: float
    comm: float
    memory: dict[str, float]
    steps: list[Step] = field(repr=False)
    stages: list[list[str]] = field(repr=False)
    objective: float = 0.0  # what the DP minimizes: both passes with duplication, their serialized sum without
    optimizer: float = 0.0  # the optimizer step after the passes
    zero_gather: float = 0.0  # ZeRO's all-gather of the updated rows after the optimizer step

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer + self.zero_gather

    @property
    def exposed_comm(self) -> float:
        return max(0.0, self.forward + self.backward - self.compute)

    def times(self) -> dict[str, float]:
        return {
            "forward": self.forward,
            "backward": self.backward,
            "optimizer": self.optimizer,
            **({"zero_gather": self.zero_gather} if self.zero_gather else {}),
            "comm": self.comm,
            "exposed_comm": self.exposed_comm,
            "total": self.total,
        }


def evaluate(problem: Problem, ks: list[int], duplication: bool) -> Evaluation:
    """Cost of choosing signature ``ks[i]`` at every position ``i`` (same model as the DP)."""
    if len(ks) != problem.n:
        raise ValueError(f"evaluate: expected {problem.n} choices, got {len(ks)}")
    key = problem.initial_key()
    steps: list[Step] = []
    for i, k in enumerate(ks):
        res = problem.step(i, k, key)
        if res is None:
            raise SearchError(
                f"node {problem.order[i].name}: signature {problem.sigs[i][k]} needs a form change "
                "that cannot be made (only a parameter produces 'replicate')"
            )
        step, key = res
        steps.append(step)
    if duplication:
        f = b = ZERO_DUP
        comm = compute = 0.0  # the two half-batch copies' compute, not the whole batch's
        for s in steps:
            f = dup_apply(*f, s.fwd_item)
            b = dup_apply(*b, s.bwd_item)
            comm += s.fwd_item[0] + s.fwd_item[1] + s.bwd_item[0] + s.bwd_item[1]
            compute += s.fwd_item[2] + s.fwd_item[3] + s.bwd_item[2] + s.bwd_item[3]
        forward, backward = f[0] + f[1], b[0] + b[1]
    else:
        compute = sum(s.compute for s in steps)
        forward = sum(s.fwd for s in steps)
        comm = forward + sum(s.bwd for s in steps) - compute
        backward = overlapped_backward(steps, graph_ends(problem, ks))
    parts = [0.0] * 5
    for i, k in enumerate(ks):
        for j, v in enumerate(problem.mem_parts[i][k]):
            parts[j] += v
    parts[MEMORY_PARTS.index("activations")] += sum(s.copies for s in steps)  # parameters' kept copies
    memory = dict(zip(MEMORY_PARTS, parts))
    memory["total"] = sum(parts)
    choices = {problem.order[i].name: problem.sigs[i][k] for i, k in enumerate(ks)}
    prefetch = problem.prefetched(choices)
    memory.update(problem.memory.plan_peak(choices, memory, prefetch), prefetch=prefetch)
    memory["bound"] = sum(s.mem for s in steps)  # the DP's terms (Problem.plan_memory): never below the peak bound
    stages: list[list[str]] = []
    for i, s in enumerate(steps):
        if not stages or s.fwd_item[0] > 0.0 or s.fwd_item[1] > 0.0:
            stages.append([])
        stages[-1].append(problem.order[i].name)
    objective = forward + backward if duplication else sum(s.fwd + s.bwd for s in steps)
    stepped, gather = memory["grads"], 0.0
    if problem.zero:  # the optimizer steps 1/N of a split parameter, whose rows are then all-gathered
        params = [(i, problem.sigs[i][k]) for i, k in enumerate(ks) if problem.order[i].op == "param"]
        stepped = sum(problem.memory.stepped(problem.order[i], sig) for i, sig in params)
        gather = sum(
            problem.cost.zero_gather(t, f) for i, sig in params for t, f in zip(problem.order[i].outputs, sig.outputs)
        )
    if problem.offload:
        optimizer = problem.profile.offload_time(stepped)
        memory["host"] = problem.memory.host_bytes(stepped)
    else:
        optimizer = problem.profile.optimizer_time(stepped)
    return Evaluation(
        list(ks),
        duplication,
        forward,
        backward,
        compute,
        max(0.0, comm),
        memory,
        steps,
        stages,
        objective,
        optimizer,
        gather,
    )


def peak(memory: dict[str, float]) -> float:
    """The bytes per rank a plan's memory (``Evaluation.memory``, ``Plan.memory``) needs at its peak: the
    memory model's peak bound (:meth:`~hidup.search.memory.MemoryModel.plan_peak`), what the memory budget
    constrains; the sum of its parts where it has none (a plan written before the bound existed)."""
    return memory.get("peak", memory["total"])


def overlapped_backward(steps: list[Step], ends: frozenset[int] = frozenset()) -> float:
    """Backward time without duplication, the gradient all-reduces of replicated parameters and the
    reduce-scatters of prefetched gathers overlapping the rest of the backward (module docstring); at
    the positions ``ends`` a compiled graph's backward ends, waiting for the reduce-scatters it issued."""
    tc = tn = scattered = 0.0
    for i in range(len(steps) - 1, -1, -1):
        s = steps[i]
        tc += s.bwd_compute
        blocking = s.bwd_block
        if blocking > 0.0:
            tc = tn = max(tc, tn) + blocking
        if s.bwd_async > 0.0:
            tn = max(tn, tc) + s.bwd_async
            if s.bwd_scatter > 0.0:
                scattered = tn  # one network, first come first served: done when the network gets here
        if i in ends:
            tc = max(tc, scattered)
    return max(tc, tn)


def graph_ends(problem: Problem, ks: list[int]) -> frozenset[int]:
    """The positions whose backward ends a compiled graph of the program under plan ``ks``: the first call
    node of every gradient-bucket segment but the first (:func:`hidup.ir.graph_segments`; the replicated
    parameters are those the plan stores ``replicate`` on some mesh axis, at their stored bytes per
    rank), and the call node after each routed-experts node that dispatches by all-to-all (a graph
    break, :mod:`hidup.rules.dispatch`); none where the program is not compiled."""
    if not problem.cost.compiled:
        return frozenset()
    calls, labels, inputs, params, experts = problem.call_layout
    graph, mesh = problem.graph, problem.graph.mesh
    stored: dict[int, int] = {}
    for i in params:
        t = graph.tensors[problem.order[i].outputs[0]]
        form = problem.sigs[i][ks[i]].outputs[0]
        if any(f == REPLICATE for f in getattr(form, "forms", (form,))):
            stored[t.id] = math.prod(form.local_shape(t.shape, mesh)) * DTYPE_BYTES[t.dtype]
    new_bytes = [sum(stored.pop(t, 0) for t in read) for read in inputs]
    segments = graph_segments(labels, new_bytes, max(1, int(problem.cost.bucket_mb * 2**20)))
    ends = {i for k, i in enumerate(calls) if k and segments[k] != segments[k - 1]}
    for k in experts:  # the call after a node that dispatches by all-to-all starts a graph
        i = calls[k]
        if k + 1 < len(calls) and problem.cost.dispatch(problem.order[i], problem.sigs[i][ks[i]]) is not None:
            ends.add(calls[k + 1])
    return frozenset(ends)
