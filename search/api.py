"""``search(graph, profile)`` and ``forced(graph, profile, style)``: from a graph to a :class:`Plan`.

With ``duplication=True`` the DP searches twice, with the duplicated and the plain cost model, and
both results are priced both ways; the plan keeps the fastest (choices, execution mode) pair, so its
prediction is never worse than running the same choices without duplication, nor worse than the
best plan without duplication.  ``plan.duplication`` records the mode the plan should run in.  The
ILP always optimizes the plain cost (compute + communication); its choices are then priced both ways.

One search
----------
A search of one graph under one set of options is a :class:`SearchRun` (a search with
``reshard="auto"`` or on a mesh makes several, "Resharding" and "Meshes" below).  It tries the sets of
recomputed layers in turn ("Recomputation"), each a :class:`RecomputeTrial`: the DP (or the ILP) in
each mode under the memory budget, with the DP searches that do not wait on each other run beside
each other in forked processes (:mod:`hidup.search.modes`), then every candidate plan priced exactly;
the run keeps the fastest plan that fits.  The run holds what its trials share: the problems, one
per profile and set of recomputed layers, and the plans with their fewest recomputed layers that
fit; a trial holds its own candidate plans and their evaluations.

Factors inside the distributed program
--------------------------------------
A profile's corrections ``dist_scale`` and ``dist_dup_scale`` (:mod:`hidup.profiler.corrections`) are
fitted on the ranks to the plans a search finds without them, in each mode.  They hold near those plans: a plan
with much more communication slows the compute beside it more than the factor says.  So the search
runs with both factors taken as 1, and the factors then price the plan it found in both modes and
keep the faster: they settle the mode, not the plan.  Searching with them instead found, for
BERT-SGMoE on 4 H200s, plans that trade compute for per-copy weight all-gathers the factor prices as
hidden; those ran 3-4% slower (``git show 6b9b137:docs/archive/benchmarks-2026-11-21.md``).

Recomputation
-------------
Running a repeated layer's forward again in the backward (:mod:`hidup.codegen.recompute`) trades
time for activation memory; the search prices both (:mod:`hidup.search.problem`,
:mod:`hidup.search.memory`).  A layer is recomputed *whole* (``plan.recompute``: it keeps its inputs)
or *selectively* (``plan.recompute_selective``: it keeps its inputs and the outputs of its matmuls,
attention and activation form changes, and runs only the ops between them again): selective
recomputation saves less memory per layer for much less time.  Recomputation never makes a plan
faster, so ``recompute="auto"`` considers it only under a memory budget, and only when the fastest
plan without one (no duplication) does not fit it.  It then searches with every repeated layer
recomputed selectively, then with every layer recomputed whole -- each first without the budget, and
no further when even that plan is no faster than the fastest plan in hand that fits.  From the choices
of each plan that fits it prices the leaner combinations (:func:`_leanest`), each with the fewest
layers recomputed that still fit: selectively on the first ``k`` layers (from a selective plan); whole
on the first ``k``; whole on the first ``k`` and selectively on the next ``j``, the least ``k`` first.
The run keeps the fastest plan that fits.  The leaner forms are a few prices and bisections on the
memory model's per-node terms; the searches are those of whole recomputation and one more (the
selective one), the whole one mostly stopped by its plan without the budget, which selective
recomputation of a plan that fits usually beats.  Searching the whole trial after a selective plan
fits still pays: the selective search may fit only with leaner choices (weights stored split) that a
mix of whole and selective layers does not need.  ``"on"`` recomputes every repeated layer whole,
``"selective"`` every repeated layer selectively, ``"off"`` none.

Resharding
----------
A parameter stored split is converted (all-gathered) for the ops that read it, and the copy an op's
backward keeps lives until that backward (the search counts it, :mod:`hidup.search.problem`).
Resharding (:mod:`hidup.codegen.reshard`) frees it after the forward and gathers again in the backward:
less memory for one more collective per such parameter.  ``reshard="on"`` reshards every parameter the
plan stores split (``plan.reshard`` lists them); ``"auto"`` searches as ``"off"`` and, only when that
plan misses the memory budget or needs recomputation to fit it, searches again with ``"on"`` and keeps
the better plan (the one that fits; both fitting, the faster: resharding repeats a collective where
recomputation repeats a layer's compute too).

On a device mesh, where the budget is met by its price (a DP beam search on a graph of
``PRICE_MIN_POSITIONS`` positions or more, :mod:`hidup.search.dp`), a plan that fits by recomputing is
not searched again (that search would be a whole mesh search): resharding
changes nothing inside a recomputed layer (its region gathers the weights again anyway) and adds a
gather outside, so it can only make that plan faster by letting fewer layers be recomputed.  Its
choices are priced with resharding and the fewest recomputed layers that then fit, and that plan is
kept when faster; where the memory model's per-node terms, which count no kept copy, show that no
fewer layers fit, nothing is priced.  This is a heuristic: a search with resharding on could find other
choices.  On Llama-3-70B's 8x8 mesh under 80 GB that second search took 35 of the search's 69 s and
found a plan 7% slower than the first one (``docs/scale.md``).

ZeRO
----
A replicated weight keeps by default its whole gradient and Adam state on every rank; ZeRO
(:mod:`hidup.codegen.zero`) splits them over the ranks for an all-gather of the updated rows after the
optimizer (:mod:`hidup.search.cost` and :mod:`hidup.search.memory`, "ZeRO").  It never makes a plan
faster, so ``zero="auto"`` considers it only under a memory budget, as resharding: the plan found
without it (resharding and recomputation resolved as asked) is kept when it fits without recomputing;
else the search runs again with ZeRO-2 on every replicated weight whose rows the world divides and
keeps the better plan (the one that fits; both fitting, the faster).  Auto tries stage 2 alone: in
this cost model it is at least as fast as stage 1 (a reduce-scatter in place of an all-reduce) and
saves more.  ``"1"``/``"2"`` search with that stage, ``"off"`` without; ``plan.zero`` lists the
weights split.  On a device mesh ``"auto"`` stays off and a stage is refused (not supported yet).

Optimizer offload
-----------------
The last lever: Adam's state kept in host memory and stepped by the host's CPU
(:mod:`hidup.codegen.offload`; :mod:`hidup.search.memory` drops the state from the device,
:mod:`hidup.search.schedule` prices the gradients' copy to the host, the CPU's step and the weights' copy
back by the profile's ``host_bandwidth`` and ``host_optimizer_s_per_byte``).  It costs seconds per step on a
large model, so ``offload="auto"`` uses it only when nothing else fits: the search runs without it (ZeRO,
resharding and recomputation resolved as asked), and only when that finds no plan within the memory
budget does it run again with the optimizer offloaded (``plan.offload``; ``plan.options["offload_used"]``
says why, and ``hidup show`` prints it).  With the optimizer offloaded ``zero="auto"`` is ZeRO-2 (on one
axis): an offloaded step costs ``b / host_bandwidth`` twice and the CPU's ``b * host_optimizer_s_per_byte``
for the ``b`` bytes a rank steps, and ZeRO divides ``b`` of the replicated weights by the ranks for an
all-gather on the device's links, hundreds of times faster than the host's step.  ``"optimizer"``
searches with it, ``"off"`` without.

Duplication under a memory budget
---------------------------------
The memory-aware DP with duplication carries debt, slack and memory for both copies in every point,
and is the dearest search there is (on an 8x8 Mixtral under 80 GB, most of the search's time).
The duplicated plan found without the budget (a cheap search, made first) is a bound: within the
budget the same DP finds no duplicated plan whose two passes take less.  So once the plain mode's
budgeted answer is in, the duplicated mode's budgeted search, running beside it
(:mod:`hidup.search.modes`), is waited for only when those passes alone are faster than the best
plan in hand that fits; otherwise it is stopped.  Searched by price (:mod:`hidup.search.dp`, "A
memory budget by its price"), it also stops itself once its Lagrangian bound reaches the best plan
that fits among those in hand when it started.

Meshes
------
On a graph traced for a device mesh of several axes (:mod:`hidup.ir`, "Meshes") every op offers the
products of one signature per axis: 25-36 on two axes where one axis offers 5-6, and the DP's beam,
sized for one axis, then keeps the wrong states.  :func:`_search_mesh` searches axis by axis instead:
first with the outer axis (across nodes on a cluster) kept to :data:`OUTER_KINDS` -- data parallel,
parameters replicated or stored split, ops replicated -- and the inner axes free: a seed, searched
without duplication, under the memory budget (by price, :mod:`hidup.search.dp`) and with a beam of at
most :data:`MESH_SEED_STATES` states (its product space makes every state dear); then, for up to
:data:`MESH_ROUNDS` rounds, with one axis free and every other axis's forms fixed to the best plan's,
keeping a plan only when it is better: it fits the budget where the current one does not, or it is
faster (an axis whose fixed forms are those it was last searched with is not searched again).  When
the seed finds no plan that fits the budget, the rounds start instead from the better of the *lean*
seeds, one per axis, each searched under the budget with that axis FSDP-style (weights stored split,
ops data parallel) and the others free.  Each step is the one-axis search above under a signature
filter that keeps the current plan, so among fitting plans the prediction never grows; the
result is a local optimum of the product space, not its global one.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable

from hidup.ir import (
    FORM_CHANGE_OPS,
    OFFLOAD_CHOICES,
    RECOMPUTE_CHOICES,
    RESHARD_CHOICES,
    ZERO_CHOICES,
    Graph,
    Node,
    Signature,
    axis_forms,
    block_label,
    mesh_text,
    zero_stage,
)
from hidup.optionset import OptionSet
from hidup.plan.record import ConversionRecord, MeshStepRecord, Plan, layer_of, model_record
from hidup.precision import casts_on_wire, check_reduce_dtype
from hidup.profiler import load
from hidup.rules.dispatch import host_synchronizes
from hidup.search import dp, ilp
from hidup.search.memory import Recompute
from hidup.search.modes import CallerWork, solve_beside, solve_modes
from hidup.search.problem import Models, Problem, SearchError
from hidup.search.schedule import Evaluation, evaluate, peak

__all__ = [
    "search",
    "SearchOptions",
    "forced",
    "make_plan",
    "price",
    "plan_indices",
    "repeated_layers",
    "restrict_for",
    "restrict_per_axis",
    "STYLES",
    "RECOMPUTE",
]

STYLES = ("data", "tensor", "expert", "expert-all-gather", "expert-all-to-all", "fsdp")
RECOMPUTE, RESHARD = RECOMPUTE_CHOICES, RESHARD_CHOICES
ZERO_STAGE = {"off": 0, "1": 1, "2": 2}  # a resolved ``zero`` option -> the stage searched
# style -> (preferred kinds in order, kinds never used)
_STYLE_RULES = {
    "data": (("data",), {"tensor", "expert"}),
    "tensor": (("tensor", "data"), {"expert"}),
    "expert": (("expert", "data"), {"tensor"}),
    "expert-all-gather": (("expert", "data"), {"tensor"}),
    "expert-all-to-all": (("expert", "data"), {"tensor"}),
    "fsdp": (("data",), {"tensor", "expert"}),
}


# the routed experts' token dispatcher a style forces (Signature.impl, hidup.rules.dispatch.DISPATCHERS)
_STYLE_IMPL = {"expert-all-gather": "local_experts", "expert-all-to-all": "all_to_all"}


def _dispatcher_ok(style: str, sig: Signature, offered: list[Signature]) -> bool:
    """Whether expert signature ``sig`` uses the dispatcher ``style`` forces, where the node offers it."""
    impl = _STYLE_IMPL.get(style)
    if impl is None or sig.kind != "expert" or sig.impl == impl:
        return True
    return not any(s.kind == "expert" and s.impl == impl for s in offered)


def _progress_fn(progress, label: str):
    if progress is None or progress is False:
        return None
    if callable(progress):
        return progress
    state = {"last": -1}
    live = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if done == total:
            print(f"\rsearch ({label}): done, {total} nodes", file=sys.stderr, flush=True)
        elif live and pct // 10 != state["last"] // 10:
            state["last"] = pct
            print(f"\rsearch ({label}): {pct:3d}%", end="", file=sys.stderr, flush=True)

    return show


@dataclass(frozen=True)
class SearchOptions(OptionSet):
    """What a search optimizes and how far it looks (:func:`search` takes them as keywords too).

    ``algorithm`` ``"dp"`` or ``"ilp"``; ``duplication`` whether duplicated plans are considered;
    ``memory_budget`` bytes per rank (None: none); ``precision`` the FLOP rate used for float32 ops
    (fp32 or tf32; bf16/fp16 model autocast); ``restrict(node, sig)`` filters signatures;
    ``max_states`` / ``max_points`` bound the DP (None: exact; ``"auto"`` states:
    :func:`hidup.search.dp.beam_width`); ``reuse_blocks`` solves a repeated layer once per entry
    state (:mod:`hidup.search.segments`); ``optimizer_factor`` optimizer-state bytes per parameter
    byte (Adam: 2); ``time_limit`` seconds for the ILP, its DP seed included (None: none); the
    ``explain`` heaviest nodes get a runner-up in the plan; ``cuda_graphs`` prices the fixed cost per
    op of a step captured as one CUDA graph (how ``hidup train`` runs on GPUs; the profile's
    ``op_overhead_graph``) instead of eager dispatch; ``compiled`` prices the program as inductor runs
    it (views free, pointwise chains fused: :mod:`hidup.search.cost`, "Compiled programs").
    ``recompute`` says which repeated layers run their forward again in the backward instead of keeping
    activations (module docstring, "Recomputation"): ``"off"``, ``"on"`` (every repeated layer, whole),
    ``"selective"`` (every repeated layer, selectively), ``"auto"`` (the fastest plan that fits
    ``memory_budget``, with none, selective, whole or both), or a list of block labels (recomputed
    whole).  ``reshard`` (``"auto"``, ``"on"``, ``"off"``) says whether the parameters stored split have
    their gathered copies made again in the backward instead of kept (module docstring, "Resharding").
    ``zero`` (:data:`hidup.ir.ZERO_CHOICES`: ``"auto"``, ``"off"``, ``"1"``, ``"2"``) whether the replicated
    weights keep their gradient and optimizer state split over the ranks (module docstring, "ZeRO").
    ``offload`` (:data:`hidup.ir.OFFLOAD_CHOICES`: ``"auto"``, ``"off"``, ``"optimizer"``) whether Adam's state
    lives in host memory, stepped by the CPU (module docstring, "Optimizer offload"; ``"auto"``: only
    when no plan fits ``memory_budget`` without it).
    ``reduce_dtype`` (:data:`hidup.precision.REDUCE_DTYPES`: ``"fp32"``, ``"bf16"``) the dtype the
    float32 parameters' gradients are summed over ranks in; ``"bf16"`` needs ``precision="bf16"``
    (:mod:`hidup.precision`, "Gradients reduced in bf16"); ``plan.reduce_dtype`` records it.
    ``prefetch`` prices the gathers of stored-split parameters as the program issues them by default, one
    unit (layer) early, their communication overlapping that unit's compute (:mod:`hidup.search.problem`,
    "Prefetched gathers"); False prices them blocking, as ``CompileOptions(prefetch=False)`` runs them."""

    algorithm: str = "dp"
    duplication: bool = True
    memory_budget: float | None = None
    precision: str = "fp32"
    restrict: Callable[[Node, Signature], bool] | None = None
    max_states: int | str | None = dp.DEFAULT_MAX_STATES
    max_points: int | None = dp.DEFAULT_MAX_POINTS
    reuse_blocks: bool = True
    optimizer_factor: float = 2.0
    time_limit: float | None = ilp.DEFAULT_TIME_LIMIT
    explain: int = 6
    cuda_graphs: bool = True
    compiled: bool = False
    recompute: str | tuple | list | frozenset = "auto"
    reshard: str = "auto"
    zero: str = "auto"
    reduce_dtype: str = "fp32"
    prefetch: bool = True
    offload: str = "auto"
    WHAT = "search"

    def check(self) -> None:
        if self.algorithm not in ("dp", "ilp"):
            raise ValueError(f"algorithm must be 'dp' or 'ilp', got {self.algorithm!r}")
        if isinstance(self.recompute, str) and self.recompute not in RECOMPUTE:
            raise ValueError(
                f"recompute must be one of {', '.join(RECOMPUTE)} or a list of layers, got {self.recompute!r}"
            )
        if self.reshard not in RESHARD:
            raise ValueError(f"reshard must be one of {', '.join(RESHARD)}, got {self.reshard!r}")
        if self.zero not in ZERO_CHOICES:
            raise ValueError(f"zero must be one of {', '.join(ZERO_CHOICES)}, got {self.zero!r}")
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD_CHOICES)}, got {self.offload!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        check_reduce_dtype(self.reduce_dtype, self.precision)


def search(
    graph: Graph,
    profile,
    options: SearchOptions | None = None,
    *,
    world_size: int | None = None,
    progress=None,
    model_source=None,
    **changes,
) -> Plan:
    """Search the fastest plan for ``graph`` under ``profile`` (a Profile, builtin name or path),
    with ``options`` (:class:`SearchOptions`) updated by the keyword ``changes``
    (``search(graph, profile, memory_budget=80e9, precision="bf16")``).

    A graph traced with ``half_batch=True`` (``graph.half``) lets duplication's half-batch copies be
    priced from ops measured at their own shapes (see :mod:`hidup.search.cost`).
    ``model_source`` (``"package.module:function"`` or ``(spec, args)``) is recorded in the plan so that
    ``hidup show/train/verify --plan`` rebuild the model (:func:`hidup.plan.model_record`).
    The ILP stopped by ``time_limit`` with a plan whose optimality is unproven warns and returns that
    plan (:func:`hidup.search.ilp.optimize`), and ``plan.options["solver"]`` records the status,
    incumbent, bound and gap; with no plan it raises :class:`SearchError`.  ``progress`` True prints
    the DP's progress and the ILP's incumbent and bound every few seconds on stderr; a callable gets
    the DP's ``(done, total)``.
    """
    opts = SearchOptions.of(options, **changes)
    record = None if model_source is None else model_record(model_source)
    profile = _loaded(profile)
    if world_size is not None and world_size != graph.world_size:
        raise SearchError(
            f"world_size={world_size} but the graph was traced for {graph.world_size} ranks; its "
            "signatures only fit that world size. Fix: trace again with world_size="
            f"{world_size}, or omit world_size."
        )
    base, profile = profile, profile.launched(opts.cuda_graphs, opts.compiled)
    if opts.duplication and graph.copy_reason:
        warnings.warn(f"hidup.search: duplication stays off: {graph.copy_reason}", stacklevel=2)
        opts = replace(opts, duplication=False)
    if opts.cuda_graphs and _offers_host_sync(graph):
        plan, opts = _captured_or_not(graph, base, opts, progress)
    else:
        with dp.no_gc():
            plan = _search_all(graph, profile, opts, progress)
    plan.options["cuda_graphs"] = bool(opts.cuda_graphs)
    plan.options["compiled"] = bool(opts.compiled)
    if record is not None:
        plan.model, plan.model_source = record["model"], record
    return plan


def _offers_host_sync(graph: Graph) -> bool:
    return any(host_synchronizes(s) for n in graph.nodes for s in n.signatures)


def _captured_or_not(graph: Graph, base, opts: SearchOptions, progress) -> tuple[Plan, SearchOptions]:
    """A step captured as one CUDA graph cannot run a node that reads split sizes on the host (the
    routed experts' all-to-all dispatcher, :func:`hidup.rules.dispatch.host_synchronizes`): the better of
    the captured plan without such nodes and the uncaptured plan that may use them, each priced as it
    would run (``base``: the profile before :meth:`~hidup.profiler.Profile.launched`).  Returns the
    plan and the options it was priced under."""
    user = opts.restrict

    def capturable(node: Node, sig: Signature) -> bool:
        return not host_synchronizes(sig) and (user is None or user(node, sig))

    eager_opts = replace(opts, cuda_graphs=False)
    with dp.no_gc():
        try:
            captured = _search_all(
                graph, base.launched(True, opts.compiled), replace(opts, restrict=capturable), progress
            )
        except SearchError:  # nothing fits without those nodes, or a forced style wants them
            captured = None
        eager = _search_all(graph, base.launched(False, opts.compiled), eager_opts, progress)
    if captured is None or (eager.dispatch and eager.predicted["total"] < captured.predicted["total"]):
        return eager, eager_opts
    return captured, opts


def _search_all(graph: Graph, profile, opts: SearchOptions, progress) -> Plan:
    """The plan of :func:`search`; the models its problems share (and the states they cached) are freed
    on return, before the cyclic collector runs again (it would otherwise walk them all once more)."""
    models = Models(graph)  # the prices every problem of this search shares
    mesh = len(graph.mesh) > 1
    return _offloading(
        lambda f: _zeroing(
            lambda z: _resharding(
                lambda o: (
                    _search_mesh(graph, profile, o, progress, models)
                    if mesh
                    else _search(graph, profile, o, progress, models)
                ),
                z,
                lambda plan: _resharded(graph, profile, z, models, plan),
            ),
            f,
            mesh,
        ),
        opts,
        mesh,
    )


def _offloading(run: Callable[[SearchOptions], Plan], opts: SearchOptions, mesh: bool) -> Plan:
    """``run(opts)`` with ``offload="auto"`` resolved (module docstring, "Optimizer offload"): searched as
    ``"off"``, and again with the optimizer offloaded only when no plan fits the memory budget.  With the
    optimizer offloaded ``zero="auto"`` is ZeRO-2 on one axis (it divides the offloaded step's work by the ranks)."""
    zero = "2" if opts.zero == "auto" and not mesh else opts.zero  # with the optimizer offloaded
    if opts.offload != "auto":
        return run(replace(opts, zero=zero) if opts.offload == "optimizer" else opts)
    budget = opts.memory_budget
    try:
        plan, error = run(replace(opts, offload="off")), None
    except SearchError as e:
        plan, error = None, e.with_traceback(None)
    if budget is None or (plan is not None and _fits(plan, budget)):
        if plan is None:
            raise error
        plan.options["offload_requested"] = "auto"
        return plan
    try:
        again = run(replace(opts, offload="optimizer", zero=zero))
    except SearchError as e:
        if plan is None:
            raise SearchError(f"{error} With the optimizer offloaded to the host too (the last lever): {e}") from None
        again = None
    best = again if again is not None and (plan is None or _better(again, plan, budget)) else plan
    best.options["offload_requested"] = "auto"
    if best is again:
        best.options["offload_used"] = (
            f"no plan fits the memory budget of {budget / 2**30:.1f} GiB per rank without it"
            + (f" (the least found needs {peak(plan.memory) / 2**30:.1f} GiB)" if plan is not None else "")
        )
    return best


def _zeroing(run: Callable[[SearchOptions], Plan], opts: SearchOptions, mesh: bool) -> Plan:
    """``run(opts)`` with ``zero="auto"`` resolved (module docstring, "ZeRO"): searched as ``"off"``, and
    again with ZeRO-2 when that plan misses the memory budget or recomputes to fit it; the better is kept."""
    if mesh and opts.zero in ("1", "2"):
        raise SearchError(
            f"zero={opts.zero}: ZeRO splits replicated weights over the ranks of one axis; on a device mesh it "
            "is not supported yet. Fix: --zero auto or off for a mesh plan, or search for one axis"
        )
    if opts.zero != "auto":
        return run(opts)
    budget = opts.memory_budget
    try:
        plan, error = run(replace(opts, zero="off")), None
    except SearchError as e:
        plan, error = None, e.with_traceback(None)
    if mesh or (plan is not None and (budget is None or (_fits(plan, budget) and not recomputed(plan)))):
        if plan is None:
            raise error
        plan.options["zero_requested"] = "auto"
        return plan
    try:
        again = run(replace(opts, zero="2"))
    except SearchError:
        if plan is None:
            raise error from None
        again = None
    best = again if again is not None and (plan is None or _better(again, plan, budget)) else plan
    best.options["zero_requested"] = "auto"
    return best


def _offloaded(opts: SearchOptions) -> bool:
    """Whether a resolved ``offload`` option keeps Adam's state on the host."""
    return opts.offload == "optimizer"


def _loaded(profile):
    """``profile`` itself, or the profile a builtin name or a path names."""
    return load(profile) if isinstance(profile, str) or hasattr(profile, "__fspath__") else profile


def plan_indices(problem: Problem, plan: Plan) -> list[int]:
    """Each node's signature index in ``problem`` for ``plan``'s choices; ValueError when the plan
    was made for another graph."""
    ks = []
    for i, node in enumerate(problem.order):
        sig = plan.choices.get(node.name)
        if sig not in problem.sigs[i]:
            raise ValueError(
                f"plan signature {sig} of node {node.name} is not among its allowed signatures; "
                "the plan was made for another graph"
            )
        ks.append(problem.sigs[i].index(sig))
    return ks


def price(
    graph: Graph,
    profile,
    plan: Plan,
    precision: str = "fp32",
    cuda_graphs: bool = True,
    compiled: bool = False,
    prefetch: bool = True,
) -> dict[bool, Evaluation]:
    """``plan``'s choices, with its recomputed layers and resharded parameters, priced by the search's cost
    model, ``{False: without duplication, True: with}`` (:func:`hidup.search.schedule.evaluate`);
    ``cuda_graphs``, ``compiled`` and ``prefetch`` as in :func:`search`."""
    reshard = frozenset(getattr(plan, "reshard", None) or ())
    problem = Problem(
        graph,
        _loaded(profile).launched(cuda_graphs, compiled),
        precision,
        recompute=recomputed(plan),
        reshard=reshard,
        zero=plan.zero_stage,
        reduce_dtype=getattr(plan, "reduce_dtype", "fp32"),
        prefetch=prefetch,
        offload=getattr(plan, "offload", "off") != "off",
    )
    ks = plan_indices(problem, plan)
    return {mode: evaluate(problem, ks, mode) for mode in (False, True)}


def _fastest(evaluations: list[Evaluation]) -> Evaluation:
    """The evaluation with the least total (ties to duplication, then to the earlier)."""
    best: Evaluation | None = None
    for ev in evaluations:
        if (
            best is None
            or ev.total < best.total - 1e-15 * max(1.0, best.total)
            or (ev.total <= best.total and ev.duplication and not best.duplication)
        ):
            best = ev
    return best


def recomputed(plan: Plan) -> Recompute:
    """The layers ``plan`` recomputes, whole and selectively (a file without either: none)."""
    return Recompute(
        frozenset(getattr(plan, "recompute", None) or ()), frozenset(getattr(plan, "recompute_selective", None) or ())
    )


def repeated_layers(graph: Graph) -> frozenset[str]:
    """Block labels of the graph's repeated layers (what ``recompute`` may name)."""
    return frozenset(block_label(n.module) for n in graph.nodes if n.op == "call") - {""}


def _recompute_choices(graph: Graph, opts: SearchOptions) -> list[Recompute]:
    """The recomputed layers the search tries, in order (see :class:`SearchOptions` and the module
    docstring, "Recomputation")."""
    layers = repeated_layers(graph)
    if not isinstance(opts.recompute, str):
        unknown = sorted(set(opts.recompute) - layers)
        if unknown:
            raise SearchError(
                f"recompute names layers the model does not have: {', '.join(unknown[:5])}. Its "
                f"repeated layers: {', '.join(sorted(layers)[:8]) or 'none'}"
                f"{' ...' if len(layers) > 8 else ''}. Fix: name some of these, or use 'auto'"
            )
        return [Recompute(frozenset(opts.recompute))]
    if opts.recompute == "on" and layers:
        return [Recompute(layers)]
    if opts.recompute == "selective" and layers:
        return [Recompute(selective=layers)]
    if opts.recompute == "auto" and layers and opts.memory_budget is not None:
        return [Recompute(), Recompute(selective=layers), Recompute(layers)]
    return [Recompute()]


@dataclass(frozen=True)
class _Found:
    """A search's answer before it is packaged as a :class:`Plan` (:func:`make_plan` explains the
    heaviest nodes by pricing their runner-ups, which a mesh search needs only for the plan it keeps)."""

    problem: Problem
    best: Evaluation
    options: dict
    algorithm: str

    @property
    def choices(self) -> dict[str, Signature]:
        p = self.problem
        return {p.order[i].name: p.sigs[i][k] for i, k in enumerate(self.best.ks)}

    @property
    def predicted(self) -> dict[str, float]:
        return self.best.times()

    @property
    def memory(self) -> dict[str, float]:
        return self.best.memory

    def plan(self, explain: int) -> Plan:
        plan = make_plan(self.problem, self.best, self.algorithm, self.options, explain)
        plan.recompute = sorted(self.problem.recompute.whole, key=_layer_order)
        plan.recompute_selective = sorted(self.problem.recompute.selective, key=_layer_order)
        return plan


def _resharding(
    run: Callable[[SearchOptions], Plan],
    opts: SearchOptions,
    resharded: Callable[[Plan], Plan | None] | None = None,
) -> Plan:
    """``run(opts)``, with ``reshard="auto"`` resolved (module docstring, "Resharding"): searched as
    ``"off"``, and again as ``"on"`` when that plan misses the memory budget or recomputes to fit it; an
    ILP's time limit covers both searches.  Where the budget is met by its price (a beam search on a
    large graph: :func:`_reprices_resharding`), a plan that fits by recomputing is not searched again:
    ``resharded(plan)``, its choices with resharding and the fewest recomputed layers that then fit, is
    kept instead when it is faster (module docstring, "Resharding")."""
    if opts.reshard != "auto":
        return run(opts)
    budget = opts.memory_budget
    started = time.perf_counter()
    try:
        plan, error = run(replace(opts, reshard="off")), None
        plan.options["reshard_requested"] = "auto"
    except SearchError as e:
        plan, error = None, e.with_traceback(None)  # (its traceback would hold this frame: a cycle)
    if plan is not None and (budget is None or (_fits(plan, budget) and not recomputed(plan))):
        return plan
    again = resharded(plan) if plan is not None and _fits(plan, budget) and resharded is not None else None
    if again is not None:  # (``plan`` itself where resharding does not make it faster)
        again.options["reshard_requested"] = "auto"
        return again if _better(again, plan, budget) else plan
    limit = opts.time_limit
    if opts.algorithm == "ilp" and limit is not None:
        limit -= time.perf_counter() - started
        if limit <= 0:  # spent: the plan in hand, or why there is none
            if plan is None:
                raise error
            return plan
    try:
        again = run(replace(opts, reshard="on", time_limit=limit))
        again.options["reshard_requested"] = "auto"
    except SearchError:
        if plan is None:
            raise error from None
        return plan
    return again if plan is None or _better(again, plan, budget) else plan


def _reprices_resharding(opts: SearchOptions, models: Models) -> bool:
    """Whether ``reshard="auto"`` prices a plan that fits by recomputing again with resharding instead of
    searching again (:func:`_resharding`): on a device mesh (where that search is a whole mesh search),
    where the budget is met by its price, a DP beam search on a graph of at least
    :data:`hidup.search.dp.PRICE_MIN_POSITIONS` positions."""
    return (
        len(models.graph.mesh) > 1
        and opts.algorithm == "dp"
        and opts.max_states is not None
        and models.positions().n >= dp.PRICE_MIN_POSITIONS
    )


def _resharded(graph: Graph, profile, opts: SearchOptions, models: Models, plan: Plan) -> Plan | None:
    """``plan`` (searched with resharding off; it fits the budget by recomputing layers) with every
    parameter it stores split resharded and the fewest of its recomputed layers that then fit
    (:func:`_leanest`) when that is faster, else ``plan``; None where the search does not
    price resharding so (:func:`_reprices_resharding`).  Resharding changes nothing inside a
    recomputed layer (its region gathers the weights again anyway) and adds a gather elsewhere: it can
    only make the plan faster by letting fewer layers be recomputed, so where the memory model's
    per-node terms, which leave out every kept copy, show that no fewer layers fit, nothing is priced."""
    if not _reprices_resharding(opts, models):
        return None
    recompute = recomputed(plan)
    layers = sorted(recompute.whole, key=_layer_order)
    if not recompute.selective and _least(opts, models, plan.choices, _whole(layers), len(layers)) >= len(layers):
        return plan
    problem = Problem(
        graph,
        profile,
        opts.precision,
        opts.restrict,
        opts.optimizer_factor,
        recompute,
        models,
        reshard=True,
        zero=ZERO_STAGE.get(opts.zero, 0),
        reduce_dtype=opts.reduce_dtype,
        prefetch=opts.prefetch,
        offload=_offloaded(opts),
    )
    ks = plan_indices(problem, plan)
    modes = (False, True) if opts.duplication else (False,)
    budget = opts.memory_budget

    def fastest(problem: Problem) -> Evaluation | None:
        fitting = [ev for mode in modes for ev in [evaluate(problem, ks, mode)] if peak(ev.memory) <= budget]
        return _fastest(fitting) if fitting else None

    best = fastest(problem)
    if best is None:
        return plan
    fewer, _ = _leanest(opts, problem, best, models)
    best = fastest(fewer) if fewer is not problem else None
    if best is None or best.total >= plan.predicted["total"]:
        return plan
    return _Found(fewer, best, dict(plan.options), plan.algorithm).plan(opts.explain)


def _search(graph, profile, opts: SearchOptions, progress, models: Models | None = None) -> Plan:
    return _search_found(graph, profile, opts, progress, models).plan(opts.explain)


def _search_found(graph, profile, opts: SearchOptions, progress, models: Models | None = None) -> _Found:
    """The answer of one :class:`SearchRun` (module docstring, "One search"), not yet packaged as a plan."""
    return SearchRun(graph, profile, opts, progress, models).found()


# axis-0 factor kinds of the first mesh search: the outer axis spans the slowest links
OUTER_KINDS = frozenset({"data", "param", "replicated"})
MESH_ROUNDS = 2  # rounds of one search per axis after the first
# the first search's beam at most (it only seeds the rounds; its product space makes each state dear)
MESH_SEED_STATES = 32


def _seed_options(opts: SearchOptions, restrict) -> SearchOptions:
    """The first mesh search's options: ``restrict``, no duplication (the rounds choose the mode) and a
    beam of at most :data:`MESH_SEED_STATES` states (unless the search is exact)."""
    states = opts.max_states
    if states is not None:
        states = min(MESH_SEED_STATES, states if states != "auto" else MESH_SEED_STATES)
    return replace(opts, restrict=restrict, duplication=False, max_states=states)


def _other_axes(sig: Signature, axis: int) -> tuple:
    """``sig``'s forms on every mesh axis but ``axis`` (inputs, then outputs)."""
    return tuple(f.forms[:axis] + f.forms[axis + 1 :] for f in sig.inputs + sig.outputs)


def _fits(found: "_Found | Plan", budget: float | None) -> bool:
    return budget is None or peak(found.memory) <= budget


def _better(found: "_Found | Plan", plan: "_Found | Plan | None", budget: float | None) -> bool:
    """Whether ``found`` replaces ``plan`` (answers of a search, or plans): it fits the budget where
    ``plan`` does not, or both fit (or neither does) and it is faster."""
    if plan is None:
        return True
    if _fits(found, budget) != _fits(plan, budget):
        return _fits(found, budget)
    return found.predicted["total"] < plan.predicted["total"] * (1 - 1e-9)


def _search_mesh(graph: Graph, profile, opts: SearchOptions, progress, models: Models) -> Plan:
    """The plan for a graph on a mesh of several axes, searched axis by axis (module docstring,
    "Meshes"); each step is :func:`_search` under an extra signature filter."""
    base = opts.restrict

    def within(keep):
        return lambda node, sig: (base is None or base(node, sig)) and keep(node, sig)

    def outer(node: Node, sig: Signature) -> bool:
        return node.op in ("output", "input") or not sig.axes or sig.axes[0].kind in OUTER_KINDS

    def lean(axis: int):
        """Weights stored split on ``axis`` (FSDP-style there), every other axis free."""
        styles = restrict_per_axis(tuple("fsdp" if k == axis else None for k in range(len(graph.mesh))))
        return lambda node, sig: node.op in ("output", "input") or not sig.axes or styles(node, sig)

    def seed(restrict) -> _Found | None:
        try:
            return _search_found(graph, profile, _seed_options(opts, within(restrict)), progress, models)
        except SearchError:
            return None

    def rounds(plan: _Found | None) -> _Found | None:
        """``plan`` improved axis by axis (None: no seed to improve)."""
        searched: dict[int, dict] = {}  # axis -> the other axes' forms it was last searched with
        for _ in range(MESH_ROUNDS if plan is not None else 0):
            improved = False
            for axis in range(len(graph.mesh)):
                fixed = {name: _other_axes(sig, axis) for name, sig in plan.choices.items()}
                if searched.get(axis) == fixed:
                    continue  # the same search again finds the same plan
                searched[axis] = fixed
                # id(signature) -> (signature, its forms on the other axes): the ops of identical layers
                # share their signatures
                others: dict[int, tuple] = {}

                def keep(node: Node, sig: Signature, axis=axis, fixed=fixed, others=others) -> bool:
                    hit = others.get(id(sig))
                    if hit is None or hit[0] is not sig:
                        hit = others[id(sig)] = (sig, _other_axes(sig, axis))
                    return hit[1] == fixed.get(node.name)

                try:
                    found = _search_found(graph, profile, replace(opts, restrict=within(keep)), progress, models)
                except SearchError:
                    continue
                if _better(found, plan, opts.memory_budget):
                    plan, improved = found, True
            if not improved:
                break
        return plan

    # the seed is searched under the budget (by price on a large graph: :mod:`hidup.search.dp`).  When
    # it finds no plan that fits, the rounds start instead from the better of the lean seeds, weights
    # stored split across one axis (FSDP-style) and the other axes free, each under the budget
    budget = opts.memory_budget
    start = seed(outer)
    if budget is not None and (start is None or not _fits(start, budget)):
        for axis in range(len(graph.mesh)):
            candidate = seed(lean(axis))
            if candidate is not None and _better(candidate, start, budget):
                start = candidate
    plan = rounds(start)
    if plan is None:  # no seed: the search of the whole product space (or its own message)
        return _search(graph, profile, opts, progress, models)
    if budget is not None and not _fits(plan, budget):
        raise SearchError(
            f"no plan the mesh search found fits the memory budget of {budget:.6g} bytes ({budget / 2**30:.3f} "
            f"GiB) per rank on the {mesh_text(graph.mesh)} mesh; the plan it kept needs {peak(plan.memory):.6g} "
            f"bytes ({peak(plan.memory) / 2**30:.3f} GiB) at its peak. Fix: raise the budget, or use more ranks"
        )
    return plan.plan(opts.explain)


def _layer_order(label: str) -> tuple:
    family, _, index = label.rpartition(".")
    return (family, int(index)) if index.isdigit() else (family, -1, index)


def _whole(layers: list[str]) -> Callable[[int], Recompute]:
    """``k -> `` the first ``k`` of ``layers`` recomputed whole."""
    return lambda k: Recompute(frozenset(layers[:k]))


def _least(
    opts: SearchOptions, models: Models, choices: dict[str, Signature], make: Callable[[int], Recompute], count: int
) -> int:
    """The least ``k`` in ``0 .. count`` for which the plan of ``choices`` with the layers ``make(k)``
    recomputed fits the memory budget by the budget's per-node terms (:meth:`MemoryModel.bound`, with
    :meth:`MemoryModel.budget_constant`, no resharded copies; ``make`` recomputes more, and keeps less, as
    ``k`` grows; the per-node terms leave out the parameters' kept copies, so no smaller ``k`` fits with
    them either); found by bisection, ``make(count)`` assumed to fit."""
    order = models.positions().order

    def fits(k: int) -> bool:
        memory = models.memory(
            opts.optimizer_factor, opts.precision, make(k), ZERO_STAGE.get(opts.zero, 0), _offloaded(opts)
        )
        return sum(memory.bound(n, choices[n.name]) for n in order) + memory.budget_constant() <= opts.memory_budget

    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _fewest(
    opts: SearchOptions,
    problem: Problem,
    best: Evaluation,
    models: Models,
    make: Callable[[int], Recompute],
    count: int,
) -> tuple[Problem, Evaluation] | None:
    """The plan ``best`` of ``problem`` with the layers ``make(k)`` recomputed for the least ``k`` that
    fits the memory budget: the least ``k`` by the per-node terms (:func:`_least`), then checked with the
    parameters' kept copies and the saved form changes too, taking more until it fits; None where even
    ``make(count)`` does not."""
    choices = {node.name: problem.sigs[i][k] for i, (node, k) in enumerate(zip(problem.order, best.ks))}
    most = models.memory(
        opts.optimizer_factor, opts.precision, make(count), ZERO_STAGE.get(opts.zero, 0), _offloaded(opts)
    )
    if sum(most.bound(n, choices[n.name]) for n in problem.order) + most.budget_constant() > opts.memory_budget:
        return None
    k = _least(opts, models, choices, make, count)
    while True:
        recompute = make(k)
        fewer = problem if recompute == problem.recompute else problem.derive(recompute)
        ev = best if fewer is problem else evaluate(fewer, best.ks, best.duplication)
        if peak(ev.memory) <= opts.memory_budget:
            return fewer, ev
        if k >= count:
            return None
        k += max(1, (count - k) // 2)


def _leanest(opts: SearchOptions, problem: Problem, best: Evaluation, models: Models) -> tuple[Problem, Evaluation]:
    """The fastest of the plan ``best`` (searched with the layers ``problem.recompute`` recomputed; it fits
    the memory budget) and of its choices with leaner recomputation that still fits (module docstring,
    "Recomputation"): selectively on the fewest first layers where ``best`` recomputes every layer
    selectively; whole on the fewest first layers; whole on the fewest first layers and selectively on
    the fewest next ones.  Each is priced again; ``best`` is kept unless another is faster."""
    layers = sorted(problem.recompute.layers, key=_layer_order)
    n = len(layers)
    found = [(problem, best)]
    if problem.recompute.selective and not problem.recompute.whole:
        found.append(_fewest(opts, problem, best, models, lambda k: Recompute(selective=layers[:k]), n))
    found.append(_fewest(opts, problem, best, models, _whole(layers), n))
    mixed = _fewest(opts, problem, best, models, lambda k: Recompute(layers[:k], layers[k:]), n)
    if mixed is not None:
        k = len(mixed[0].recompute.whole)
        found.append(_fewest(opts, problem, best, models, lambda j: Recompute(layers[:k], layers[k : k + j]), n - k))
    return min((f for f in found if f is not None), key=lambda f: f[1].total)


class SearchRun:
    """One search of ``graph`` under ``profile`` with ``opts`` (module docstring, "One search"): the sets
    of recomputed layers it tries in turn (:func:`_recompute_choices`), each a :class:`RecomputeTrial`,
    and what those trials share: the problems made, one per (profile, recomputed layers), every one
    after the first derived from it (:meth:`Problem.derive`); the plans with their fewest recomputed
    layers that fit, worked out once per plan (a trial may work one out ahead, while it waits); and the
    time it ``started``, from which an ILP's time limit covers every trial."""

    def __init__(self, graph: Graph, profile, opts: SearchOptions, progress, models: Models | None = None):
        self.graph, self.profile, self.opts, self.progress = graph, profile, opts, progress
        self.models = models or Models(graph)
        self.started = time.perf_counter()
        self.made: dict[int, Problem] = {}  # id(profile) -> the first problem made with it
        self.derived: dict[tuple, Problem] = {}  # (id(profile), recomputed layers) -> the problem derived from it
        # (id(problem), signature indices, duplication) -> the plan with its fewest recomputed layers
        self.fewest_of: dict[tuple, tuple[Problem, Evaluation]] = {}

    def found(self) -> _Found:
        """The answer: the fastest of the trials' plans that fit the memory budget (the fastest of all
        where none fits), each with its leanest recomputation that fits (``recompute="auto"``,
        :func:`_leanest`); the last trial's error where no trial found a plan."""
        opts = self.opts
        budget, auto = opts.memory_budget, opts.recompute == "auto"
        results = []
        errors = []
        choices = _recompute_choices(self.graph, opts)
        for n, recompute in enumerate(choices):
            if recompute and results and not results[0][0].recompute and not results[0][2]:
                break  # the fastest plan without a memory budget fits it: recomputing cannot be faster
            fitting = [r[1].total for r in results if _fits(r[1], budget)]
            beat = min(fitting, default=None) if recompute else None
            after = choices[n + 1] if n + 1 < len(choices) else None
            try:
                found = RecomputeTrial(self, recompute, beat, after).result()
            except SearchError as e:
                # kept without its traceback: the traceback holds this frame, whose `errors` holds the error,
                # a cycle that would keep every problem made here (and its caches) alive until a full
                # collection, which then walks them all (seconds on a large graph)
                errors.append(e.with_traceback(None))
                continue
            if found is not None and auto and budget is not None and found[0].recompute and _fits(found[1], budget):
                found = (*self.fewest(found[0], found[1]), *found[2:])  # the next trial must beat its leanest form
            if found is not None:
                results.append(found)
        if not results:
            try:
                raise errors.pop()
            finally:
                errors.clear()  # (the raised error's traceback holds this frame: no cycle through `errors`)
        fitting = [r for r in results if _fits(r[1], budget)]
        problem, best, _, options = min(fitting or results, key=lambda r: r[1].total)
        return _Found(problem, best, options, opts.algorithm)

    def problem_for(self, prof, recompute: frozenset) -> Problem:
        """The problem of the options under ``prof`` with the layers ``recompute`` recomputed, one per
        (profile, layers); every problem after the first shares its signatures and liveness
        (:meth:`Problem.derive`)."""
        first = self.made.get(id(prof))
        if first is None:
            opts = self.opts
            reshard = opts.reshard == "on"  # "auto" searches as "off" first (_resharding)
            first = self.made[id(prof)] = Problem(
                self.graph,
                prof,
                opts.precision,
                opts.restrict,
                opts.optimizer_factor,
                recompute,
                self.models,
                reshard,
                ZERO_STAGE[opts.zero],
                opts.reduce_dtype,
                opts.prefetch,
                _offloaded(opts),
            )
            return first
        if first.recompute == recompute:
            return first
        key = (id(prof), recompute)
        if key not in self.derived:
            self.derived[key] = first.derive(recompute)
        return self.derived[key]

    def fewest(self, problem: Problem, best: Evaluation) -> tuple[Problem, Evaluation]:
        """:func:`_leanest`, once per plan."""
        key = (id(problem), tuple(best.ks), best.duplication)
        if key not in self.fewest_of:
            self.fewest_of[key] = _leanest(self.opts, problem, best, self.models)
        return self.fewest_of[key]


class RecomputeTrial:
    """The search of a :class:`SearchRun` with the layers ``recompute`` recomputed (module docstring, "One
    search").  With ``beat`` (the time of a plan already found) the DP first searches without the budget,
    and the trial finds nothing when even that plan is no faster than ``beat`` (a plan within the budget
    could not be either), or, for the ILP, when the run's time limit is spent; a mode whose plan without
    the budget fits it is not searched again.  ``after``: the layers the next trial recomputes, when the
    budget binds; that trial starts with the DP's plans without the budget, which are searched here beside
    this trial's own DP where a process would otherwise wait (:meth:`ahead`).

    It searches ``explore`` (``problem`` without the factors inside the distributed program, which then
    settle only the mode: module docstring, "Factors inside the distributed program") and keeps its
    ``candidates``, the plans it prices in the end (:meth:`kept`): the DP's or the ILP's answers under the
    budget, the plans without it that fit it, and the answer of the DP that hides the gradient
    all-reduces (``hidden``, once run: :meth:`hide`).  ``binds``: the fastest plan without a budget does
    not fit it (worked out only where ``recompute="auto"`` needs it: :meth:`budget_binds`)."""

    def __init__(self, run: SearchRun, recompute: frozenset[str], beat: float | None, after: frozenset[str] | None):
        self.run, self.opts = run, run.opts
        self.recompute, self.beat, self.after = recompute, beat, after
        self.problem = run.problem_for(run.profile, recompute)
        self.local = not run.profile.corrections.identity
        self.explore = run.problem_for(run.models.physical(run.profile), recompute) if self.local else self.problem
        self.beam = _beam(self.opts)
        self.modes = (False, True) if self.opts.duplication else (False,)
        self.candidates: list[list[int]] = []
        self.hidden: list[int] | None = None
        self.evaluated: dict[tuple, Evaluation] = {}  # (id(problem), signature indices, mode) -> its evaluation
        self.binds = False
        self.ahead_due = False  # whether the next trial's DP without the budget is searched here (:meth:`ahead`)
        self.solver: dict | None = None  # the ILP's status

    def result(self) -> tuple[Problem, Evaluation, bool, dict] | None:
        """(problem, best evaluation, whether the budget binds, plan options), or None where this trial
        finds nothing (``beat``)."""
        opts = self.opts
        self.binds = self.budget_binds()
        self.ahead_due = self.after is not None and self.binds and opts.algorithm == "dp"
        modes_left = self.modes_left()
        if modes_left is None:
            return None
        if opts.algorithm == "ilp":
            if not self.ilp_plan():
                return None
        elif modes_left == (False,):  # the searches without the budget run beside (children keep their answers)
            self.plain_beside(modes_left)
        elif modes_left:
            self.candidates += _solve_modes_within(
                self.explore,
                modes_left,
                opts.memory_budget,
                self.candidates,
                self.run.progress,
                self.beam,
                self.meanwhile,
                self.idle,
            )
        self.hide()
        self.candidates += self.hidden_fitting()
        return self.problem, self.kept(self.candidates), self.binds, self.options()

    def hide(self) -> None:
        """Run the DP that hides the gradient all-reduces, once (the DP only).  The plain DP adds them to
        the backward that they overlap; a second DP that hides them can find the faster plan (data
        parallel): both are timed exactly in the end.  It runs while the duplicated mode's search, forked,
        still runs, and without duplication forked beside the plain search, or beside the DP that tells
        whether the budget binds (:mod:`hidup.search.modes`)."""
        if self.opts.algorithm == "dp" and self.hidden is None:
            self.hidden = dp.solve(self.explore, False, None, self.beam, hide_grad_sync=True)[0]

    def hidden_free(self) -> dict:
        """The hidden DP's answer, as ``explore`` keeps it (:func:`hidup.search.dp.solve`)."""
        self.hide()
        return self.explore.free_solutions

    def hidden_fitting(self) -> list[list[int]]:
        """The hidden DP's answer (where it has run) when it fits the memory budget."""
        budget = self.opts.memory_budget
        if self.hidden is None or (budget is not None and self.explore.plan_memory(self.hidden) > budget):
            return []
        return [self.hidden]

    def free_plan(self) -> list[int]:
        """The plain DP's plan without the budget."""
        return dp.solve(self.explore, False, None, self.beam)[0]

    def budget_binds(self) -> bool:
        """Whether the fastest plan without the memory budget misses it, worked out where
        ``recompute="auto"`` needs it (the trial without recomputed layers, under a budget); else False."""
        opts, explore, budget = self.opts, self.explore, self.opts.memory_budget
        if budget is None or self.recompute or opts.recompute != "auto":
            return False
        # every plan needs at least each node's leanest signature: past the budget, no DP is needed to tell
        if explore.min_mem_suffix[0] > budget:
            return True
        if opts.algorithm == "dp":  # the hidden DP, run below in any case, runs beside this one
            ks, answers = solve_beside(explore, self.free_plan, self.hidden_free)
            explore.free_solutions.update(answers)
            self.hide()  # the child's answer, from explore's cache: no search below runs it again
            return explore.plan_memory(ks) > budget
        return explore.plan_memory(self.free_plan()) > budget

    def modes_left(self) -> tuple[bool, ...] | None:
        """The modes to search under the budget.  With ``beat`` and a budget the DP first searches without
        it: None where even that plan is no faster than ``beat``; a mode whose plan without the budget fits
        it keeps that plan (the budgeted DP would return it), a candidate, and is not searched again."""
        budget, explore, modes = self.opts.memory_budget, self.explore, self.modes
        if self.beat is None or budget is None:
            return modes
        free = solve_modes(explore, modes, None, lambda mode: None, beam=self.beam)
        if _fastest([evaluate(explore, ks, mode) for ks in free for mode in modes]).total >= self.beat:
            return None
        fits = {mode: explore.plan_memory(ks) <= budget for mode, ks in zip(modes, free)}
        self.candidates += [ks for mode, ks in zip(modes, free) if fits[mode]]
        return tuple(mode for mode in modes if not fits[mode])

    def ilp_plan(self) -> bool:
        """The ILP's plan under the budget, seeded with the DP's, as a candidate (its status kept for the
        plan's options); False, nothing searched, where ``beat`` is set and the time limit is spent."""
        opts, run = self.opts, self.run
        limit = opts.time_limit
        if self.beat is not None and limit is not None and time.perf_counter() - run.started >= limit:
            return False
        fn = _progress_fn(run.progress, "dp seed for the ilp")
        try:  # the DP's answer seeds CBC with a good incumbent (the time limit covers the seed too)
            start, _ = dp.solve(self.explore, False, opts.memory_budget, self.beam, fn)
        except SearchError:
            start = None
        outcome = ilp.optimize(
            self.explore, opts.memory_budget, limit, start, progress=run.progress is True, started=run.started
        )
        if not outcome.proven:
            warnings.warn(f"hidup.search: {outcome.describe()}", stacklevel=5)
        self.solver = outcome.info()
        self.candidates.append(outcome.ks)
        return True

    def plain_beside(self, modes_left: tuple[bool, ...]) -> None:
        """The plain mode's DP under the budget, with the DP searches without it that this search makes
        anyway run beside it in forked children (:func:`hidup.search.modes.solve_beside`): the hidden DP
        where not yet run, and the next trial's (:meth:`ahead`); their answers are kept in the problems'
        caches, where those searches find them."""
        hiding = self.hidden is None and self.opts.algorithm == "dp"  # not yet run beside the budget's check
        explore, budget, progress = self.explore, self.opts.memory_budget, self.run.progress
        found, *answers = solve_beside(
            explore,
            lambda: _solve_modes_within(explore, modes_left, budget, self.candidates, progress, self.beam),
            *([self.hidden_free] if hiding else []),
            *([self.ahead] if self.ahead_due else []),
        )
        self.candidates += found
        if hiding:
            explore.free_solutions.update(answers.pop(0))
        for upcoming_free in answers:
            self.upcoming_problem().free_solutions.update(upcoming_free)

    def upcoming_problem(self) -> Problem:
        """The next trial's problem (``after`` recomputed), as that trial explores it."""
        run = self.run
        if self.local:
            return run.problem_for(run.models.physical(run.profile), self.after)
        return run.problem_for(run.profile, self.after)

    def ahead(self) -> dict:
        """The next trial's DP's plans without the budget (where ``ahead_due``), as its problem keeps them
        (:func:`hidup.search.dp.solve`)."""
        upcoming = self.upcoming_problem()
        try:
            for mode in self.modes:
                dp.solve(upcoming, mode, None, self.beam)
        except SearchError:
            pass  # the next trial meets the error again, and raises it there
        return upcoming.free_solutions

    def evaluation(self, p: Problem, ks: list[int], mode: bool) -> Evaluation:
        """:func:`hidup.search.schedule.evaluate`, once per plan and mode."""
        key = (id(p), tuple(ks), mode)
        if key not in self.evaluated:
            self.evaluated[key] = evaluate(p, ks, mode)
        return self.evaluated[key]

    def kept(self, plans: list[list[int]]) -> Evaluation:
        """The evaluation of the fastest of ``plans`` (in either mode), as this trial keeps it: timed on
        ``explore``, then its mode settled on ``problem`` (module docstring, "Factors inside the
        distributed program")."""
        best = _fastest([self.evaluation(self.explore, ks, mode) for ks in plans for mode in self.modes])
        if not self.local:
            return best
        return _fastest([self.evaluation(self.problem, best.ks, mode) for mode in self.modes])

    def meanwhile(self) -> None:
        """What this process searches while the duplicated mode's search, forked, still runs."""
        self.hide()
        if self.ahead_due:
            self.ahead()

    def idle(self, plain: list[int]) -> None:
        """While the duplicated mode's budgeted answer is still to come: the plan this trial keeps unless
        that answer beats the plain mode's answer ``plain``, with its fewest recomputed layers
        (:meth:`SearchRun.fewest`; kept per plan, so that nothing is worked out again once the answer is
        in)."""
        self.hide()
        opts = self.opts
        if self.recompute and opts.memory_budget is not None and opts.recompute == "auto":
            self.run.fewest(self.problem, self.kept(self.candidates + [plain] + self.hidden_fitting()))

    def options(self) -> dict:
        """The plan's record of the options it was searched with (and the ILP's status)."""
        opts = self.opts
        options = {
            "precision": opts.precision,
            "memory_budget": opts.memory_budget,
            "duplication_requested": opts.duplication,
            "optimizer_factor": opts.optimizer_factor,
            "max_states": opts.max_states,
            "max_points": opts.max_points,
            "recompute_requested": opts.recompute if isinstance(opts.recompute, str) else sorted(opts.recompute),
            "reshard_requested": opts.reshard,
            "zero_requested": opts.zero,
            "offload_requested": opts.offload,
            "reduce_dtype": opts.reduce_dtype,
            "prefetch": opts.prefetch,
        }
        if self.solver is not None:
            options["solver"] = self.solver  # the ILP's status: proven optimal, or stopped by its time limit
        return options


def _solve_modes_within(
    problem: Problem,
    modes: tuple[bool, ...],
    budget: float | None,
    found: list[list[int]],
    progress,
    beam: dp.Beam,
    meanwhile: Callable[[], None] | None = None,
    idle: Callable[[list[int]], None] | None = None,
) -> list[list[int]]:
    """The DP's answers in ``modes`` under ``budget``, beside the plans already ``found``.  Under a
    budget the duplicated mode's answer comes only when it can win (module docstring, "Duplication
    under a memory budget"): its plan without the budget fits, or the two passes of that plan are
    faster than the best plan in hand (``found`` and the plain mode's answer) that fits.
    ``meanwhile`` and ``idle``: the caller's work, as :class:`hidup.search.modes.CallerWork` holds it."""
    work = CallerWork(meanwhile, idle)

    def label(mode: bool):
        return _progress_fn(progress, f"dp, {'duplication' if mode else 'no duplication'}")

    if budget is None or tuple(modes) != (False, True):
        return solve_modes(problem, modes, budget, label, work=work, beam=beam)

    def fitting(plans: list[list[int]]) -> list[float]:
        return [
            ev.total
            for ks in plans
            for ev in (evaluate(problem, ks, False), evaluate(problem, ks, True))
            if peak(ev.memory) <= budget
        ]

    in_hand = fitting(found)

    def worth(plain: list[int], free: list[int]) -> bool:
        if problem.plan_memory(free) <= budget:
            return True  # the budgeted search returns this plan at once
        times = in_hand + fitting([plain])
        # the bound is the two passes alone: a plan within the budget may store less and so step its
        # optimizer faster than the plan without it
        return not times or evaluate(problem, free, True).objective < min(times)

    # the search by price bounds the two passes of any plan within the budget as it goes: it stops once
    # that bound reaches the fastest plan in hand that fits.  (Not the plain mode's answer, which comes
    # while it runs: its bound is on the duplicated times, and its plan may win run without duplication,
    # as Mixtral-8x7B's on 16 GPUs under 141 GB does.)
    bar = min(in_hand, default=None)
    return solve_modes(problem, modes, budget, label, worth, bar, work, beam)


def _beam(opts: SearchOptions) -> dp.Beam:
    return dp.Beam(opts.max_states, opts.max_points, opts.reuse_blocks)


def restrict_for(style: str) -> Callable[[Node, Signature], bool]:
    """The signature filter of ``style`` (one of :data:`STYLES`; :func:`forced` says what each keeps)."""
    if style not in _STYLE_RULES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    prefer, never = _STYLE_RULES[style]
    cache: dict[str, set] = {}

    def allowed_kinds(node: Node) -> set | None:
        """The first preferred kind the node offers, else every kind but the forbidden ones."""
        if node.name not in cache:
            kinds = {s.kind for s in node.signatures} - never
            pick = next(({k} for k in prefer if k in kinds), kinds or None)
            cache[node.name] = pick
        return cache[node.name]

    def restrict(node: Node, sig: Signature) -> bool:
        if node.op == "output":
            return True
        if node.op == "param":
            if style == "data":
                return all(x.kind in ("replicate", "full") for f in sig.outputs for x in axis_forms(f))
            if style == "fsdp":  # stored split wherever the parameter can be
                return all(f.is_gather for f in sig.outputs) or not any(s.outputs[0].is_gather for s in node.signatures)
            return True
        kinds = allowed_kinds(node)
        return (kinds is None or sig.kind in kinds) and _dispatcher_ok(style, sig, node.signatures)

    return restrict


def restrict_per_axis(styles: tuple[str | None, ...] | list[str | None]) -> Callable[[Node, Signature], bool]:
    """The signature filter of one style per mesh axis (outer first; each one of :data:`STYLES`, as
    :func:`forced` describes it, or None for an axis left free) for a graph traced on a device mesh:
    a signature passes when each of its one-axis factors ``sig.axes[k]`` passes axis ``k``'s style
    among the factors the node offers after the same factors on axes ``< k``."""
    styles = tuple(styles)
    for style in styles:
        if style is not None and style not in _STYLE_RULES:
            raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    cache: dict[tuple, set | None] = {}

    def allowed(node: Node, k: int, prefix: tuple) -> set | None:
        key = (node.name, k, prefix)
        if key not in cache:
            prefer, never = _STYLE_RULES[styles[k]]
            kinds = {s.axes[k].kind for s in node.signatures if s.axes[:k] == prefix} - never
            cache[key] = next(({kk} for kk in prefer if kk in kinds), kinds or None)
        return cache[key]

    def restrict(node: Node, sig: Signature) -> bool:
        if node.op == "output":
            return True
        if len(sig.axes) != len(styles):
            raise ValueError(
                f"node {node.name}: {len(styles)} styles for a signature of {len(sig.axes)} mesh axes; "
                "give one style per axis of the mesh the graph was traced for"
            )
        for k, style in enumerate(styles):
            if style is None:
                continue
            factor = sig.axes[k]
            if node.op == "param":
                if style == "data" and factor.outputs[0].is_gather:
                    return False
                if style == "fsdp" and not factor.outputs[0].is_gather:
                    if any(s.axes[k].outputs[0].is_gather for s in node.signatures if s.axes[:k] == sig.axes[:k]):
                        return False
                continue
            kinds = allowed(node, k, sig.axes[:k])
            if kinds is not None and factor.kind not in kinds:
                return False
            offered = [s.axes[k] for s in node.signatures if s.axes[:k] == sig.axes[:k]]
            if not _dispatcher_ok(style, factor, offered):
                return False
        return True

    return restrict


def forced(graph: Graph, profile, style: "str | tuple[str, ...]", **kwargs) -> Plan:
    """A plan of one fixed parallelism style, for baselines:

    * ``data``: parameters replicated, every op its ``data`` signature where it has one, else
      a non-tensor/expert one (``replicated``);
    * ``tensor``: ``tensor`` signatures for ops that have one (attention, dense linears), else as data;
    * ``expert``: ``expert`` signatures for the MoE expert einsums, else as data (the routed
      experts' token dispatcher searched); ``expert-all-gather`` and ``expert-all-to-all`` the same
      with that dispatcher forced where a node offers it (:mod:`hidup.rules.dispatch`);
    * ``fsdp``: every op as data, every parameter that can be stored split (``gather_d``) is, and
      gathered for its use (FSDP / ZeRO-3 style).

    The remaining freedom (which dim, which parameter sharding) is searched as usual.  On a device
    mesh ``style`` may be one style per axis, outer first (``("data", "tensor")``:
    :func:`restrict_per_axis`).
    """
    per_axis = not isinstance(style, str)
    plan = search(graph, profile, restrict=restrict_per_axis(style) if per_axis else restrict_for(style), **kwargs)
    plan.algorithm = f"forced-{'+'.join(style) if per_axis else style}"
    return plan


# ---------------------------------------------------------------------------------------- plan assembly
def _backward_bytes(p: Problem, tid: int, op: str, nbytes: float, src=None) -> int | None:
    """The logical bytes a conversion's backward op ``op`` moves for tensor ``tid`` of ``nbytes`` float32
    bytes, at the dtype its gradient is summed in (:meth:`hidup.search.cost.CostModel.reduce_share`);
    ``None`` for a mesh step (``src`` None) where that is ``nbytes``.  A ZeRO-2 parameter's gradient
    sync is recorded as an all-reduce (``grad_sync``): its reduce-scatter half at the gradient's dtype,
    its all-gather half of the updated float32 rows at float32 (:mod:`hidup.search.cost`)."""
    share = p.cost.reduce_share(tid, FORM_CHANGE_OPS[op].collective)
    if src is None:
        return None if share == 1.0 else int(nbytes * share)
    if share != 1.0 and op == "grad_sync" and zero_stage(p.graph, p.cost.zero, tid, src) == 2:
        share = (share + 1.0) / 2
    return int(nbytes * share)


def make_plan(problem: Problem, ev: Evaluation, algorithm: str, options: dict, explain: int = 6) -> Plan:
    """Package an evaluated assignment as a :class:`Plan` (conversions, costs, runner-ups)."""
    g, p = problem.graph, problem
    choices = {p.order[i].name: p.sigs[i][k] for i, k in enumerate(ev.ks)}
    producer = {t: n.name for n in g.nodes for t in n.outputs}
    conversions = []
    node_costs = {}
    for i, step in enumerate(ev.steps):
        node = p.order[i]
        cf, cb = p.compute[i][ev.ks[i]]
        node_costs[node.name] = [cf, cb, step.fwd - cf, step.bwd - cb]
        for tid, inp, a, f in step.convs:
            c = p.conversion(tid, a, f)
            t = g.tensors[tid]
            path = getattr(c.conv, "steps", ())
            ops = [s.conv.forward for s in path] if path else [c.conv.forward]
            wire = p.cost.wire_share(tid) if casts_on_wire(ops) else 1.0  # a weight's slices sent in bf16
            steps = tuple(
                MeshStepRecord(
                    s.axis,
                    s.conv.forward,
                    s.conv.backward,
                    s.before,
                    s.after,
                    int(p.cost.step_bytes(tid, s.before, s.axis)),
                    int(p.cost.step_bytes(tid, s.before, s.axis) * wire) if wire != 1.0 else None,
                    _backward_bytes(p, tid, s.conv.backward, p.cost.step_bytes(tid, s.before, s.axis)),
                )
                for s in path
            )
            nbytes = p.cost.nbytes[tid]
            conversions.append(
                ConversionRecord(
                    tid,
                    producer[tid],
                    node.name,
                    inp,
                    p.forms[a],
                    p.forms[f],
                    c.conv.forward,
                    c.conv.backward,
                    t.nbytes,
                    t.requires_grad,
                    steps,
                    () if path else (int(nbytes * wire), _backward_bytes(p, tid, c.conv.backward, nbytes, p.forms[a])),
                )
            )
    layers = {}
    for i, node in enumerate(p.order):
        lab = layer_of(node.module)
        if not lab and not node.inputs and i + 1 < p.n:
            lab = layer_of(p.order[i + 1].module)
        layers[node.name] = lab
    plan = Plan(
        model=g.model,
        fingerprint=g.fingerprint(),
        world_size=g.world_size,
        mesh=list(g.mesh) if len(g.mesh) > 1 else [],
        profile=problem.profile.name,
        algorithm=algorithm,
        duplication=ev.duplication,
        choices=choices,
        stages=ev.stages,
        predicted=ev.times(),
        memory=dict(ev.memory),
        conversions=conversions,
        options=options,
        node_costs=node_costs,
        layers=layers,
        reduce_dtype=p.cost.reduce_dtype,
    )
    for i, k in enumerate(ev.ks):  # collectives inside nodes: the routed experts' all-to-all dispatcher
        d = p.cost.dispatch(p.order[i], p.sigs[i][k])
        if d is not None:
            plan.dispatch[p.order[i].name] = [-1 if d[0] is None else d[0], int(d[1] * d[2])]
    plan.alternatives = _runner_ups(problem, ev, explain)
    plan.reshard = sorted(
        {producer[tid] for step in ev.steps for tid, _, a, _ in step.convs if problem.resharded(tid, a)}
    )
    plan.zero = {
        node.name: problem.zero
        for i, node in enumerate(p.order)
        if node.op == "param"
        and any(zero_stage(g, problem.zero, t, f) for t, f in zip(node.outputs, p.sigs[i][ev.ks[i]].outputs))
    }
    plan.offload = "optimizer" if problem.offload else "off"
    return plan


def _runner_ups(problem: Problem, ev: Evaluation, count: int) -> dict[str, dict]:
    """For the ``count`` heaviest call nodes: the best other signature, everything else unchanged."""
    p = problem
    heavy = sorted(
        (i for i in range(p.n) if p.order[i].op == "call"), key=lambda i: -(ev.steps[i].fwd + ev.steps[i].bwd)
    )[:count]
    out = {}
    for i in heavy:
        best = None
        for k in range(len(p.sigs[i])):
            if k == ev.ks[i]:
                continue
            ks = list(ev.ks)
            ks[i] = k
            try:
                alt = evaluate(p, ks, ev.duplication)
            except SearchError:
                continue
            if best is None or alt.total < best[1]:
                best = (k, alt.total)
        entry = {"time": ev.steps[i].fwd + ev.steps[i].bwd, "runner_up": "", "runner_up_kind": "", "delta": 0.0}
        if best is not None:
            sig = p.sigs[i][best[0]]
            entry.update(runner_up=str(sig), runner_up_kind=sig.kind, delta=best[1] - ev.total)
        out[p.order[i].name] = entry
    return out
