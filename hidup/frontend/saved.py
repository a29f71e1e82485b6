"""What autograd saves for the backward pass, per traced node, and every tensor's dtype, under a precision.

Measured, not tabulated: the exported step (:attr:`hidup.frontend.trace.Traced.gm`) is run once more by a
``torch.fx`` interpreter on fake CPU tensors (no memory), with ``torch.autograd.graph.saved_tensors_hooks``
recording which tensors each node's autograd functions pack for the backward, and -- for ``bf16`` /
``fp16`` -- under ``torch.autocast(dtype=..., cache_enabled=False)`` as the runtime runs it
(:mod:`hidup.codegen.graphs`).  So the dtype of every value (matmul-like ops in the low dtype,
reductions, norms and losses where autocast keeps them in float32, elementwise ops following their
inputs) and every tensor a backward keeps (autocast's low-precision copies of an op's inputs and weights
included) come from torch itself.  Autocast runs on the CPU here (no CUDA is needed to search): its
CPU policy matches CUDA's for the matmul-like ops that hold most of the saved bytes; where the two
differ (CUDA also runs softmax in float32), the dtypes are the CPU policy's.  ``fp32`` and ``tf32``
store the traced dtypes.

A trace whose repeated blocks were stamped (:mod:`hidup.frontend.stamp`) runs only blocks ``0 .. 4`` and ``L-1``
of the stack this way: the record of blocks ``5 .. L-2`` is block 4's with its storages renamed
(:mod:`hidup.frontend.saved_blocks`, checked, the same record to the item), so the run costs what a few blocks
do whatever the depth.

Per signature, at local shapes
------------------------------
Then every signature's *local* op (:func:`hidup.rules.localize`, what rank 0 runs) is run the same way
on fake tensors of its local shapes and input dtypes, one run per distinct (op, signature, local
shapes, arguments): the layers of a model repeat, so a Llama-3-8B-shaped step needs a few hundred runs.
What it saves is known per storage: an alias of its input ``j``, of its output ``k``, or a storage it
made (a cast, a norm's statistics, a vocabulary-parallel embedding's mask), each of its local bytes.

Nodes of one record
-------------------
A node's per-node terms (:func:`saved_bytes`, and which parameter inputs its backward keeps as they
are) read of its record only its items per signature, the shapes of its inputs and outputs and
which inputs are parameters or buffers, not which storages the items are.  The ops of identical
layers record alike, so :meth:`SavedRecord.twin` names for every node the first node that reads as
it does, and the search works those terms out once per such class (:mod:`hidup.search.memory`).
A key of a locally measured signature is the signature object itself (the ops of identical layers
share theirs), so nodes whose signatures are equal but distinct objects are not twins.

Counting (a storage once, so that views are not new memory)
-----------------------------------------------------------
A saved tensor is identified by its storage; a view shares its base's.  A storage of a parameter, a
buffer or a model input is not an activation (the memory model's parameter and input terms hold it);
autocast's low-precision copy of a weight is a new storage, hence an activation.  The first node (in
execution order) that saves a storage under any of its signatures *owns* it; later savers add nothing
(three projections that save one float32 input keep one copy; under autocast each casts its input
itself, three storages).  The per-node term (:func:`saved_bytes`, additive: the ILP stays linear) is::

    act(n, s) = sum over the storages n owns of their local bytes under s's local op

and where a local op cannot run on fake tensors (it needs a process group), the whole op's storage of
``B`` global bytes tied to its input or output ``t``: ``B * numel(local_shape(t, form)) / numel(t)``
(a storage the op made is tied to the input or output it was computed from element for element, else
split with its first non-parameter input where their dims line up).

A whole plan (:func:`plan_saved_bytes`) also follows form changes: a saved input that its consumer
reads in another form than its producer made it is the converted copy the rank program makes, one per
(tensor, form), of ``numel(local) * itemsize`` bytes -- the all-gathered weight a float32 backward keeps
when the weight is stored split, for one.  A node cannot see that (it is an edge of the plan), so the
per-node sum leaves it out, and counts a storage that two savers read in different forms once, in
the first one's form.  A local op's inputs are fresh tensors here, so where the rank program hands it
a view that the single-device step copies (grouped-query attention's ``repeat_kv`` when a rank holds
one key/value head), the saved input is counted at the copy's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hidup import rules
from hidup.frontend.saved_blocks import BlockStamper
from hidup.fxvalues import dtype_name, map_value, value_leaves
from hidup.ir import DTYPE_BYTES, FULL, Graph, Layout, Node, Signature, axis_forms
from hidup.rules.base import TensorMeta
from hidup.rules.mesh import localize_mesh

__all__ = [
    "SavedItem",
    "SavedRecord",
    "Recorder",
    "record_of",
    "tensor_dtype",
    "tensor_nbytes",
    "saved_bytes",
    "plan_saved_bytes",
    "as_used",
    "AUTOCAST_DTYPES",
]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class SavedItem:
    """One storage a node's backward keeps: its global bytes and the slot whose form sizes it."""

    slot: str  # "in" or "out": which list of the node's tensors ``index`` points into; "" = unsplit
    index: int
    nbytes: int  # global bytes at the dtype stored
    dtype: str
    how: str  # "input"/"output" (an alias of that tensor), "internal" (computed from it element for element)
    # or "aligned" (created inside the node; split only where its dims line up with the input's split dim)
    shape: tuple = ()
    storage: int = -1  # which storage of the step (dense ids): savers of one storage share it
    owner: bool = True  # the first node to save this storage (the per-node memory term counts it)
    held: bool = False  # the storage of a parameter, buffer or model input (no activation as such)


@dataclass
class SavedRecord:
    """Per node name every storage its backward keeps; per tensor id its dtype under ``precision``."""

    precision: str
    dtypes: dict[int, str]
    saved: dict[str, list[SavedItem]] = field(default_factory=dict)  # the whole op, global bytes
    # what each signature's local op keeps, measured at its local shapes: bytes per rank (slot "" items
    # are the op's own storages); a node or signature missing here falls back to ``saved``
    local: dict[str, dict[Signature, list[SavedItem]]] = field(default_factory=dict)

    # node name -> its twin (:meth:`twin`), worked out when first asked
    _twins: dict[str, Node] | None = field(default=None, repr=False, compare=False)

    def items(self, node: Node, sig: Signature) -> tuple[list[SavedItem], bool]:
        """(items, measured locally) of ``node`` under ``sig``."""
        per_sig = self.local.get(node.name)
        if per_sig is not None and sig in per_sig:
            return per_sig[sig], True
        return self.saved.get(node.name, []), False

    def twin(self, graph: Graph, node: Node) -> Node:
        """The first node of ``graph`` (``node`` itself or an earlier one) whose record reads as ``node``'s
        does (module docstring, "Nodes of one record")."""
        if self._twins is None:
            held = {t for n in graph.nodes if n.op == "param" for t in n.outputs}
            first: dict[tuple, Node] = {}
            self._twins = {n.name: first.setdefault(self._twin_key(graph, n, held), n) for n in graph.nodes}
        return self._twins[node.name]

    def _twin_key(self, graph: Graph, node: Node, held: set[int]) -> tuple:
        """What the per-node sums read of ``node``'s record: its items (all but which storage each is) per
        signature measured locally, keyed by the signature object, and those of the whole op, on input
        and output tensors of these shapes, inputs made by ``param`` nodes (``held``) where these are."""

        def items(found: list[SavedItem]) -> tuple:
            return tuple((i.slot, i.index, i.nbytes, i.dtype, i.how, i.shape, i.owner, i.held) for i in found)

        local = self.local.get(node.name)
        return (
            node.op,
            tuple((graph.tensors[t].shape, t in held) for t in node.inputs),
            tuple(graph.tensors[t].shape for t in node.outputs),
            items(self.saved.get(node.name, [])),
            None if local is None else tuple((id(sig), items(found)) for sig, found in local.items()),
        )


def _fraction(graph: Graph, tid: int, form) -> float:
    shape = graph.tensors[tid].shape
    n = math.prod(shape)
    if n == 0:
        return 0.0
    return math.prod(form.local_shape(shape, graph.mesh)) / n


def _aligned(graph: Graph, tid: int, form, shape: tuple) -> float:
    """The product of 1/n over the axes (of n ranks) whose form splits a dim of ``tid`` that the saved
    ``shape`` has at the same place and size."""
    whole = graph.tensors[tid].shape
    forms = axis_forms(form)
    out = 1.0
    for f, n in zip(forms, graph.mesh):
        if f.is_gather and f.dim < len(shape) and shape[f.dim] == whole[f.dim]:
            out /= n
    return out


def saved_bytes(graph: Graph, record: SavedRecord, node: Node, sig: Signature) -> float:
    """Bytes per rank that ``node`` under ``sig`` keeps for the backward and owns (module docstring)."""
    items, local = record.items(node, sig)
    return sum(item_bytes(graph, node, sig, it, local) for it in items if it.owner and not it.held)


def item_bytes(graph: Graph, node: Node, sig: Signature, it: SavedItem, local: bool = False) -> float:
    """Bytes per rank of one saved storage of ``node`` under ``sig`` (module docstring); ``local``: the
    item was measured on the local op, its bytes are a rank's already."""
    if local:
        return float(it.nbytes)
    if it.how == "aligned":
        return it.nbytes * _aligned(graph, node.inputs[it.index], sig.inputs[it.index], it.shape)
    if it.slot == "in":
        return it.nbytes * _fraction(graph, node.inputs[it.index], sig.inputs[it.index])
    if it.slot == "out":
        return it.nbytes * _fraction(graph, node.outputs[it.index], sig.outputs[it.index])
    return float(it.nbytes)


def as_used(form):
    """The form a consumer reads a tensor in: a ``replicate`` parameter is read as ``full``."""
    if isinstance(form, Layout):
        return Layout(tuple(as_used(f) for f in form.forms))
    return FULL if form.kind == "replicate" else form


def plan_saved_bytes(
    graph: Graph,
    record: SavedRecord,
    choices: dict[str, Signature],
    savers: Callable[[Node], bool] | None = None,
    remade: frozenset[int] | set[int] = frozenset(),
) -> float:
    """Bytes per rank the backward keeps under a whole plan (``choices``: node name -> signature),
    following form changes: a saved input that its consumer reads in another form than its producer
    made it is the converted copy, one per (tensor, form) as the rank program makes them, of
    ``numel(local) * itemsize`` bytes -- a stored-sharded weight all-gathered for a float32 backward
    included; every other saved storage once, as in :func:`saved_bytes`.  ``savers`` (node -> bool)
    counts only what the nodes it accepts save.  The converted copies of the tensors in ``remade`` (those
    of resharded parameters, :mod:`hidup.codegen.reshard`) are not kept: the backward makes them again."""
    produced: dict[int, object] = {}
    for n in graph.nodes:
        sig = choices.get(n.name)
        if sig is not None:
            for t, f in zip(n.outputs, sig.outputs):
                produced[t] = as_used(f)
    counted: dict[tuple, float] = {}
    for n in graph.nodes:
        sig = choices.get(n.name)
        if sig is None or n.op != "call" or (savers is not None and not savers(n)):
            continue
        items, local = record.items(n, sig)
        for it in items:
            if it.slot == "in" and it.how == "input":
                tid, form = n.inputs[it.index], as_used(sig.inputs[it.index])
                if produced.get(tid, form) != form:
                    if tid in remade:
                        continue
                    numel = math.prod(form.local_shape(graph.tensors[tid].shape, graph.mesh))
                    counted.setdefault(("copy", tid, form), numel * DTYPE_BYTES.get(it.dtype, 4))
                    continue
            if not it.held:
                counted.setdefault(("storage", it.storage), item_bytes(graph, n, sig, it, local))
    return sum(counted.values())


def _precision_key(precision: str) -> str:
    return precision if precision in AUTOCAST_DTYPES else "fp32"


def record_of(graph: Graph, precision: str = "fp32") -> SavedRecord | None:
    """The graph's record under ``precision`` (measured once, then cached on the recorder); None for a
    graph built without one (read from JSON, synthetic)."""
    recorder = getattr(graph, "autograd_saved", None)
    return recorder.record(precision) if recorder is not None else None


def tensor_dtype(graph: Graph, tid: int, precision: str = "fp32") -> str:
    """The dtype tensor ``tid`` has when the step runs under ``precision`` (autocast for bf16/fp16): the one
    source of the bytes that memory and communication are priced at."""
    record = record_of(graph, precision)
    if record is not None and tid in record.dtypes:
        return record.dtypes[tid]
    return graph.tensors[tid].dtype


def tensor_nbytes(graph: Graph, tid: int, precision: str = "fp32") -> int:
    """Global bytes of tensor ``tid`` at :func:`tensor_dtype`."""
    return graph.tensors[tid].numel * DTYPE_BYTES.get(tensor_dtype(graph, tid, precision), 4)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Recorder:
    """Re-runs an exported step to record :class:`SavedRecord` per precision (module docstring).

    ``tensor_ids`` maps each fx node name to the graph tensor ids of its tensor leaves, in order
    (:attr:`hidup.frontend.trace.Traced.tensor_ids`); ``values`` are the forward's argument values; ``blocks``
    names the copies of a stamped stack's block 2 (:attr:`hidup.frontend.stamp.Stamped.blocks`), whose record
    is stamped (:mod:`hidup.frontend.saved_blocks`)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        values: list,
        tensor_ids: dict[str, list[int]],
        graph: Graph,
        contexts: dict | None = None,
        blocks: list[dict[str, str]] | None = None,
    ):
        self.gm, self.tensor_ids, self.graph, self.contexts = gm, tensor_ids, graph, contexts or {}
        self.blocks = blocks or []  # a stamped stack's copies of block 2 (hidup.frontend.stamp.Stamped.blocks)
        # only shapes, dtypes and requires_grad of the inputs are kept (no data)
        self.specs = [map_value(v, lambda x: _Spec.of(x) if isinstance(x, torch.Tensor) else x) for v in values]
        self.graph_nodes = {n.name: n for n in graph.nodes}
        self.numel = {t: tensor.numel for t, tensor in graph.tensors.items()}
        self.param_tids = {t for t, tensor in graph.tensors.items() if tensor.is_param}
        self.input_tids = {n.outputs[0] for n in graph.nodes if n.op == "input"}
        self.buffer_tids = {n.outputs[0] for n in graph.nodes if n.op == "param"}
        self._records: dict[str, SavedRecord] = {}

    def record(self, precision: str) -> SavedRecord:
        key = _precision_key(precision)
        if key not in self._records:
            self._records[key] = self._run(key)
        return self._records[key]

    def _run(self, key: str) -> SavedRecord:
        record = SavedRecord(key, {})
        autocast = AUTOCAST_DTYPES.get(key)
        with FakeTensorMode(allow_non_fake_inputs=False), torch.enable_grad():
            interp = _SavingInterpreter(self, record)
            with (
                _Provenance(interp.derived),
                torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t),
                torch.autocast(
                    "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None, cache_enabled=False
                ),
            ):
                interp.run(enable_io_processing=False)
                _LocalOps(self, record, interp).measure()
        return record


@dataclass(frozen=True)
class _Spec:
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "_Spec":
        return _Spec(tuple(t.shape), t.dtype, bool(t.requires_grad))

    def make(self) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        return t.requires_grad_(True) if self.requires_grad else t


class _Provenance(TorchDispatchMode):
    """Below autograd and autocast: for every ATen op, each new output storage -> the storage of the first
    tensor argument of the same shape (a cast, a copy, a log-softmax of its input)."""

    def __init__(self, derived: dict[int, int]):
        super().__init__()
        self.derived = derived
        self.kept: list[torch.Tensor] = []  # every output stays alive, so no storage key is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sources = [t for t in value_leaves((args, kwargs or {}), torch.Tensor)]
        for o in value_leaves(out, torch.Tensor):
            self.kept.append(o)
            key = _storage_key(o)
            if key in self.derived or any(_storage_key(t) == key for t in sources):
                continue
            same = next((t for t in sources if t.shape == o.shape), None)
            if same is not None:
                self.derived[key] = _storage_key(same)
        return out


def _cpu(v: Any) -> Any:
    """Device arguments of the graph (folded to meta by the exporter) name the CPU here."""
    if isinstance(v, torch.device) and v.type == "meta":
        return torch.device("cpu")
    return v


class _SavingInterpreter(torch.fx.Interpreter):
    def __init__(self, recorder: Recorder, record: SavedRecord):
        super().__init__(recorder.gm, garbage_collect_values=False)  # storages stay alive: keys stay unique
        self.rec, self.record = recorder, record
        self.inputs = iter(recorder.specs)
        self.packed: list[torch.Tensor] = []
        self.tid_key: dict[int, int] = {}  # graph tensor id -> its storage key
        self.held: set[int] = set()  # storages of parameters, buffers and model inputs
        self.saved_keys: set[int] = set()  # storages some node saved already
        self.storage_ids: dict[int, int] = {}  # storage key -> dense id
        self.attrs: dict[str, torch.Tensor] = {}
        self.derived: dict[int, int] = {}  # storage key -> storage it was computed from, element for element
        # a storage of the stamped blocks' stand-in values -> the storage it stands for (hidup.frontend.saved_blocks)
        self.alias: dict[int, Any] = {}
        self.stamper = BlockStamper(self, recorder.blocks) if recorder.blocks else None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append(t)
        return t

    def placeholder(self, target, args, kwargs):
        spec = next(self.inputs)
        return map_value(spec, lambda s: s.make() if isinstance(s, _Spec) else s)

    def get_attr(self, target, args, kwargs):
        value = self.fetch_attr(target)
        if not isinstance(value, torch.Tensor):
            return value
        if target not in self.attrs:
            self.attrs[target] = _Spec.of(value).make()
        return self.attrs[target]

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return None  # states the traced dtype, which autocast changes
        args = map_value(tuple(args), _cpu)
        kwargs = map_value(dict(kwargs), _cpu)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "output":
            return None
        if self.stamper is not None and self.stamper.stamps(n.name):
            return self.stamper.stamp(n)
        self.packed = []
        value = super().run_node(n)
        leaves = value_leaves(value, torch.Tensor)
        keys = [self.key(leaf) for leaf in leaves]
        self.outputs(self.rec.tensor_ids.get(n.name, []), keys, [dtype_name(leaf.dtype) for leaf in leaves])
        node = self.rec.graph_nodes.get(n.name)
        facts = []
        if self.packed and node is not None and node.op == "call":
            facts = self._facts(node, self.packed)
            self.own(node, facts)
        self.packed = []
        if self.stamper is not None:
            self.stamper.ran(n, leaves, keys, facts)
        return value

    def key(self, t: torch.Tensor):
        """The storage ``t`` stands for: its own, or that of the stamped block its value stands in for."""
        key = _storage_key(t)
        return self.alias.get(key, key)

    def outputs(self, tids: list[int], keys: list, dtypes: list[str]) -> None:
        """Record a node's tensors ``tids``: their storages ``keys`` and dtypes (the first node to make one
        names it); a parameter's, buffer's or model input's storage is held, not an activation."""
        for key, dtype, tid in zip(keys, dtypes, tids):
            self.tid_key.setdefault(tid, key)
            self.record.dtypes.setdefault(tid, dtype)
            if tid in self.rec.buffer_tids or tid in self.rec.input_tids:
                self.held.add(key)

    def _facts(self, node: Node, packed: list[torch.Tensor]) -> list[tuple]:
        """``(storage, slot, index, nbytes, dtype, how, shape)`` per storage ``node``'s backward keeps, in the
        order they were packed (a storage once): what :class:`SavedItem` says but for its storage id, owner
        and held."""
        in_keys = [self.tid_key.get(t) for t in node.inputs]
        out_keys = [self.tid_key.get(t) for t in node.outputs]
        facts, here = [], set()
        for t in packed:
            key = self.key(t)
            if key in here:
                continue
            here.add(key)
            nbytes, dtype = int(t.untyped_storage().nbytes()), dtype_name(t.dtype)
            if key in in_keys:
                facts.append((key, "in", in_keys.index(key), nbytes, dtype, "input", ()))
            elif key in out_keys:
                facts.append((key, "out", out_keys.index(key), nbytes, dtype, "output", ()))
            else:
                slot, index, how, shape = self._internal(node, _storage_key(t), in_keys, out_keys, tuple(t.shape))
                facts.append((key, slot, index, nbytes, dtype, how, shape))
        return facts

    def own(self, node: Node, facts: list[tuple]) -> None:
        """``node``'s saved items from its :meth:`_facts`: each storage numbered in the order the step first
        saves it, owned by the first node that saves it."""
        items = self.record.saved.setdefault(node.name, [])
        for key, slot, index, nbytes, dtype, how, shape in facts:
            storage = self.storage_ids.setdefault(key, len(self.storage_ids))
            owner, held = key not in self.saved_keys, key in self.held
            items.append(SavedItem(slot, index, nbytes, dtype, how, shape, storage, owner, held))
            self.saved_keys.add(key)

    def _internal(self, node: Node, made: int, in_keys: list, out_keys: list, shape: tuple) -> tuple:
        """(slot, index, how, shape) of a storage the node created (``made``): sized by the input or output
        it was computed from element for element (followed through casts and copies), else split as the
        node's first input that is not a parameter is where their dims line up (a norm's statistics
        follow the rows it normalizes)."""
        seen, key = set(), made
        while key in self.derived and key not in seen:
            seen.add(key)
            key = self.derived[key]
            stands_for = self.alias.get(key, key)
            if stands_for in in_keys:
                return "in", in_keys.index(stands_for), "internal", ()
            if stands_for in out_keys:
                return "out", out_keys.index(stands_for), "internal", ()
        for j, tid in enumerate(node.inputs):
            if tid not in self.rec.param_tids:
                return "in", j, "aligned", shape
        return "", -1, "internal", ()


class _LocalOps:
    """Each signature's local op (:func:`hidup.rules.localize`, rank 0) run on fake tensors of its local
    shapes and dtypes, recording what its backward keeps; one run per distinct op, shapes and arguments
    (the layers of a model repeat).  Ownership across nodes follows the whole step's storages: the first
    node, in order, any of whose signatures saves a storage owns it."""

    def __init__(self, recorder: Recorder, record: SavedRecord, interp: "_SavingInterpreter"):
        self.rec, self.record, self.interp = recorder, record, interp
        self.cache: dict = {}
        # (what the node's runs depend on besides the signature, id(signature)) -> (signature, what its
        # local op saves): the ops of identical layers share both, so each is looked up once
        self.of_node: dict[tuple, tuple] = {}
        self.fresh = 0

    def measure(self) -> None:
        g = self.rec.graph
        owners: dict[int, str] = {}
        for node in g.nodes:
            if node.op != "call" or node.name not in self.record.saved or node.name not in self.rec.contexts:
                continue
            per_sig = {}
            arguments = self._arguments(node)
            for sig in node.signatures:
                items = self._items(node, sig, arguments)
                if items is not None:
                    per_sig[sig] = items
            for items in per_sig.values():
                for it in items:
                    owners.setdefault(it[6], node.name)
            self.record.local[node.name] = {
                sig: [SavedItem(*it[:7], owners[it[6]] == node.name, it[7]) for it in items]
                for sig, items in per_sig.items()
            }

    def _arguments(self, node: Node) -> tuple:
        """What the runs of ``node``'s local ops depend on besides the signature: the op, its literal
        arguments, and per input its global shape, dtype, ``requires_grad`` and first place among the
        inputs (the shapes of all inputs: a signature that cannot split one is not run)."""
        g, dtypes = self.rec.graph, self.record.dtypes
        ctx = self.rec.contexts[node.name]
        n_arg = len(value_leaves((ctx.args, ctx.kwargs), TensorMeta))
        inputs = tuple(
            (g.tensors[t].shape, dtypes.get(t, g.tensors[t].dtype), g.tensors[t].requires_grad, node.inputs.index(t))
            for t in node.inputs
        )
        return node.target, repr(ctx.args), repr(ctx.kwargs), n_arg, inputs

    def _items(self, node: Node, sig: Signature, arguments: tuple) -> list[tuple] | None:
        """``(slot, index, nbytes, dtype, how, shape, storage, held)`` per storage that ``node``'s local op
        under ``sig`` saves (a :class:`SavedItem` but for its owner, known once every signature is in)."""
        hit = self.of_node.get((arguments, id(sig)))
        if hit is None or hit[0] is not sig:
            hit = self.of_node[arguments, id(sig)] = (sig, self._measured(node, sig, arguments))
        measured = hit[1]
        if measured is None:
            return None
        items = []
        for slot, index, nbytes, dtype, how, shape in measured:
            if slot == "in":
                gkey = self.interp.tid_key.get(node.inputs[index])
            elif slot == "out":
                gkey = self.interp.tid_key.get(node.outputs[index])
            else:
                gkey = None
            if gkey is None:
                storage, held = -1 - self.fresh, False
                self.fresh += 1
            else:
                storage = self.interp.storage_ids.setdefault(gkey, len(self.interp.storage_ids))
                held = gkey in self.interp.held
            items.append((slot, index, nbytes, dtype, how, shape, storage, held))
        return items

    def _measured(self, node: Node, sig: Signature, arguments: tuple) -> list | None:
        """What ``node``'s local op under ``sig`` saves (:meth:`_run`), once per distinct op, signature,
        local shapes and arguments; None where it cannot run here."""
        g = self.rec.graph
        target, args, kwargs, n_arg, inputs = arguments
        try:
            shapes = [f.local_shape(shape, g.mesh) for (shape, *_), f in zip(inputs, sig.inputs)]
        except ValueError:
            return None
        specs = tuple((t, sh, dt, rg) for t, sh, (_, dt, rg, _) in zip(node.inputs[:n_arg], shapes, inputs))
        key = (
            target,
            sig.inputs,
            sig.outputs,
            sig.impl,
            repr(sig.params),
            args,
            kwargs,
            tuple((sh, dt, rg, at) for sh, (_, dt, rg, at) in zip(shapes, inputs[:n_arg])),
        )
        if key not in self.cache:
            self.cache[key] = self._run(self.rec.contexts[node.name], sig, specs, g.mesh)
        return self.cache[key]

    def _run(self, ctx, sig: Signature, specs, mesh: tuple[int, ...]) -> list | None:
        """(slot, index, bytes, dtype, how, shape) per storage the local op's backward keeps; None when
        the local op cannot run here (it then falls back to the whole op's record)."""
        made: dict[int, torch.Tensor] = {}
        tensors = []
        for tid, shape, dtype, grad in specs:
            if tid not in made:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device="cpu")
                made[tid] = t.requires_grad_(True) if grad and t.is_floating_point() else t
            tensors.append(made[tid])
        packed: list[torch.Tensor] = []

        def pack(t):
            packed.append(t)
            return t

        try:
            if sig.axes:
                call = localize_mesh(ctx, sig, (0,) * len(mesh), mesh, rules.localize, tensors)
            else:
                call = rules.localize(ctx.with_tensors(tensors), sig, 0)
            args, kwargs = map_value(tuple(call.args), _cpu), map_value(dict(call.kwargs), _cpu)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = rules.kernel_of(call.target)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a local op that needs more than fake tensors: whole-op record
            return None
        in_keys = [_storage_key(t) for t in tensors]
        out_keys = [_storage_key(t) for t in value_leaves(out, torch.Tensor)]
        found, seen = [], set()
        for t in packed:
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            nbytes, dtype, shape = int(t.untyped_storage().nbytes()), dtype_name(t.dtype), tuple(t.shape)
            if key in in_keys:
                found.append(("in", in_keys.index(key), nbytes, dtype, "input", shape))
            elif key in out_keys:
                found.append(("out", out_keys.index(key), nbytes, dtype, "output", shape))
            else:
                found.append(("", -1, nbytes, dtype, "internal", shape))
        return found
