"""Memory per rank of a plan: the sum of independent per-node terms (so the ILP stays linear).

Every size is taken at the dtype the tensor has when the step runs under the search's precision
(:func:`hidup.frontend.saved.tensor_dtype`: the traced dtype for fp32/tf32; under bf16/fp16 autocast, the
dtype autocast gives it -- matmul outputs in the low dtype, parameters and norms in float32), the same
bytes that :mod:`hidup.search.cost` prices communication at.  For a tensor ``t`` of ``B`` such bytes in
form ``f`` on ``N`` ranks, ``local(t, f) = B / N`` if ``f`` is ``gather_d`` else ``B`` (``full``,
``reduce`` and ``replicate`` keep the whole tensor).

* ``param`` node producing ``t`` in form ``f``: parameters ``local(t, f)``; if ``t`` requires a
  gradient also gradients ``local(t, f)`` and optimizer state ``optimizer_factor * local(t, f)``
  (Adam keeps two moments: factor 2);
  under ZeRO (``zero``, :mod:`hidup.codegen.zero`) a trainable parameter stored ``replicate`` whose
  dim 0 the ``N`` ranks divide (:func:`hidup.ir.zero_splits`) keeps optimizer state
  ``optimizer_factor * B / N`` (stage 1 and 2: each rank holds its rows' moments) and, at stage 2,
  gradients ``B / N`` (its rows of the reduce-scattered sum); its parameter stays ``B``.  What the
  stage-2 count leaves out: the whole gradient exists during the backward, from its last use until its
  bucket's reduce-scatter completes (a transient of at most the gradient buckets in flight, not a
  per-node quantity; the all-reduced gradients of stage 0 and 1 are counted whole instead);
  :meth:`MemoryModel.stepped` is what the optimizer steps, ``B / N`` for such a parameter (its time);
  with the optimizer offloaded to the host (``offload``, :mod:`hidup.codegen.offload`) the optimizer
  state is 0 on the device: the moments, a float32 copy of the stepped weights and a buffer for their
  gradients live in host memory, ``(2 + optimizer_factor) * stepped`` bytes per rank
  (:meth:`MemoryModel.host_bytes`, reported as ``plan.memory["host"]``, outside the device's total);
* ``input`` node: inputs ``local(t, f)``;
* ``call`` node under signature ``s``: activations, the bytes its backward keeps on a rank,
  ``act(n, s) = sum over the storages n owns of their local bytes under s`` (:mod:`hidup.frontend.saved`:
  measured by running the step, and each signature's local op at its local shapes, under
  ``saved_tensors_hooks`` at the precision; a storage counted once, by the first node that saves it; a
  saved parameter, buffer or model input adds nothing, autocast's low-precision copy of a weight does).
  :meth:`MemoryModel.plan_activations` gives a whole plan's activations following its form changes too
  (the converted copies a backward keeps, e.g. a gathered weight), which no per-node term can see;
  the copies of the parameters in ``reshard`` are not kept (:mod:`hidup.codegen.reshard`: the
  backward gathers them again) and are left out.
  A graph without that record (read from JSON, synthetic) counts, for a node with an input that
  requires a gradient, all its outputs ``sum_j local(out_j, s.outputs[j])`` instead;
* other nodes: 0.

Recomputation (``recompute``: the repeated layers whose forward runs again in the backward,
:mod:`hidup.codegen.recompute`).  A recomputed layer keeps only its inputs; during the backward one
layer at a time holds its activations again.  With ``L_f`` the number of recomputed layers of the
family ``f`` (``model.layers``, :func:`hidup.ir.block_family`) a ``call`` node of a recomputed layer
counts ``act(n, s) / L_f`` (the layers of a family repeat one structure, so the family adds up to one
layer's activations: the one being recomputed), and a ``call`` node whose output ``t`` a recomputed
layer other than its own reads adds ``local(t, s.outputs[j])`` (what the recomputed layer keeps of
its input).  :meth:`MemoryModel.plan_activations` counts the same for a whole plan, with the largest
recomputed layer's activations in place of the ``1/L_f`` shares.  Both are upper bounds where the
backward frees activations before it recomputes a layer (the first layers' are recomputed last).  With
duplication a recomputed layer is cut at the plan's stages (:mod:`hidup.codegen.recompute`) and each
piece keeps its own inputs, which neither counts.

Selective recomputation (``selective``: the layers recomputed selectively, disjoint from ``recompute``;
:mod:`hidup.codegen.recompute`, "Selective recomputation").  Such a layer is a recomputed layer as above
(its nodes count ``act(n, s) / L_f``, ``L_f`` counting the family's layers recomputed either way, and
it keeps its inputs), and it keeps besides what its policy saves: a ``call`` node of a selective layer
adds

    sel(n, s) = [n is a matmul or attention op] * (sum_j local(out_j, s.outputs[j]) + internal(n, s))

(:func:`saved_by_policy`; a matmul or attention op is one whose kernel kind is ``matmul`` or
``attention``, :func:`hidup.search.cost.kernel_kind`).  ``internal(n, s)`` are the storages the recorded
backward of an attention op keeps that are neither an input, a cast of one, nor its output (the
log-sum-exp of a fused attention kernel; :mod:`hidup.frontend.saved`): the kernel's other outputs,
which the policy saves with the first.  The policy saves an op's outputs at the dispatcher (a ``linear``
is one ``mm`` or ``addmm`` there, the same bytes; a decomposed attention's two ``bmm`` would keep its
score matrix, which the fused kernels do not have): an upper bound on the record's kernels.  The form
change of an activation that a node of a selective layer makes (the first consumer of that form) is
saved too (``hidup::convert_kept``): ``local(t, f)`` of the converted form, counted by the search where it
prices the conversion (:mod:`hidup.search.problem`) and by :meth:`MemoryModel.plan_activation_parts`
(``selective``).  A parameter's form change there is made again in the backward and keeps nothing.
The sum is an upper bound by one layer's saved outputs besides: while a selective layer's backward
holds its activations again, the saved outputs its recomputation reads are among them, counted in
both terms.  On a shallow stack that bound can exceed what no recomputation keeps (a two-layer
model); the search then finds selective recomputation no better and does not use it.

Transients
----------
What lives only around one op is not a sum over nodes but a maximum.  ``tr(n, s)``
(:meth:`MemoryModel.transient`) of a ``call`` node under ``s`` is the larger of

* its forward's buffers: its outputs, ``sum_j local(out_j, s.outputs[j])`` (a row-parallel LM head's
  full-size partial logits, an attention kernel's output and statistics, a decomposed attention's
  ``seq x seq`` scores, which are the output of its ``bmm`` and ``softmax`` nodes), plus for each
  ``reduce`` output the buffer its sum over ranks lands in (the largest form its consumers read it in,
  when the plan is known; as large as the output otherwise: an upper bound), plus the gathered copies
  of the parameters it reads (the all-gathered weights in flight: when the plan is known, those stored
  in another form than the node reads; otherwise every parameter input in the form the node reads it,
  an upper bound), and
* its backward's gradients: of each output that requires one, ``local(out_j, .)``, and of each input
  that requires one, ``local(in_i, .)`` widened to the op's widest output dtype (autocast runs a
  loss's log-softmax in float32, and the gradient it returns is float32), twice for an op whose output
  is smaller than its largest input (a loss holds an input-sized gradient inside its backward: the
  log-softmax's, then its input's).

For a language model the largest is the loss's backward over the logits (compute dtype, float32
upcast, its gradient) or a row-parallel LM head's partial logits with their sum.  A fused (flash)
attention keeps ``O(seq)`` statistics, counted among what it saves; its workspace outside the
allocator is not counted.

The peak
--------
The sum above is the memory at the end of the forward.  The peak bound (:meth:`MemoryModel.plan_peak`,
``plan.memory["peak"]``) follows the program order ``n_1 .. n_m`` of a plan's nodes.  With ``A_i`` the
activations of ``n_1 .. n_i`` (the per-node terms' prefix, plus from the start what only the whole-plan
count sees, such as kept gathered copies; at most the plan's activations ``A``) and ``D_i`` the
gradients of the parameters whose last reader is ``n_i`` or later (a gradient exists from its last
reader's backward on; gradients are set to None before each step)::

    peak = P + O + 2 I + s + max( D,  max over call nodes n_i of  A_i + D_i + tr(n_i, s_i) ) + prefetch

``P``, ``O``, ``I`` the parameters, optimizer state and inputs (twice: the batch a rank is handed and
its local copies), ``s`` Adam's step counts (8 bytes per trainable parameter).  While ``n_i``'s forward
runs, what earlier nodes saved lives and no gradient exists; while its backward runs, what ``n_1 .. n_i``
saved lives and the gradients of the parameters read at or after ``n_i``: ``A_i + D_i + tr(n_i)``
bounds both.  ``D``, every gradient, is the optimizer's step (no activation then).  On the CPU the bound
is within 6% of the fake-tensor run of the rank program (``hidup peak``, exact to the byte against a
real run) for a GPT whose logits dominate, data, tensor and FSDP-style plans, and never below it
(``tests/test_transient.py``).

The budget
----------
The search's memory budget constrains the peak bound, but the DP and the ILP need a sum over nodes.
With the floor ``T0 = max over call nodes n of min over n's signatures s of tr(n, s)`` (the transient
every plan holds at least once, at the node whose least is largest), each node's term is

    b(n, s) = total(n, s) + max(0, tr(n, s) - T0) + h(n, s)

(``h``: an input node's second copy, a parameter node's step counts, :meth:`MemoryModel.held`), and the
budget holds ``T0 + sum_n b(n, s_n)`` (:meth:`MemoryModel.bound`; :mod:`hidup.search.problem` adds ``T0``
at its first position, with, where resharded parameters are prefetched, an upper bound of the prefetched
copies over every plan: :meth:`MemoryModel.prefetch_ceiling`, each unit's resharded weights at the
largest form a reader may read them in).  Since ``tr(n, s_n) <= T0 + max(0, tr(n, s_n) - T0)`` for every
``n``, ``max_n tr(n, s_n) <= T0 + sum_n max(0, tr(n, s_n) - T0)``, so a plan within the budget by these
terms has sum plus largest transient within it, and its peak bound too: the DP's terms are an upper
bound of the peak bound.  Most nodes' transients are below ``T0`` (the logits' transients dwarf a
layer's) and add nothing; a signature that makes a larger one (the row-parallel LM head's partial
logits) pays its excess.  The plan found is then priced by its peak bound (``Evaluation.memory["peak"]``),
which decides whether it fits.

Those terms also count every gradient beside every activation, which the peak bound never holds at
once: at ``n_i`` the gradients of the parameters last read before ``n_i`` do not exist yet and the
activations of the nodes after it not any more, and at the optimizer's step no activation does.  So
for every plan the terms exceed the peak bound by at least

    L = min( sum_n least act(n),  min over call nodes n_i of  sum over parameters p last read before n_i
             of least grads(p) + sum over nodes after n_i of least act(n) )

(``least``: over the node's signatures; :meth:`MemoryModel.peak_slack`), and the budget's constant is
``T0 - L`` (with the prefetch ceiling; never so low that a first position's term is negative): still
never below the peak bound, and no longer above it by the gradients of a model whose peak is at the
loss.

Prefetched gathers
------------------
With prefetch (:mod:`hidup.codegen.prefetch`) the gathered copies of the parameters a unit ``u`` reads
(:func:`hidup.ir.prefetch_units`) are made at the start of unit ``u - 1``, so they live one unit longer.
A copy the backward keeps counts in the activations already (above: it lives until its backward), and
the sum above is the memory at the end of the forward, when no prefetch is in flight: prefetch adds
nothing to it.  A copy the backward does not keep (a resharded parameter's, :mod:`hidup.codegen.reshard`)
is not in the sum.  Without prefetch the rank holds one such copy at a time, around its use; with it,
when unit ``u - 1`` starts it holds unit ``u - 1``'s copies (made while unit ``u - 2`` ran, not yet used)
and unit ``u``'s (just issued), and in the backward, where such copies are made again, unit ``u``'s not
yet unpacked and unit ``u - 1``'s (made ahead), while the last copies of unit ``u + 1`` may still be
in use (``hidup peak``'s fake run of a two-layer GPT holds two layers' and 12.5 KB of the head's).  With
``G(u)`` the local bytes of the form changes ``(t, f)`` of resharded parameters first made for a call
node of unit ``u`` (not of a recomputed layer), :meth:`MemoryModel.plan_prefetched` is

    prefetch = max over units u of  G(u - 1) + G(u) + G(u + 1)

three neighbouring units' resharded gathered weights (FSDP2 holds two layers': the current one's and the
prefetched one's), recorded beside the transient (``plan.memory["prefetch"]``) and added to the peak
bound.  The budget's terms add its ceiling over every plan ("The budget"): a constant for a search with
resharding, which changes no choice between plans, only which fit.

Not counted: an activation's form-change buffers beyond a ``reduce`` output's sum, the flat buffers
of the gradient buckets, ZeRO-2's whole gradients during the backward, kernel workspace outside the
allocator, the CUDA context and fragmentation; keep a margin below the device size (docs/memory.md
compares with measured peaks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hidup.frontend.saved import (
    SavedRecord,
    as_used,
    item_bytes,
    plan_saved_bytes,
    record_of,
    saved_bytes,
    tensor_nbytes,
)
from hidup.ir import (
    REDUCE,
    Graph,
    Node,
    Signature,
    axis_forms,
    block_family,
    block_label,
    held_fraction,
    prefetch_units,
    zero_stage,
)
from hidup.search.cost import kernel_kind

__all__ = ["MemoryModel", "MEMORY_PARTS", "Recompute", "saves_output"]

# kernel kinds whose outputs selective recomputation saves (:mod:`hidup.codegen.recompute`, SAVED_OPS)
SAVED_KINDS = frozenset({"matmul", "attention"})


@dataclass(frozen=True)
class Recompute:
    """Which repeated layers (block labels) run their forward again in the backward: ``whole`` all of
    it, ``selective`` all but what selective recomputation saves (disjoint sets)."""

    whole: frozenset = frozenset()
    selective: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "whole", frozenset(self.whole))
        object.__setattr__(self, "selective", frozenset(self.selective))
        if self.whole & self.selective:
            both = ", ".join(sorted(self.whole & self.selective)[:5])
            raise ValueError(f"layers recomputed both whole and selectively: {both}")

    @staticmethod
    def of(value) -> "Recompute":
        """``value`` itself, or the layers ``value`` (a set or list of labels) recomputed whole."""
        return value if isinstance(value, Recompute) else Recompute(frozenset(value or ()))

    @property
    def layers(self) -> frozenset:
        """Every recomputed layer, either way."""
        return self.whole | self.selective

    def __bool__(self) -> bool:
        return bool(self.whole or self.selective)


def saves_output(node: Node) -> bool:
    """Whether selective recomputation keeps ``node``'s outputs (a matmul or attention op) rather than
    running it again in the backward (module docstring)."""
    return node.op == "call" and kernel_kind(node.target) in SAVED_KINDS


MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "inputs")
STEP_BYTES = 8  # Adam's step count of one parameter, as torch keeps it


@dataclass
class MemoryModel:
    graph: Graph
    optimizer_factor: float = 2.0
    precision: str = "fp32"
    recompute: frozenset = frozenset()  # block labels of the recomputed layers
    reshard: frozenset = frozenset()  # param nodes whose converted copies are made again in the backward
    selective: frozenset = frozenset()  # block labels of the layers recomputed selectively
    zero: int = 0  # the ZeRO stage of the replicated parameters (module docstring)
    offload: bool = False  # Adam's state in host memory (module docstring; hidup.codegen.offload)
    record: SavedRecord | None = field(init=False, default=None)
    # (twin's name, id(signature)) -> (signature, bytes its backward keeps and owns): what does not depend on
    # the recomputed layers, shared by the models of one graph and precision (hidup.search.problem.Models),
    # and by the nodes of one record (:meth:`twin`)
    saved_memo: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.record = record_of(self.graph, self.precision)
        self.nbytes = {tid: tensor_nbytes(self.graph, tid, self.precision) for tid in self.graph.tensors}
        self.recompute = frozenset(self.recompute)
        self.reshard = frozenset(self.reshard)
        self.selective = frozenset(self.selective)
        recomputed = self.recomputing.layers  # (checks that no layer is recomputed both ways)
        # tensors of the resharded parameters: their converted copies are not kept (hidup.codegen.reshard)
        self.remade = frozenset(
            t for n in self.graph.nodes if n.op == "param" and n.name in self.reshard for t in n.outputs
        )
        # (what a node's terms depend on besides its signature, :meth:`_alike`; id(signature)) -> (signature,
        # breakdown); and node name -> that first part
        self._breakdown: dict[tuple, tuple] = {}
        self._alike_key: dict[str, tuple] = {}
        # ("transient", twin's name, id(signature)) -> (signature, tr(n, s) without the plan), and T0 once
        # worked out: what does not depend on the recomputed layers, shared as saved_memo is
        self._transients: dict[tuple, tuple] = self.saved_memo if self.saved_memo is not None else {}
        self._consumers: dict[int, list] | None = None  # tensor -> (consumer's name, input index), once needed
        self._ceilings: dict[frozenset, float] = {}  # resharded parameters' tensors -> prefetch_ceiling
        self._param_of: dict[int, Node] = {}
        # node name -> its recomputed layer's family size L_f; tensors a recomputed layer keeps as input
        self.share: dict[str, int] = {}
        self.kept_inputs: set[int] = set()
        if recomputed:
            families: dict[str, int] = {}
            for label in recomputed:
                families[block_family(label)] = families.get(block_family(label), 0) + 1
            producer = {t: n for n in self.graph.nodes for t in n.outputs}
            for n in self.graph.nodes:
                label = self.layer_of(n)
                if not label:
                    continue
                self.share[n.name] = families[block_family(label)]
                for t in n.inputs:
                    p = producer.get(t)
                    if p is not None and p.op == "call" and self.layer_of(p) != label:
                        self.kept_inputs.add(t)

    @property
    def recomputing(self) -> Recompute:
        """The recomputed layers, whole and selectively."""
        return Recompute(self.recompute, self.selective)

    def layer_of(self, node: Node) -> str:
        """The recomputed layer (whole or selectively) ``node`` belongs to, or ``""``."""
        if node.op != "call":
            return ""
        label = block_label(node.module)
        return label if label in self.recompute or label in self.selective else ""

    def is_selective(self, node: Node) -> bool:
        """Whether ``node`` belongs to a layer recomputed selectively."""
        return node.op == "call" and bool(self.selective) and block_label(node.module) in self.selective

    def local_bytes(self, tid: int, form) -> float:
        b = self.nbytes[tid]
        return b * held_fraction(form, self.graph.mesh)

    def activations(self, node: Node, sig: Signature) -> float:
        """Bytes per rank that ``node``'s backward keeps under ``sig`` (module docstring)."""
        if node.op != "call":
            return 0.0
        kept = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs) if t in self.kept_inputs)
        policy = self.saved_by_policy(node, sig) if self.is_selective(node) else 0.0
        return self._saved(node, sig) / self.share.get(node.name, 1) + kept + policy

    def saved_by_policy(self, node: Node, sig: Signature) -> float:
        """``sel(n, s)``: the bytes per rank selective recomputation saves of ``node``'s outputs under
        ``sig`` (module docstring), 0 for an op it runs again."""
        if not saves_output(node):
            return 0.0
        out = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
        if self.record is None or kernel_kind(node.target) != "attention":
            return out
        items, local = self.record.items(node, sig)
        made = [it for it in items if it.slot != "out" and not (it.slot == "in" and it.how in ("input", "internal"))]
        return out + sum(item_bytes(self.graph, node, sig, it, local) for it in made)

    def kept_conversion(self, node: Node, tid: int, form) -> float:
        """Bytes per rank the form change of tensor ``tid`` into ``form`` that ``node`` makes keeps for
        the backward as selective recomputation saves it: ``local(t, f)`` of an activation converted by
        a node of a selective layer, else 0 (module docstring)."""
        if not self.is_selective(node) or self.graph.tensors[tid].is_param:
            return 0.0
        return self.local_bytes(tid, form)

    def twin(self, node: Node) -> Node:
        """The node whose record ``node``'s per-node terms read as their own (:meth:`SavedRecord.twin`:
        the same op of identical layers); ``node`` itself without a record."""
        return node if self.record is None else self.record.twin(self.graph, node)

    def _saved(self, node: Node, sig: Signature) -> float:
        if self.record is not None:
            memo = self.saved_memo
            if memo is None:
                return saved_bytes(self.graph, self.record, node, sig)
            twin = self.record.twin(self.graph, node)
            key = (twin.name, id(sig))
            hit = memo.get(key)
            if hit is None or hit[0] is not sig:
                hit = memo[key] = (sig, saved_bytes(self.graph, self.record, twin, sig))
            return hit[1]
        if any(self.graph.tensors[t].requires_grad for t in node.inputs):
            return sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
        return 0.0

    def plan_activations(self, choices: dict[str, Signature]) -> float:
        """Activation bytes per rank of a whole plan (node name -> signature), following form changes
        (:func:`hidup.frontend.saved.plan_saved_bytes`; the per-node sum when the graph has no record); with
        recomputation, the sum of :meth:`plan_activation_parts`."""
        return sum(self.plan_activation_parts(choices).values())

    def plan_activation_parts(self, choices: dict[str, Signature]) -> dict[str, float]:
        """A whole plan's activations as ``{"kept": what nodes outside recomputed layers keep,
        "layer_inputs": what the recomputed layers keep of their inputs, "recomputed": the largest
        recomputed layer's activations, "selective": what the selectively recomputed layers' policy
        saves}`` (module docstring)."""
        nodes = [n for n in self.graph.nodes if n.name in choices]

        def saved(accept, remade=self.remade) -> float:
            if self.record is not None:
                return plan_saved_bytes(self.graph, self.record, choices, accept, remade)
            return sum(self._saved(n, choices[n.name]) for n in nodes if accept(n))

        if not self.recompute and not self.selective:
            return {"kept": saved(lambda n: True), "layer_inputs": 0.0, "recomputed": 0.0, "selective": 0.0}
        inputs = sum(
            self.local_bytes(t, f)
            for n in nodes
            if n.op == "call"
            for t, f in zip(n.outputs, choices[n.name].outputs)
            if t in self.kept_inputs
        )
        layers = {self.layer_of(n) for n in nodes} - {""}
        # a recomputed layer's region makes its gathered copies again, resharded or not, and its backward
        # holds them while it runs
        largest = max(
            (saved(lambda n, label=label: self.layer_of(n) == label, frozenset()) for label in layers), default=0.0
        )
        return {
            "kept": saved(lambda n: not self.layer_of(n)),
            "layer_inputs": inputs,
            "recomputed": largest,
            "selective": self._plan_selective(nodes, choices),
        }

    def _plan_selective(self, nodes: list[Node], choices: dict[str, Signature]) -> float:
        """What the selectively recomputed layers of a whole plan save: :meth:`saved_by_policy` of their
        nodes, and :meth:`kept_conversion` of each activation form change (one per tensor and form) whose
        first consumer is one of them."""
        produced = {t: as_used(f) for n in nodes for t, f in zip(n.outputs, choices[n.name].outputs)}
        made: set[tuple] = set()
        total = 0.0
        for n in nodes:
            sig = choices[n.name]
            selective = self.is_selective(n)
            if selective:
                total += self.saved_by_policy(n, sig)
            for t, f in zip(n.inputs, sig.inputs):
                form = as_used(f)
                if produced.get(t, form) == form or (t, form) in made:
                    continue
                made.add((t, form))
                if selective:
                    total += self.kept_conversion(n, t, form)
        return total

    def breakdown(self, node: Node, sig: Signature) -> tuple[float, float, float, float, float]:
        """(params, grads, optimizer, activations, inputs) bytes per rank of ``node`` under ``sig``
        (kept per signature and :meth:`_alike` node: every search problem sharing this model reads the
        same, and so do the nodes alike)."""
        alike = self._alike_key.get(node.name)
        if alike is None:
            alike = self._alike_key[node.name] = self._alike(node)
        key = (alike, id(sig))
        hit = self._breakdown.get(key)
        if hit is None or hit[0] is not sig:
            hit = self._breakdown[key] = (sig, self._breakdown_of(node, sig))
        return hit[1]

    def _alike(self, node: Node) -> tuple:
        """What ``node``'s terms depend on besides its signature: for a ``call`` node none of whose outputs
        a recomputed layer keeps, its record's node (:meth:`twin`: the same op of identical layers) and its
        share of a recomputed family (the terms are then ``saved / share``, the same for each such node);
        for any other node, the node itself."""
        if node.op == "call" and not any(t in self.kept_inputs for t in node.outputs):
            return ("call", self.twin(node).name, self.share.get(node.name, 1), self.is_selective(node))
        return ("node", node.name)

    def _breakdown_of(self, node: Node, sig: Signature) -> tuple[float, float, float, float, float]:
        g = self.graph
        if node.op == "param":
            p = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
            grad = sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs) if g.tensors[t].requires_grad)
            factor = 0.0 if self.offload else self.optimizer_factor  # offloaded: the state is on the host
            if not self.zero:
                return p, grad, factor * grad, 0.0, 0.0
            n = g.world_size
            stages = [(t, f, zero_stage(g, self.zero, t, f)) for t, f in zip(node.outputs, sig.outputs)]
            kept = [(self.local_bytes(t, f), z) for t, f, z in stages if g.tensors[t].requires_grad]
            grad = sum(b / n if z == 2 else b for b, z in kept)
            return p, grad, factor * self.stepped(node, sig), 0.0, 0.0
        if node.op == "input":
            return 0.0, 0.0, 0.0, 0.0, sum(self.local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
        return 0.0, 0.0, 0.0, self.activations(node, sig), 0.0

    def stepped(self, node: Node, sig: Signature) -> float:
        """Bytes of ``node``'s trainable parameters this rank's optimizer steps under ``sig``: their local
        bytes, ``1/N`` of them for a parameter ZeRO splits (module docstring)."""
        if node.op != "param":
            return 0.0
        g, n = self.graph, self.graph.world_size
        return sum(
            self.local_bytes(t, f) / (n if zero_stage(g, self.zero, t, f) else 1)
            for t, f in zip(node.outputs, sig.outputs)
            if g.tensors[t].requires_grad
        )

    def host_bytes(self, stepped: float) -> float:
        """Host memory per rank of an offloaded optimizer stepping ``stepped`` bytes of parameters: its
        state (``optimizer_factor`` of them), the float32 copy it steps and its gradients (module docstring)."""
        return (2.0 + self.optimizer_factor) * stepped if self.offload else 0.0

    def total(self, node: Node, sig: Signature) -> float:
        return sum(self.breakdown(node, sig))

    def transient(
        self, node: Node, sig: Signature, summed: dict[int, float] | None = None, gathered: dict | None = None
    ) -> float:
        """``tr(n, s)``: bytes per rank that live only around ``node``'s op under ``sig`` (module docstring,
        "Transients"): the larger of its forward's outputs, their sums and its gathered weights, and its
        backward's gradients.  A ``reduce`` output's sum over ranks is a second buffer: ``summed[t]`` bytes
        when the plan's consumers are known, else as large as the output.  ``gathered``: the converted
        copies of parameters the plan makes for this node ((tensor, form) -> bytes), when the plan is
        known; else every parameter input in the form the node reads it (an upper bound)."""
        if node.op != "call":
            return 0.0
        g = self.graph
        outputs = list(zip(node.outputs, sig.outputs))
        forward = sum(self.local_bytes(t, f) for t, f in outputs)
        forward += sum((summed or {}).get(t, self.local_bytes(t, f)) for t, f in outputs if f == REDUCE)
        if gathered is None:
            forward += sum(self.local_bytes(t, f) for t, f in zip(node.inputs, sig.inputs) if g.tensors[t].is_param)
        else:
            forward += sum(gathered.values())
        backward = sum(self.local_bytes(t, f) for t, f in outputs if g.tensors[t].requires_grad)
        # an input's gradient comes back at the op's widest dtype (autocast's float32 ops upcast theirs)
        widest = max((self._itemsize(t) for t in node.outputs), default=0.0)
        grads = sum(
            self.local_bytes(t, f) * max(1.0, widest / (self._itemsize(t) or widest or 1.0))
            for t, f in zip(node.inputs, sig.inputs)
            if g.tensors[t].requires_grad
        )
        # an op that reduces (a loss: log-softmax then a pick) holds an input-sized gradient inside its backward
        reduces = sum(g.tensors[t].numel for t in node.outputs) < max(
            (g.tensors[t].numel for t in node.inputs), default=0
        )
        return max(forward, backward + grads * (2 if reduces else 1))

    def node_transient(self, node: Node, sig: Signature) -> float:
        """:meth:`transient` of ``node`` under ``sig`` without the plan (its upper bound), kept per signature
        and :meth:`_alike` node."""
        if node.op != "call":
            return 0.0
        key = ("transient", self.twin(node).name, id(sig))
        hit = self._transients.get(key)
        if hit is None or hit[0] is not sig:
            hit = self._transients[key] = (sig, self.transient(node, sig))
        return hit[1]

    @property
    def transient_floor(self) -> float:
        """``T0 = max over call nodes n of min over n's signatures s of tr(n, s)``: the transient every plan
        holds at least once (module docstring, "The budget")."""
        hit = self._transients.get(("transient floor",))
        if hit is None:
            hit = self._transients[("transient floor",)] = max(
                (
                    min(self.node_transient(n, s) for s in n.signatures)
                    for n in self.graph.nodes
                    if n.op == "call" and n.signatures
                ),
                default=0.0,
            )
        return hit

    def bound(self, node: Node, sig: Signature) -> float:
        """``b(n, s) = total(n, s) + max(0, tr(n, s) - T0) + h(n, s)``: ``node``'s term in the search's budget
        (module docstring, "The budget"); the budget adds ``T0`` once."""
        return (
            self.total(node, sig)
            + max(0.0, self.node_transient(node, sig) - self.transient_floor)
            + self.held(node, sig)
        )

    def held(self, node: Node, sig: Signature) -> float:
        """``h(n, s)``: what the peak holds of ``node`` besides its parts (module docstring, "The peak"): an
        input's second copy, a trainable parameter's step counts."""
        if node.op == "input":
            return self.breakdown(node, sig)[4]
        if node.op == "param":
            return STEP_BYTES * sum(1 for t in node.outputs if self.graph.tensors[t].requires_grad)
        return 0.0

    def plan_prefetched(self, choices: dict[str, Signature], reshard: frozenset = frozenset()) -> float:
        """The bytes a prefetching program holds besides the sum (module docstring, "Prefetched gathers"):
        the largest three neighbouring units' gathered copies of the parameters in ``reshard`` (``param``
        node names)."""
        g = self.graph
        stored = {
            t: f
            for n in g.nodes
            if n.op == "param" and n.name in reshard and n.name in choices
            for t, f in zip(n.outputs, choices[n.name].outputs)
        }
        calls = [n for n in g.nodes if n.op == "call" and n.name in choices]
        units = prefetch_units([block_label(n.module) for n in calls])
        made: set[tuple] = set()
        held: dict[int, float] = {}
        for n, u in zip(calls, units):
            for t, f in zip(n.inputs, choices[n.name].inputs):
                form = as_used(f)
                src = stored.get(t)
                if src is None or not any(a.is_gather for a in axis_forms(src)) or as_used(src) == form:
                    continue
                if (t, form) in made:
                    continue
                made.add((t, form))
                if not self.layer_of(n):
                    held[u] = held.get(u, 0.0) + self.local_bytes(t, form)
        return max((held.get(u - 1, 0.0) + g + held.get(u + 1, 0.0) for u, g in held.items()), default=0.0)

    def budget_constant(self, resharded: frozenset = frozenset(), prefetch: bool = True) -> float:
        """What the budget's terms add once (module docstring, "The budget"): ``T0``, the prefetched copies'
        ceiling of the resharded parameters' tensors ``resharded``, less the slack ``L``."""
        ceiling = self.prefetch_ceiling(resharded) if prefetch else 0.0
        return self.transient_floor + ceiling - self.peak_slack()

    def peak_slack(self) -> float:
        """``L``: a bound below which ``T0 + sum_n b(n, s_n)`` never comes closer to the peak bound, over every
        plan (module docstring, "The budget"): the least over positions ``i`` of the least gradients of the
        parameters last read before ``i`` plus the least activations of the nodes after ``i``."""
        hit = self._transients.get(("peak slack", self.recomputing, self.zero))
        if hit is not None:
            return hit
        nodes = self.graph.nodes
        index = {n.name: i for i, n in enumerate(nodes)}
        least = [
            [min((self.breakdown(n, s)[j] for s in n.signatures), default=0.0) for j in (1, 3)] for n in nodes
        ]  # the least gradients and activations of each node
        freed = [0.0] * (len(nodes) + 1)  # gradients of parameters last read before position i, at i
        for n, (grads, _) in zip(nodes, least):
            if n.op == "param" and grads:
                readers = [index[c] for t in n.outputs for c, _ in self._readers(t) if c in index]
                freed[max(readers, default=len(nodes)) + 1 if readers else len(nodes)] += grads
        before, after = 0.0, sum(act for _, act in least)
        slack = after  # the optimizer's step: every activation is gone
        for i, (n, (_, act)) in enumerate(zip(nodes, least)):
            before += freed[i]
            after -= act
            if n.op == "call":
                slack = min(slack, before + after)
        self._transients[("peak slack", self.recomputing, self.zero)] = slack
        return slack

    def prefetch_ceiling(self, params: frozenset) -> float:
        """An upper bound of :meth:`plan_prefetched` over every plan whose resharded parameters are among the
        tensors ``params`` (module docstring, "The budget"): each unit's readers of them counted at the largest
        form any of the reader's signatures reads them in, three neighbouring units at most."""
        if not params:
            return 0.0
        hit = self._ceilings.get(params)
        if hit is None:
            calls = [n for n in self.graph.nodes if n.op == "call"]
            held: dict[int, float] = {}
            made: set[tuple] = set()
            for n, u in zip(calls, prefetch_units([block_label(n.module) for n in calls])):
                for j, t in enumerate(n.inputs):
                    if t not in params or (t, u) in made or self.layer_of(n):
                        continue
                    made.add((t, u))
                    held[u] = held.get(u, 0.0) + max(self.local_bytes(t, s.inputs[j]) for s in n.signatures)
            hit = self._ceilings[params] = max(
                (held.get(u - 1, 0.0) + g + held.get(u + 1, 0.0) for u, g in held.items()), default=0.0
            )
        return hit

    def _itemsize(self, tid: int) -> float:
        """Bytes per element of tensor ``tid`` at the model's precision."""
        return self.nbytes[tid] / max(self.graph.tensors[tid].numel, 1)

    def plan_transient_of(self, node: Node, choices: dict[str, Signature]) -> float:
        """:meth:`transient` of ``node`` in a whole plan (node name -> signature): each ``reduce`` output's
        sum sized by the largest form its consumers read it in, and the parameters' gathered copies those
        the plan makes for the node (stored in another form than it reads)."""
        if node.op != "call" or node.name not in choices:
            return 0.0
        self._index_readers()
        sig = choices[node.name]
        summed = {
            t: max((self.local_bytes(t, choices[c].inputs[j]) for c, j in self._consumers.get(t, ()) if c in choices),
                   default=0.0)
            for t, f in zip(node.outputs, sig.outputs)
            if f == REDUCE
        }  # fmt: skip
        gathered = {}
        for t, f in zip(node.inputs, sig.inputs):
            param = self._param_of.get(t)
            if param is None or param.name not in choices:
                continue
            stored = choices[param.name].outputs[param.outputs.index(t)]
            if as_used(stored) != as_used(f):
                gathered[(t, as_used(f))] = self.local_bytes(t, f)
        return self.transient(node, sig, summed, gathered)

    def plan_transient(self, choices: dict[str, Signature]) -> float:
        """The largest :meth:`plan_transient_of` of a whole plan: the nodes taken by their bound
        (:meth:`node_transient`, never below), largest first, until no bound left can beat the largest found."""
        nodes = sorted(
            (n for n in self.graph.nodes if n.op == "call" and n.name in choices),
            key=lambda n: -self.node_transient(n, choices[n.name]),
        )
        best = 0.0
        for n in nodes:
            if self.node_transient(n, choices[n.name]) <= best:
                break
            best = max(best, self.plan_transient_of(n, choices))
        return best

    def plan_peak(self, choices: dict[str, Signature], parts: dict[str, float], prefetch: float = 0.0) -> dict:
        """The plan's peak bound (module docstring, "The peak") from its memory ``parts`` (``MEMORY_PARTS``:
        the activations the plan's whole count, which the per-node prefix reaches at the last node; the
        gradients the per-node terms' sum) and ``prefetch``.  Returns ``{"peak", "transient" (the largest),
        "peak_transient" (the transient at the peak)}``."""
        activations, grads_total = parts["activations"], parts["grads"]
        nodes = [n for n in self.graph.nodes if n.name in choices]
        terms = [self.breakdown(n, choices[n.name]) for n in nodes]
        index = {n.name: i for i, n in enumerate(nodes)}
        # a parameter's gradient exists from the backward of its last reader on: at and before that position
        grads_from = [0.0] * (len(nodes) + 1)
        for n, term in zip(nodes, terms):
            if n.op == "param" and term[1]:
                readers = [index[c] for t in n.outputs for c, _ in self._readers(t) if c in index]
                grads_from[max(readers, default=len(nodes))] += term[1]
        for i in range(len(nodes) - 1, -1, -1):
            grads_from[i] += grads_from[i + 1]
        live = max(0.0, activations - sum(t[3] for t in terms))  # copies the per-node terms cannot see
        bounded = []
        for i, (n, term) in enumerate(zip(nodes, terms)):
            live += term[3]
            if n.op == "call":
                here = min(live, activations) + grads_from[i]
                bounded.append((here + self.node_transient(n, choices[n.name]), here, n))
        bounded.sort(key=lambda b: -b[0])
        best, at = max(grads_total, activations + grads_from[len(nodes) - 1] if nodes else 0.0), 0.0
        for bound, here, n in bounded:  # largest bound first, until none left can beat the best found
            if bound <= best:
                break
            tr = self.plan_transient_of(n, choices)
            if here + tr > best:
                best, at = here + tr, tr
        # besides the parts: the optimizer's step count per trainable parameter, and the rank's inputs a
        # second time (the batch it is handed and the local copies its program makes)
        held = parts["params"] + parts["optimizer"] + parts["inputs"]
        held += sum(self.held(n, choices[n.name]) for n in nodes if n.op in ("param", "input"))
        return {"peak": held + best + prefetch, "transient": self.plan_transient(choices), "peak_transient": at}

    def _readers(self, tid: int) -> list:
        """(name, input index) of each node reading tensor ``tid``."""
        self._index_readers()
        return self._consumers.get(tid, [])

    def _index_readers(self) -> None:
        if self._consumers is None:
            self._consumers = {}
            for n in self.graph.nodes:
                for j, t in enumerate(n.inputs):
                    self._consumers.setdefault(t, []).append((n.name, j))
            self._param_of = {t: n for n in self.graph.nodes if n.op == "param" for t in n.outputs}
