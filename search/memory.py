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
What lives only around one op is not a sum over nodes but a maximum: :meth:`MemoryModel.transient` of
a ``call`` node under ``s`` is the larger of

* its forward's outputs, ``sum_j local(out_j, s.outputs[j])``, plus for each ``reduce`` output the
  buffer its sum over ranks lands in (the largest form its consumers read it in, when the plan is
  known; as large as the output otherwise: an upper bound), and
* its backward's gradients: of each output that requires one, ``local(out_j, .)``, and of each input
  that requires one, ``local(in_i, .)`` widened to the op's widest output dtype (autocast runs a
  loss's log-softmax in float32, and the gradient it returns is float32), twice for an op whose output
  is smaller than its largest input (a loss holds an input-sized gradient inside its backward: the
  log-softmax's, then its input's).

:meth:`MemoryModel.plan_transient` is the largest over a plan's nodes: the logits and their gradient
for a language model, the full-size partial logits of a row-parallel LM head.  Added to the sum above
it bounds the peak that ``hidup peak`` predicts by running the program (``tests/test_memory.py``).

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
prefetched one's), recorded beside the transient (``plan.memory["prefetch"]``).  Like the transient it is
not a per-node term (the search's budget sees neither); the sum plus both bounds the peak.

Not counted: the buffers of a form change beyond a ``reduce`` output's sum (an all-gathered weight
that no backward keeps), workspace, the CUDA context and fragmentation; keep a margin below the
device size (docs/memory.md compares with measured peaks).
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

    def transient(self, node: Node, sig: Signature, summed: dict[int, float] | None = None) -> float:
        """Bytes per rank that live only around ``node``'s op under ``sig`` (module docstring,
        "Transients"): the larger of its forward's outputs and its backward's gradients.  A ``reduce``
        output's sum over ranks is a second buffer: ``summed[t]`` bytes when the plan's consumers are
        known, else as large as the output."""
        if node.op != "call":
            return 0.0
        g = self.graph
        outputs = list(zip(node.outputs, sig.outputs))
        forward = sum(self.local_bytes(t, f) for t, f in outputs)
        forward += sum((summed or {}).get(t, self.local_bytes(t, f)) for t, f in outputs if f == REDUCE)
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

    def _itemsize(self, tid: int) -> float:
        """Bytes per element of tensor ``tid`` at the model's precision."""
        return self.nbytes[tid] / max(self.graph.tensors[tid].numel, 1)

    def plan_transient(self, choices: dict[str, Signature]) -> float:
        """The largest :meth:`transient` of a whole plan (node name -> signature), each ``reduce``
        output's sum sized by the largest form its consumers read it in."""
        summed: dict[int, float] = {}
        for n in self.graph.nodes:
            sig = choices.get(n.name)
            for t, f in zip(n.inputs, sig.inputs if sig is not None else ()):
                summed[t] = max(summed.get(t, 0.0), self.local_bytes(t, f))
        return max(
            (self.transient(n, choices[n.name], summed) for n in self.graph.nodes if n.name in choices), default=0.0
        )
