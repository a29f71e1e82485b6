"""hidup's intermediate representation: plain Python data, no torch objects.

A :class:`Graph` is the traced training step of one model for one world size.  It holds
:class:`Node` objects in topological order and :class:`Tensor` records keyed by integer id.
Every node lists the ways it may be sharded as :class:`Signature` objects: one :class:`Form`
per consumed tensor and one per produced tensor, with the per-rank forward FLOPs.

Forms (how one logical tensor lives on N ranks)
-----------------------------------------------
======================  ========================================================  ================
form                    meaning                                                   DTensor
======================  ========================================================  ================
``full``                every rank holds the whole tensor                         Replicate()
``gather_d``            rank r holds the r-th of N equal slices along dim d       Shard(d)
``reduce``              every rank holds a partial sum; the value is their sum    Partial("sum")
``replicate``           a parameter kept whole on every rank (its gradient must   Replicate()
                        be all-reduced); only parameters produce it
======================  ========================================================  ================

Gradient convention
-------------------
The gradient of a ``full`` tensor is held as per-rank partial contributions (the true gradient
is their sum); the gradient of a ``gather_d`` tensor is exact for the local slice; the gradient of
a ``reduce`` tensor is exact and identical on every rank.  Every backward pass of a local op is
linear in its output gradient, so a replicated computation keeps partial gradients partial, and a
rule is correct exactly when its simulated-SPMD forward *and* backward match the unsplit op.

Form changes
------------
:func:`conversion` gives the forward and backward operation of each change.  Under the convention
above the backward of ``full -> gather_d`` is a zero-padding (free, no communication) and the
backward of ``reduce -> full`` is an all-reduce (it turns partial contributions into the exact
gradient a ``reduce`` tensor must carry).  ``full -> reduce`` keeps the value on rank 0 and zeros
elsewhere, so ``add(reduce, full bias)`` can be written as ``add(reduce, reduce)`` without ever
adding the bias N times.

Meshes
------
A graph may be traced for a device mesh of several axes, outer first (``Graph.mesh``, e.g. ``(8, 8)``
for nodes x GPUs per node; rank ``r`` sits at coordinates ``divmod``-ed row-major, as in torch's
``DeviceMesh``).  A tensor then has a :class:`Layout`: one form per axis, each axis acting on what the
axes before it left -- ``gather_0|gather_0`` on a 2x4 mesh gives rank ``(i, j)`` slice ``4 i + j`` of
eight, ``reduce|gather_1`` the ``j``-th column slice of the ``i``-th partial sum.  The gradient
convention above holds per axis (a ``full|gather_d`` tensor's gradient is partial over axis 0 and
exact for the slice over axis 1).  A signature on a mesh is the product of one rule signature per
axis, the axis ``k`` one found by the rule on the op as axes ``< k`` localized it (``Signature.axes``),
so it is right whenever each one-axis signature is.

A layout change is a sequence of one-axis form changes (:class:`MeshStep`), each a collective over one
axis's group, on the tensor as the other axes hold it.  Changing axis ``k`` is one collective unless
an axis after ``k`` splits a dim that the change splits or joins: that axis cut ``k``'s slices into
pieces the change would have to interleave (``gather_0|gather_0 -> full|gather_0`` holds slice
``4 i + j`` and needs slice ``j`` of four).  :func:`layout_conversions` lists the valid orders of the
changed axes plus one path that always works (split axes inside the outermost changed one taken back
to ``full``, innermost first -- with a parameter's ``replicate`` axes too when the target holds a
partial sum, which a layout never holds beside ``replicate`` -- then every axis set outermost first); the
cost model takes the cheapest.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Iterable

__all__ = [
    "Form",
    "zero_stage",
    "RECOMPUTE_CHOICES",
    "RESHARD_CHOICES",
    "FULL",
    "REDUCE",
    "REPLICATE",
    "gather",
    "Conversion",
    "conversion",
    "FormChangeOp",
    "FORM_CHANGE_OPS",
    "FORM_CHANGES",
    "COLLECTIVES",
    "Tensor",
    "Signature",
    "Node",
    "Graph",
    "DTYPE_BYTES",
    "GRAD_BUCKET_MB",
    "GRAD_PACK_BYTES",
    "ZERO_STAGES",
    "ZERO_CHOICES",
    "OFFLOAD_CHOICES",
    "OFFLOADS",
    "zero_splits",
    "block_label",
    "block_family",
    "prefetch_units",
    "async_gather_link",
    "graph_segments",
    "Layout",
    "MeshStep",
    "MeshConversion",
    "layout_conversions",
    "parse_form",
    "axis_forms",
    "held_fraction",
    "mesh_text",
    "parse_mesh",
]

# Size of the buckets in which the runtime all-reduces the gradients of replicated parameters
# (hidup.codegen.grads); the search prices that all-reduce per bucket (hidup.search.cost).
GRAD_BUCKET_MB = 25.0

# A gradient of fewer bytes is copied into its bucket's flat buffer and summed there; a larger one is
# summed where it lies, as its own tensor of the bucket's coalesced all-reduce (hidup.codegen.grads).
# Copying 1 MiB in and out of a buffer costs about a microsecond of device memory traffic, what one
# more tensor in a coalesced NCCL call costs; below it the copy is the cheaper, above it the in-place sum.
GRAD_PACK_BYTES = 1 << 20

# ZeRO stages a replicated parameter may be kept in (hidup.codegen.zero): 1 splits its optimizer state
# over the ranks, 2 its gradient too; 0 (no entry in a plan) keeps both whole on every rank.
ZERO_STAGES = (1, 2)
# what a search's and a training run's ``zero`` option takes: "auto" (the search uses ZeRO where it pays
# under a memory budget; a run does as its plan says), "off", or a stage forced on every such parameter
ZERO_CHOICES = ("auto", "off", "1", "2")
# what a search's ``recompute`` and ``reshard`` options take besides a list (hidup.search.api): "auto"
# (only where a memory budget needs it), "on", "off"; recompute also "selective" (every repeated layer)
RECOMPUTE_CHOICES = ("auto", "on", "selective", "off")
RESHARD_CHOICES = ("auto", "on", "off")
# where a plan keeps Adam's state (hidup.codegen.offload): "optimizer" in the host's memory, stepped by the
# host's CPU (the moments and a float32 copy of the weights it steps); no entry in a plan: on the device
OFFLOADS = ("optimizer",)
# what a search's and a training run's ``offload`` option takes: "auto" (the search offloads only when no
# plan fits the memory budget without it; a run does as its plan says), "off", or an offload forced
OFFLOAD_CHOICES = ("auto", "off", *OFFLOADS)


def zero_splits(shape: tuple[int, ...], world: int) -> bool:
    """Whether ZeRO can split a replicated parameter of ``shape`` over ``world`` ranks: rank ``r`` then
    holds rows ``[r n / N, (r + 1) n / N)`` of its dim 0 (``n = shape[0]``, which ``N`` must divide) --
    a contiguous piece, so a reduce-scatter and an all-gather move it without copies.  Codegen, the
    memory model and the cost model read this one rule; a parameter it refuses stays unsplit."""
    return world > 1 and len(shape) >= 1 and shape[0] > 0 and shape[0] % world == 0


def zero_stage(graph: Graph, zero: int, tid: int, form) -> int:
    """The ZeRO stage (0: none) of tensor ``tid`` produced in ``form`` when a plan asks for stage ``zero``:
    ``zero`` for a trainable parameter stored ``replicate`` whose rows the world divides (the rule the
    rank program applies, :mod:`hidup.codegen.zero`), on a graph of one axis; 0 for anything else."""
    if not zero or len(graph.mesh) > 1 or isinstance(form, Layout) or form.kind != "replicate":
        return 0
    t = graph.tensors[tid]
    return zero if t.is_param and t.requires_grad and zero_splits(tuple(t.shape), graph.world_size) else 0


# Collective operations that cost communication; every other conversion op is local.
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, order=True)
class Form:
    """How one logical tensor is laid out across the ranks (see module docstring)."""

    kind: str  # "full" | "gather" | "reduce" | "replicate"
    dim: int = -1  # the sharded dim for "gather", else -1

    def __post_init__(self):
        if self.kind not in ("full", "gather", "reduce", "replicate"):
            raise ValueError(f"unknown form kind {self.kind!r}; expected full, gather, reduce or replicate")
        if (self.kind == "gather") != (self.dim >= 0):
            raise ValueError(f"form {self.kind!r} with dim {self.dim}: only 'gather' takes a (non-negative) dim")

    @property
    def is_gather(self) -> bool:
        return self.kind == "gather"

    def __str__(self) -> str:
        return f"gather_{self.dim}" if self.kind == "gather" else self.kind

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Form":
        """Inverse of ``str(form)``: ``"full"``, ``"reduce"``, ``"replicate"`` or ``"gather_<d>"``."""
        if text.startswith("gather_"):
            try:
                return Form("gather", int(text[len("gather_") :]))
            except ValueError:
                pass
        elif text in ("full", "reduce", "replicate"):
            return Form(text)
        raise ValueError(f"cannot parse form {text!r}; expected full, reduce, replicate or gather_<dim>")

    def local_shape(self, shape: Iterable[int], world: "int | tuple[int, ...]") -> tuple[int, ...]:
        """Shape of one rank's piece of a tensor of logical ``shape`` (``world``: the rank count, or a
        one-axis mesh ``(N,)``)."""
        shape = tuple(shape)
        if isinstance(world, tuple):
            if len(world) != 1:
                raise ValueError(f"form {self} is one mesh axis's; the mesh {world} has {len(world)} axes")
            world = world[0]
        if self.kind != "gather":
            return shape
        if self.dim >= len(shape) or shape[self.dim] % world:
            raise ValueError(f"form {self} does not fit shape {shape} on {world} ranks")
        return shape[: self.dim] + (shape[self.dim] // world,) + shape[self.dim + 1 :]


FULL = Form("full")
REDUCE = Form("reduce")
REPLICATE = Form("replicate")


def gather(dim: int) -> Form:
    return Form("gather", dim)


@dataclass(frozen=True)
class FormChangeOp:
    """One op a form change runs, forward or backward: an entry of :data:`FORM_CHANGE_OPS`, the one
    registry that the IR (:func:`conversion`), codegen (:func:`hidup.codegen.collectives.apply_op`,
    the compiled program's shapes) and the cost model (its communication and memory copies) read.

    ``collective`` is the collective it runs (``""``: a local op).  ``resizes`` says how the local
    shape changes, ``src`` and ``dst`` being the forms before and after the op: ``"split_dst"`` (dst's
    gather dim shrinks N-fold), ``"join_src"`` (src's gather dim grows N-fold), ``"move"`` (both)
    or ``""`` (unchanged).  ``adjoint`` is the op that is its adjoint, which the backward of a form
    change runs (``grad_sync`` runs the forward op's adjoint, then sums over ranks)."""

    name: str
    collective: str
    resizes: str
    adjoint: str
    meaning: str


FORM_CHANGE_OPS: dict[str, FormChangeOp] = {
    op.name: op
    for op in (
        FormChangeOp("identity", "", "", "identity", "the tensor as it is"),
        FormChangeOp("slice", "", "split_dst", "zero_pad", "take this rank's slice along dst's gather dim"),
        FormChangeOp("zero_pad", "", "join_src", "slice", "place the local slice in a zero tensor of the whole shape"),
        FormChangeOp(
            "keep_rank0", "", "", "keep_rank0", "rank 0 keeps the value, the others hold zeros (its own adjoint)"
        ),
        FormChangeOp("all_gather", "all_gather", "join_src", "reduce_scatter", "concatenate the ranks' slices"),
        FormChangeOp(
            "reduce_scatter", "reduce_scatter", "split_dst", "all_gather", "sum over ranks, keep this rank's slice"
        ),
        FormChangeOp("all_reduce", "all_reduce", "", "all_reduce", "sum over ranks"),
        FormChangeOp("all_to_all", "all_to_all", "move", "all_to_all", "re-slice from src's gather dim to dst's"),
        FormChangeOp(
            "grad_sync",
            "all_reduce",
            "",
            "",
            "the backward of a replicated parameter's use: the adjoint of the forward op, then the sum "
            "over ranks; in a rank program the gradient bucketer sums each parameter's accumulated "
            "gradient once per backward (hidup.codegen.grads)",
        ),
    )
}

# Form changes by (source kind, destination kind): (forward op, backward op).  A replicated
# parameter enters a rank program as its whole (``full``) value, so it converts like a ``full``
# tensor forward, and its backward is ``grad_sync``.
FORM_CHANGES: dict[tuple[str, str], tuple[str, str]] = {
    ("full", "gather"): ("slice", "zero_pad"),
    ("full", "reduce"): ("keep_rank0", "keep_rank0"),
    ("gather", "full"): ("all_gather", "reduce_scatter"),
    ("gather", "gather"): ("all_to_all", "all_to_all"),
    ("gather", "reduce"): ("zero_pad", "slice"),
    ("reduce", "full"): ("all_reduce", "all_reduce"),
    ("reduce", "gather"): ("reduce_scatter", "all_gather"),
    ("replicate", "full"): ("identity", "grad_sync"),
    ("replicate", "gather"): ("slice", "grad_sync"),
    ("replicate", "reduce"): ("keep_rank0", "grad_sync"),
}
for _fwd, _bwd in FORM_CHANGES.values():  # every backward is its forward's adjoint, or a gradient sum
    if _bwd not in (FORM_CHANGE_OPS[_fwd].adjoint, "grad_sync"):
        raise AssertionError(f"form change {_fwd} -> backward {_bwd} is not its adjoint")


@dataclass(frozen=True)
class Conversion:
    """A form change: the op run forward and the op its backward runs (names of
    :data:`FORM_CHANGE_OPS`)."""

    src: Form
    dst: Form
    forward: str
    backward: str

    @property
    def collectives(self) -> tuple[str, str]:
        """(forward, backward) collective names, ``""`` where no communication happens."""
        return FORM_CHANGE_OPS[self.forward].collective, FORM_CHANGE_OPS[self.backward].collective

    @property
    def free(self) -> bool:
        return self.collectives == ("", "")

    @property
    def backward_local(self) -> str:
        """The local op of the backward: the backward itself, or for ``grad_sync`` the forward's adjoint."""
        return FORM_CHANGE_OPS[self.forward].adjoint if self.backward == "grad_sync" else self.backward

    @property
    def grad_sync(self) -> bool:
        """The backward is a replicated parameter's gradient sum (bucketed, asynchronous)."""
        return self.backward == "grad_sync"


def conversion(src: Form, dst: Form) -> Conversion | None:
    """How to turn a tensor in form ``src`` into form ``dst`` (:data:`FORM_CHANGES`); ``None`` when
    it cannot be done.  ``dst`` is never ``replicate`` (only a parameter produces it) except for
    ``src == dst``."""
    if src == dst:
        return Conversion(src, dst, "identity", "identity")
    ops = FORM_CHANGES.get((src.kind, dst.kind))
    return Conversion(src, dst, *ops) if ops else None


@dataclass(frozen=True, order=True)
class Layout:
    """How one logical tensor lives on a device mesh: one :class:`Form` per mesh axis, outer axis first
    (module docstring, "Meshes")."""

    forms: tuple[Form, ...]

    def __hash__(self) -> int:  # layouts key the search's caches: hash once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self.forms)
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # a hash is per process (strings hash by a per-process seed)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self):
        if len(self.forms) < 2 or not all(isinstance(f, Form) for f in self.forms):
            raise ValueError(f"a layout holds one Form per axis of a mesh of 2 or more axes, got {self.forms!r}")

    @property
    def is_gather(self) -> bool:
        return any(f.is_gather for f in self.forms)

    def __str__(self) -> str:
        return "|".join(map(str, self.forms))

    __repr__ = __str__

    def local_shape(self, shape: Iterable[int], mesh: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one rank's piece: each axis's split applied to what the axes before it left."""
        if not isinstance(mesh, tuple) or len(mesh) != len(self.forms):
            raise ValueError(f"layout {self} has {len(self.forms)} axes; mesh {mesh!r} does not match")
        shape = tuple(shape)
        for form, size in zip(self.forms, mesh):
            shape = form.local_shape(shape, size)
        return shape

    def with_axis(self, axis: int, form: Form) -> "Layout":
        return Layout(self.forms[:axis] + (form,) + self.forms[axis + 1 :])


def parse_form(text: str) -> "Form | Layout":
    """Inverse of ``str()`` of a :class:`Form` or a :class:`Layout` (``"gather_0|full"``)."""
    if "|" in text:
        return Layout(tuple(Form.parse(t) for t in text.split("|")))
    return Form.parse(text)


def axis_forms(form: "Form | Layout") -> tuple[Form, ...]:
    """``form``'s form on each mesh axis, outer first (one axis: the form itself)."""
    return form.forms if isinstance(form, Layout) else (form,)


def held_fraction(form: "Form | Layout", mesh: "int | tuple[int, ...]") -> float:
    """The share of a tensor's elements one rank holds under ``form`` (1 unless something is split)."""
    sizes = (mesh,) if isinstance(mesh, int) else mesh
    forms = axis_forms(form)
    return 1.0 / math.prod(n for f, n in zip(forms, sizes) if f.is_gather)


def mesh_text(mesh: tuple[int, ...]) -> str:
    """``(2, 4)`` -> ``"2x4"``."""
    return "x".join(map(str, mesh))


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``; ``"8"`` -> ``(8,)``; raises ValueError naming the problem."""
    try:
        sizes = tuple(int(t) for t in str(text).lower().split("x"))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"mesh {text!r}: expected sizes joined by 'x', outer axis first, e.g. 2x4 or 8x8")
    return sizes


@dataclass(frozen=True)
class MeshStep:
    """One step of a layout change: the form change ``conv`` on mesh axis ``axis`` (a collective over
    that axis's group of ranks), turning layout ``before`` into ``after``."""

    axis: int
    conv: Conversion
    before: Layout
    after: Layout


@dataclass(frozen=True)
class MeshConversion:
    """A layout change as a sequence of one-axis form changes (:func:`layout_conversions`); its
    backward runs the steps' backward ops in reverse order."""

    src: Layout
    dst: Layout
    steps: tuple[MeshStep, ...]

    @property
    def free(self) -> bool:
        return all(s.conv.free for s in self.steps)

    @property
    def grad_sync(self) -> bool:
        return any(s.conv.grad_sync for s in self.steps)

    @property
    def forward(self) -> str:
        """The forward ops, ``op@axis`` joined by ``+`` (``identity`` for no step)."""
        return "+".join(f"{s.conv.forward}@{s.axis}" for s in self.steps) or "identity"

    @property
    def backward(self) -> str:
        """The backward ops in the order they run (the steps reversed)."""
        return "+".join(f"{s.conv.backward}@{s.axis}" for s in reversed(self.steps)) or "identity"


def _gathered_dims(*forms: Form) -> set[int]:
    return {f.dim for f in forms if f.is_gather}


def _mesh_step(layout: Layout, axis: int, form: Form) -> MeshStep | None:
    """Axis ``axis`` of ``layout`` changed to ``form``, or None when that cannot be one collective:
    the form change does not exist, or an axis after ``axis`` splits a dim this change splits or
    joins (that axis cut the slices this one would move: module docstring, "Meshes"), or the result
    would hold a partial sum beside a parameter's ``replicate`` axis (no layout)."""
    src = layout.forms[axis]
    conv = conversion(src, form)
    if conv is None:
        return None
    moved = _gathered_dims(src, form)
    if moved & _gathered_dims(*layout.forms[axis + 1 :]):
        return None
    kinds = {f.kind for f in layout.forms[:axis] + (form,) + layout.forms[axis + 1 :]}
    if {"replicate", "reduce"} <= kinds:
        return None
    return MeshStep(axis, conv, layout, layout.with_axis(axis, form))


def _walk(src: Layout, targets: list[tuple[int, Form]]) -> tuple[MeshStep, ...] | None:
    steps, at = [], src
    for axis, form in targets:
        if at.forms[axis] == form:
            continue
        step = _mesh_step(at, axis, form)
        if step is None:
            return None
        steps.append(step)
        at = step.after
    return tuple(steps)


def layout_conversions(src: Layout, dst: Layout) -> list[MeshConversion]:
    """Every way this module knows to turn layout ``src`` into ``dst``, as one-axis steps (an empty
    list when there is none; ``[no steps]`` when they are equal).  The cost model takes the cheapest.

    Candidates: the differing axes changed directly in every order whose steps are all valid
    (:func:`_mesh_step`), and one path that always exists unless ``dst`` asks for a ``replicate`` that
    ``src`` lacks: take every split axis inside the outermost differing one back to ``full``
    (innermost first; when ``dst`` holds a partial sum, every ``replicate`` axis there too, since a
    layout never holds both), then set the axes to ``dst`` outermost first."""
    if len(src.forms) != len(dst.forms):
        raise ValueError(f"layouts {src} and {dst} are on meshes of different ranks")
    if src == dst:
        return [MeshConversion(src, dst, ())]
    differ = [k for k in range(len(src.forms)) if src.forms[k] != dst.forms[k]]
    paths: dict[tuple, MeshConversion] = {}

    def add(targets: list[tuple[int, Form]]) -> None:
        steps = _walk(src, targets)
        if steps is not None and steps and steps[-1].after == dst:
            paths.setdefault(
                tuple((s.axis, s.conv.forward, s.conv.backward) for s in steps), MeshConversion(src, dst, steps)
            )

    for order in itertools.permutations(differ):
        add([(k, dst.forms[k]) for k in order])
    outer = differ[0]
    summed = any(f.kind == "reduce" for f in dst.forms)
    lower = [
        (k, FULL)
        for k in reversed(range(outer + 1, len(src.forms)))
        if src.forms[k].is_gather or (summed and src.forms[k].kind == "replicate")
    ]
    add(lower + [(k, dst.forms[k]) for k in range(outer, len(src.forms))])
    return list(paths.values())


@dataclass
class Tensor:
    """One logical tensor of the traced step (global shape, as on a single device)."""

    id: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    producer: str  # name of the node that produces it
    requires_grad: bool = False
    is_param: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "producer": self.producer,
            "requires_grad": self.requires_grad,
            "is_param": self.is_param,
        }

    @staticmethod
    def from_dict(d: dict) -> "Tensor":
        return Tensor(d["id"], tuple(d["shape"]), d["dtype"], d["producer"], d["requires_grad"], d["is_param"])


@dataclass(frozen=True)
class Signature:
    """One way to run a node on N ranks.

    ``inputs[i]`` is the form the node needs for ``node.inputs[i]``; ``outputs[j]`` the form it
    produces for ``node.outputs[j]``.  ``flops`` is the forward FLOP count on one rank.
    ``kind`` labels the parallelism for reports (``data``, ``tensor``, ``expert``, ``replicated``,
    ``param``); ``impl`` names a per-rank implementation when the local op differs from the
    original one (e.g. a vocabulary-sharded embedding), with plain-data ``params``.
    """

    inputs: tuple["Form | Layout", ...]
    outputs: tuple["Form | Layout", ...]
    flops: float = 0.0
    kind: str = "replicated"
    impl: str = ""
    params: tuple[tuple[str, object], ...] = ()
    # on a mesh of several axes: the rule's one-axis signature per axis, outer first, the axis ``k``
    # one holding the forms of the op as axes ``< k`` left it (module docstring, "Meshes")
    axes: tuple["Signature", ...] = ()

    def __hash__(self) -> int:  # signatures key the record's and the search's tables: hash once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.inputs, self.outputs, self.flops, self.kind, self.impl, self.params, self.axes))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # a hash is per process (strings hash by a per-process seed)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        extra = f" [{self.impl}]" if self.impl else ""
        return f"({ins}) -> ({outs}){extra}"

    def to_dict(self) -> dict:
        return {
            "inputs": [str(f) for f in self.inputs],
            "outputs": [str(f) for f in self.outputs],
            "flops": self.flops,
            "kind": self.kind,
            "impl": self.impl,
            "params": [[k, v] for k, v in self.params],
            **({"axes": [a.to_dict() for a in self.axes]} if self.axes else {}),
        }

    @staticmethod
    def from_dict(d: dict) -> "Signature":
        return Signature(
            tuple(parse_form(f) for f in d["inputs"]),
            tuple(parse_form(f) for f in d["outputs"]),
            d["flops"],
            d["kind"],
            d.get("impl", ""),
            tuple((k, v) for k, v in d.get("params", [])),
            tuple(Signature.from_dict(a) for a in d.get("axes", ())),
        )


_BLOCK_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_label(module: str) -> str:
    """Repeated-layer prefix of a module path: ``layers.3.attn.q`` -> ``layers.3``; ``""`` if none."""
    m = _BLOCK_RE.match(module or "")
    return m.group(1) if m else ""


def block_family(label: str) -> str:
    """The list a repeated layer belongs to: ``model.layers.3`` -> ``model.layers``."""
    return label.rsplit(".", 1)[0]


def prefetch_units(labels) -> list[int]:
    """The unit of each op of a program, given each op's :func:`block_label` in program order: units are
    the maximal runs of one label (a repeated layer, or the ops outside any), numbered from 0.  A
    parameter's gather charged to an op of unit ``u > 0`` is issued at the start of unit ``u - 1``
    (:mod:`hidup.codegen.prefetch`) and priced as overlapping that unit's compute
    (:mod:`hidup.search.problem`, "Prefetched gathers"): one statement of the unit for both."""
    out, unit, last = [], -1, None
    for label in labels:
        if label != last:
            unit, last = unit + 1, label
        out.append(unit)
    return out


def graph_segments(labels, new_bytes, limit: float) -> list[int]:
    """The compiled graph of each op of a program compiled in gradient-bucket segments: ``labels`` each
    op's :func:`block_label` in program order, ``new_bytes`` the bytes of the replicated parameters it
    is the first to read.  Once those read in the open segment hold ``limit`` bytes or more, a new
    segment starts at the next *cut*: the first op of a repeated layer, or, where no op has a label, any
    op that first reads a replicated parameter.  :func:`hidup.codegen.compiled.bucket_segments` cuts the
    program there, and :func:`hidup.search.schedule.evaluate` prices where each graph's backward ends
    (its asynchronous reduce-scatters waited for): one statement of the rule for both."""
    labels, new_bytes = list(labels), list(new_bytes)
    layered = any(labels)
    segment, held, layer, out = 0, 0, "", []
    for here, new in zip(labels, new_bytes):
        cut = (here and here != layer) if layered else bool(new)
        layer = here or layer
        if cut and held >= limit:
            segment, held = segment + 1, 0
        held += new
        out.append(segment)
    return out


def async_gather_link(ops) -> int | None:
    """Which link of a prefetched parameter's form change a compiled program runs as an asynchronous
    all-gather: ``ops`` are the forward ops (:data:`FORM_CHANGE_OPS` names) of the change's links in
    order (one, or one per mesh step); the answer is the index of its only collective when that is an
    all-gather, else None (the change then runs in place, blocking).  The compiled program issues that
    link as torch's functional all-gather at the start of the previous unit and waits for it at the
    consumer, so it overlaps the unit's compute as the eager side stream does
    (:mod:`hidup.codegen.prefetch`); the cost model gives such a change, and only such a change, a
    prefetch window when it prices a compiled program (:mod:`hidup.search.problem`, "Prefetched
    gathers"): one statement of the condition for both."""
    ops = list(ops)
    comm = [i for i, op in enumerate(ops) if FORM_CHANGE_OPS[op].collective]
    return comm[0] if len(comm) == 1 and ops[comm[0]] == "all_gather" else None


@dataclass
class Node:
    """One operation of the traced step.

    ``op`` is ``input`` (a model input), ``param`` (a parameter or buffer), ``call`` (an
    operation) or ``output`` (consumes the loss).  ``name`` equals the torch.fx node name.
    ``target`` is a readable op name (``linear``, ``layer_norm``, ``moe_gating``, ``add.Tensor``: the
    ATen overload, ``.default`` dropped).  ``module`` is the qualified name of the ``nn.Module`` that issued the op
    (``layers.3.attn``), ``source`` the user's file:line.  ``variant`` names the kernel an op with a
    non-tensor argument that changes its cost runs (:func:`hidup.rules.variant`: ``causal`` or
    ``masked`` for attention); empty for every other op.
    """

    name: str
    op: str
    target: str
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    signatures: list[Signature] = field(default_factory=list)
    flops: float = 0.0
    module: str = ""
    source: str = ""
    fallback: bool = False
    variant: str = ""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "op": self.op,
            "target": self.target,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "signatures": [s.to_dict() for s in self.signatures],
            "flops": self.flops,
            "module": self.module,
            "source": self.source,
            "fallback": self.fallback,
            **({"variant": self.variant} if self.variant else {}),
        }

    @staticmethod
    def from_dict(d: dict) -> "Node":
        return Node(
            d["name"],
            d["op"],
            d["target"],
            list(d["inputs"]),
            list(d["outputs"]),
            [Signature.from_dict(s) for s in d["signatures"]],
            d["flops"],
            d.get("module", ""),
            d.get("source", ""),
            d.get("fallback", False),
            d.get("variant", ""),
        )


@dataclass
class Graph:
    """The traced step: nodes in topological order plus the tensors between them."""

    nodes: list[Node]
    tensors: dict[int, Tensor]
    world_size: int
    model: str = ""
    fallbacks: list[str] = field(default_factory=list)  # names of nodes replicated for lack of a rule
    # the same step traced at half the batch (one duplicated copy's program), when the tracer was
    # asked for it: the cost model reads its shapes to price the half-batch copies' ops
    half: "Graph | None" = field(default=None, repr=False, compare=False)
    # why duplication's two half-batch copies would not add up to the step's loss, "" when they do
    # (hidup.copies): the search then keeps duplication off
    copy_reason: str = ""
    # the device mesh, outer axis first (module docstring, "Meshes"); () means one axis of world_size
    mesh: tuple[int, ...] = ()

    def __post_init__(self):
        self.mesh = tuple(self.mesh) or (self.world_size,)
        if math.prod(self.mesh) != self.world_size:
            raise ValueError(
                f"mesh {mesh_text(self.mesh)} holds {math.prod(self.mesh)} ranks, world_size is {self.world_size}"
            )
        self._by_name = {n.name: n for n in self.nodes}
        self._consumers: dict[int, list[tuple[Node, int]]] | None = None

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"graph has no node named {name!r}") from None

    def consumers(self, tensor_id: int) -> list[tuple[Node, int]]:
        """(node, input index) pairs that read ``tensor_id``."""
        if self._consumers is None:
            cons: dict[int, list[tuple[Node, int]]] = {t: [] for t in self.tensors}
            for n in self.nodes:
                for i, t in enumerate(n.inputs):
                    cons.setdefault(t, []).append((n, i))
            self._consumers = cons
        return self._consumers.get(tensor_id, [])

    def params(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "param"]

    @property
    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def fingerprint(self) -> str:
        """A hash of the structure (ops, edges, shapes, dtypes, world size), stable across runs."""
        h = hashlib.sha256()
        h.update(str(self.world_size).encode())
        if len(self.mesh) > 1:
            h.update(f"mesh {self.mesh}".encode())
        for n in self.nodes:
            h.update(f"{n.name}|{n.op}|{n.target}|{n.inputs}|{n.outputs};".encode())
        for tid in sorted(self.tensors):
            t = self.tensors[tid]
            h.update(f"{tid}|{t.shape}|{t.dtype}|{t.is_param};".encode())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "world_size": self.world_size,
            "fallbacks": list(self.fallbacks),
            "copy_reason": self.copy_reason,
            **({"mesh": list(self.mesh)} if len(self.mesh) > 1 else {}),
            "nodes": [n.to_dict() for n in self.nodes],
            "tensors": [self.tensors[t].to_dict() for t in sorted(self.tensors)],
        }

    @staticmethod
    def from_dict(d: dict) -> "Graph":
        tensors = {t["id"]: Tensor.from_dict(t) for t in d["tensors"]}
        return Graph(
            [Node.from_dict(n) for n in d["nodes"]],
            tensors,
            d["world_size"],
            d.get("model", ""),
            list(d.get("fallbacks", [])),
            copy_reason=d.get("copy_reason", ""),
            mesh=tuple(d.get("mesh") or ()),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def validate(self) -> None:
        """Check internal consistency; raise ValueError naming the first problem."""
        seen: set[int] = set()
        for n in self.nodes:
            for t in n.inputs:
                if t not in seen:
                    raise ValueError(f"node {n.name} reads tensor {t} before it is produced")
            for s in n.signatures:
                if len(s.inputs) != len(n.inputs) or len(s.outputs) != len(n.outputs):
                    raise ValueError(
                        f"node {n.name}: signature {s} does not match {len(n.inputs)} inputs / {len(n.outputs)} outputs"
                    )
            if n.op != "output" and not n.signatures:
                raise ValueError(f"node {n.name} has no signature")
            seen.update(n.outputs)
