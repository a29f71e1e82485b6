"""Build the fx program one rank runs under a plan.

For rank r of N and a :class:`hidup.plan.Plan` (one :class:`~hidup.ir.Signature` per node):

* **inputs**: the module takes the *global* batch; an input whose chosen form is ``gather_d`` is
  sliced to ``x[.., r*n/N:(r+1)*n/N, ..]`` along ``d`` (``full`` inputs pass unchanged).  With
  ``local_batch=True`` the caller passes each input already in its chosen form's local piece
  (``module.input_forms`` lists them).
* **parameters** are physically sharded: a ``gather_d`` parameter is stored as a new
  ``nn.Parameter`` holding only slice r; ``replicate`` ones whole.  ``module.param_shards`` maps
  each stored tensor to its logical name and shape.
* **form changes**: for every consumer input whose required form differs from the producer's
  form, one :func:`hidup.codegen.collectives.convert` is inserted per (tensor, target form) and
  shared by all consumers needing that form.
* **ops**: every call node becomes ``hidup.rules.localize(ctx, sig, r)``; values without tensors
  were folded by the tracer and are not recomputed.
* **loss**: brought to ``reduce`` form (``full -> reduce`` keeps it on rank 0), so the backward
  seed is 1 on every rank (the exact gradient of a ``reduce`` tensor) and the true loss is the
  sum over ranks (:meth:`hidup.codegen.rewrite.HidupModule.global_loss`).
* **replicated parameters** enter the graph as plain ``full`` tensors; their partial gradients are
  summed by bucketed all-reduces overlapped with the backward (:mod:`hidup.codegen.grads`).
* **ZeRO** (``plan.zero``): ``RankProgram.zero`` names the replicated parameters whose gradient and
  optimizer state the runtime splits over the ranks, with their stage (:mod:`hidup.codegen.zero`;
  the program itself is unchanged: they enter it whole).
* **gradients reduced in bf16** (``plan.reduce_dtype``, :mod:`hidup.precision`): the form changes of a
  float32 parameter whose backward sums over ranks are :func:`hidup_convert_cast` with ``reduce``
  (resharded: :func:`hidup_reshard_convert` with ``reduce``), and ``RankProgram.reduce_dtype`` tells the
  gradient bucketers to sum in bf16 (:mod:`hidup.codegen.grads`); both cast only under a bf16 autocast.
* **resharded parameters** (``plan.reshard``): their form changes are :func:`hidup_reshard_convert`
  and the ops that read the converted copy run in :class:`hidup.codegen.reshard.ReshardCall`, so the
  copy is freed after the forward and made again in the backward (:mod:`hidup.codegen.reshard`).

On a device mesh of several axes (``traced.graph.mesh``, :mod:`hidup.codegen.mesh`) rank r sits at
coordinates ``c = unravel_index(r, mesh)``: an input is sliced axis after axis (axis 0's split of the
global tensor, then axis 1's of that piece), a parameter stored likewise, a call node runs
:func:`hidup.rules.mesh.localize_mesh` for ``c``, a layout change is the chain of one-axis steps the
plan chose for it (:func:`hidup_convert_step` on each axis's group; the path of
:func:`hidup.ir.layout_conversions` with the fewest collectives where the plan names none), and the
loss is brought to ``reduce`` on every axis.  ``replicate_axes`` says over which axes each replicated
parameter's gradient is summed.

Every generated node carries ``meta["stage"]``, the index of its plan stage, which
:mod:`hidup.codegen.duplicate` uses to interleave two half-batch copies on CUDA streams.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
import threading
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.fx.node import _get_qualified_name

from hidup import rules
from hidup.codegen import collectives, compiled, prefetch
from hidup.codegen.mesh import MeshGroups, coordinates, current_group, running, using_group
from hidup.codegen.params import ParamShard, local_name, shard_tensor
from hidup.codegen.recompute import REGION, RegionKey, outline_regions
from hidup.codegen.reshard import VIEW_NAMES, ReshardCall, begin_forward, compiled_convert, register
from hidup.codegen.zero import zero_stages
from hidup.errors import UserError
from hidup.fxvalues import map_value, value_leaves
from hidup.ir import (
    FULL,
    REDUCE,
    Form,
    Layout,
    Signature,
    axis_forms,
    block_label,
    layout_conversions,
)
from hidup.precision import (
    REDUCE_DTYPES,
    casts_on_wire,
    is_collective,
    is_reduction,
    reduce_low_params,
    wire_low_params,
)
from hidup.rules import dispatch, random
from hidup.rules.base import TensorMeta
from hidup.rules.mesh import localize_mesh

__all__ = ["RankProgram", "build_rank_program", "current_group", "using_group", "using_copy_sums", "CompileError"]


# the program input that carries the run-time key of its random ops (hidup.rules.random)
RNG_KEY_INPUT = "hidup_rng_key"


class CompileError(UserError, ValueError):
    """The model, plan and world size do not fit together (names the node and the fix)."""


# ------------------------------------------------------------------------------------------------
# Runtime helpers called from the generated code.  The process group is not baked into the code:
# the module sets it around each run (duplicated copies use one group each; hidup.codegen.mesh).

_STATE = threading.local()


def _axis_group(axis: int):
    group = current_group()
    if not isinstance(group, MeshGroups):
        raise RuntimeError(
            "a rank program of a mesh plan runs on the mesh's process groups: call it through the "
            "HidupModule hidup.compile returns (or inside using_group(MeshGroups))"
        )
    return group.axes[axis]


def _dispatch_group(mesh_axis: int | None):
    """The process group of a local call that communicates inside (:mod:`hidup.rules.dispatch`):
    the program's group, or mesh axis ``mesh_axis``'s; :data:`~hidup.rules.dispatch.NO_GROUP` when no
    generated code runs (a memory record or an op timing runs the call as one rank)."""
    if not running():
        return dispatch.NO_GROUP
    return current_group() if mesh_axis is None else _axis_group(mesh_axis)


dispatch.use_group_resolver(_dispatch_group)


@functools.lru_cache(maxsize=None)
def _form(text: str) -> Form:
    return Form.parse(text)


def hidup_convert(x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Generated-code entry point of :func:`hidup.codegen.collectives.convert` (the custom op
    ``hidup::convert`` under ``torch.compile``, :mod:`hidup.codegen.compiled`)."""
    if torch.compiler.is_compiling():
        return torch.ops.hidup.convert(x, src, dst, compiled.ACTIVE.world, compiled.ACTIVE.token)
    return collectives.convert(x, _form(src), _form(dst), current_group())


def hidup_convert_step(x: torch.Tensor, axis: int, src: str, dst: str) -> torch.Tensor:
    """One step of a layout change on a device mesh: the one-axis form change ``src -> dst`` of the
    local tensor over mesh axis ``axis``'s group (:mod:`hidup.codegen.mesh`); its backward is the
    one-axis conversion's, on the same group."""
    if torch.compiler.is_compiling():
        world, token = compiled.ACTIVE.axes[axis]
        return torch.ops.hidup.convert(x, src, dst, world, token)
    return collectives.convert(x, _form(src), _form(dst), _axis_group(axis))


def _low_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's low dtype where it is on for ``x``'s device and ``x`` is float32, else None."""
    kind = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def hidup_convert_kept(x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """:func:`hidup_convert` of an activation inside a selectively recomputed layer: the custom op
    ``hidup::convert_kept``, eager too, whose output the region saves (:mod:`hidup.codegen.recompute`)."""
    return torch.ops.hidup.convert_kept(x, src, dst, compiled.ACTIVE.world, compiled.ACTIVE.token)


def hidup_convert_kept_step(x: torch.Tensor, axis: int, src: str, dst: str) -> torch.Tensor:
    """:func:`hidup_convert_step` of an activation inside a selectively recomputed layer
    (:func:`hidup_convert_kept`)."""
    world, token = compiled.ACTIVE.axes[axis]
    return torch.ops.hidup.convert_kept(x, src, dst, world, token)


def _cast_dtypes(x: torch.Tensor, send: bool, reduce: bool) -> tuple[torch.dtype, torch.dtype] | None:
    """(dtype ``x`` travels in, dtype its gradient is summed in) under the autocast now on: autocast's low
    dtype where ``send``, bfloat16 where ``reduce`` and autocast's dtype is bfloat16 (:mod:`hidup.precision`),
    ``x``'s dtype otherwise; None where nothing is cast (no autocast, or ``x`` not float32)."""
    low = _low_dtype(x)
    if low is None:
        return None
    dtypes = (low if send else x.dtype, torch.bfloat16 if reduce and low == torch.bfloat16 else x.dtype)
    return None if dtypes == (x.dtype, x.dtype) else dtypes


def hidup_convert_cast(x: torch.Tensor, src: str, dst: str, send: bool = True, reduce: bool = False) -> torch.Tensor:
    """:func:`hidup_convert` of a float32 parameter under autocast (:mod:`hidup.precision`): with ``send``
    (every use casts it to autocast's dtype) its slices travel in that dtype; with ``reduce`` (gradients
    reduced in bf16) its gradient is summed in bfloat16, else in float32."""
    dtypes = _cast_dtypes(x, send, reduce)
    if dtypes is None:
        return hidup_convert(x, src, dst)
    dtype, summed = dtypes
    if torch.compiler.is_compiling():
        world, token = compiled.ACTIVE.world, compiled.ACTIVE.token
        return torch.ops.hidup.convert_cast(x, src, dst, world, token, _dtype_name(dtype), _dtype_name(summed))
    return collectives.convert_cast(x, _form(src), _form(dst), current_group(), dtype, summed)


def hidup_convert_cast_step(
    x: torch.Tensor, axis: int, src: str, dst: str, send: bool = True, reduce: bool = False
) -> torch.Tensor:
    """:func:`hidup_convert_step` of such a parameter (:func:`hidup_convert_cast`)."""
    dtypes = _cast_dtypes(x, send, reduce)
    if dtypes is None:
        return hidup_convert_step(x, axis, src, dst)
    dtype, summed = dtypes
    if torch.compiler.is_compiling():
        world, token = compiled.ACTIVE.axes[axis]
        return torch.ops.hidup.convert_cast(x, src, dst, world, token, _dtype_name(dtype), _dtype_name(summed))
    return collectives.convert_cast(x, _form(src), _form(dst), _axis_group(axis), dtype, summed)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hidup_reshard_convert(x: torch.Tensor, src: str, dst: str, reduce: bool = False, unit: int = -1) -> torch.Tensor:
    """:func:`hidup_convert` of a resharded parameter: its output is not kept for the backward, but
    made again there (:mod:`hidup.codegen.reshard`), ahead of its unit's backward where ``unit`` names
    the program unit that reads it (:mod:`hidup.codegen.prefetch`); with ``reduce`` its gradient is
    summed in bf16 under a bf16 autocast (:func:`hidup_convert_cast`; the copy travels in ``x``'s dtype)."""
    summed = _summed_dtype(x, reduce)
    if torch.compiler.is_compiling():
        return compiled_convert(x, src, dst, compiled.ACTIVE.world, compiled.ACTIVE.token, summed)
    out = _reshard_out(x, src, dst, current_group(), summed)
    return register(out, x, _form(src), _form(dst), current_group(), unit)


# why: the conversion's operands, its bf16 sum and its prefetch unit, as the generated call passes them
def hidup_reshard_convert_step(
    x: torch.Tensor, axis: int, src: str, dst: str, reduce: bool = False, unit: int = -1
) -> torch.Tensor:
    """:func:`hidup_convert_step` of a resharded parameter (:func:`hidup_reshard_convert`)."""
    summed = _summed_dtype(x, reduce)
    if torch.compiler.is_compiling():
        return compiled_convert(x, src, dst, *compiled.ACTIVE.axes[axis], summed)
    out = _reshard_out(x, src, dst, _axis_group(axis), summed)
    return register(out, x, _form(src), _form(dst), _axis_group(axis), unit)


def hidup_begin_forward() -> None:
    """A forward of a program whose resharded copies are made ahead in the backward starts
    (:func:`hidup.codegen.reshard.begin_forward` on the active group; nothing under ``torch.compile``)."""
    if not torch.compiler.is_compiling():
        group = current_group()
        for g in group.axes if isinstance(group, MeshGroups) else (group,):
            begin_forward(g)


prefetch.BEGIN = hidup_begin_forward
prefetch.CAST_DTYPES = _cast_dtypes

# the parameter conversions hidup.codegen.prefetch may issue one unit early (not the kept ones: activations)
prefetch.CONVERTS.update(
    {
        f.__name__: f
        for f in (
            hidup_convert,
            hidup_convert_step,
            hidup_convert_cast,
            hidup_convert_cast_step,
            hidup_reshard_convert,
            hidup_reshard_convert_step,
        )
    }
)


def _summed_dtype(x: torch.Tensor, reduce: bool) -> torch.dtype | None:
    """The dtype ``x``'s gradient is summed in where that is not ``x``'s own (:func:`_cast_dtypes`)."""
    dtypes = _cast_dtypes(x, False, reduce)
    return None if dtypes is None else dtypes[1]


def _reshard_out(x: torch.Tensor, src: str, dst: str, group, summed: torch.dtype | None) -> torch.Tensor:
    if summed is None:
        return collectives.convert(x, _form(src), _form(dst), group)
    return collectives.convert_cast(x, _form(src), _form(dst), group, x.dtype, summed)


def hidup_take_input(x: torch.Tensor, form: str, axis: int | None = None) -> torch.Tensor:
    """This rank's piece of a global input in ``form`` (a slice for gather forms); on a device mesh
    ``axis`` names the mesh axis whose split this is (applied to the piece earlier axes left)."""
    if torch.compiler.is_compiling():
        active = compiled.ACTIVE
        world, token = (active.world, active.token) if axis is None else active.axes[axis]
        return x if not form.startswith("gather") else torch.ops.hidup.convert(x, "full", form, world, token)
    f = _form(form)
    if not f.is_gather:
        return x
    group = current_group() if axis is None else _axis_group(axis)
    return (
        collectives.apply_op("slice", x, FULL, f, group) if not x.requires_grad else collectives.slice(x, f.dim, group)
    )


def hidup_check_local(x: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
    """Fail clearly when a local-batch input does not have its local shape."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"input {name!r}: expected this rank's local piece of shape {tuple(shape)}, got "
            f"{tuple(x.shape)}; the module was compiled with local_batch=True (see "
            f"module.input_forms), pass local_batch=False to give the global batch instead"
        )
    return x


@torch._disable_dynamo  # torch.compiler.disable, importing torch._dynamo (about a second) at the first call only
def hidup_copy_sum(x: torch.Tensor, key: int) -> torch.Tensor:
    """Both duplicated copies' value of tensor ``key`` added, where the copy runner computed it
    (:func:`using_copy_sums`); ``x`` itself otherwise (one copy, or the runner's side pass).  Run
    eagerly under ``torch.compile`` (the sums are run-time state)."""
    sums = getattr(_STATE, "copy_sums", None)
    return sums[key] if sums is not None and key in sums else x


@contextlib.contextmanager
def using_copy_sums(sums: dict[int, torch.Tensor] | None):
    before = getattr(_STATE, "copy_sums", None)
    _STATE.copy_sums = sums
    try:
        yield
    finally:
        _STATE.copy_sums = before


def hidup_tensor_leaves(value: Any) -> tuple:
    """The tensors of a (nested) tuple/list/dict value, in the tracer's order."""
    return tuple(value_leaves(value, torch.Tensor))


class _CallWrapper(nn.Module):
    """Holds a local callable fx cannot name in generated code (a partial, a bound object)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankProgram:
    """The generated program of one rank and what the runtime needs to know about it."""

    gm: torch.fx.GraphModule
    param_shards: dict[str, ParamShard]  # gm attribute path -> logical parameter
    replicated: list[str]  # gm paths of replicate parameters, in order of first use
    input_forms: dict[str, Form | None]  # placeholder -> form (None: not a tensor input)
    input_shapes: dict[str, tuple[int, ...]]  # placeholder -> global shape
    num_stages: int
    mesh: tuple[int, ...] = ()  # the device mesh of a plan on several axes, else ()
    # gm path of each replicated parameter -> the mesh axes its gradient is summed over (on a mesh)
    replicate_axes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # the number of random ops; with any, gm takes the run-time key (hidup.rules.random) as its last input
    random_ops: int = 0
    # gm path of each replicated parameter ZeRO splits -> its stage (hidup.codegen.zero)
    zero: dict[str, int] = dataclasses.field(default_factory=dict)
    # the dtype parameter gradients are summed over ranks in under a bf16 autocast (hidup.precision)
    reduce_dtype: str = "fp32"


def _plain(form: "Form | Layout") -> "Form | Layout":
    """``form`` with ``replicate`` read as ``full``: how a replicated parameter enters a rank program."""
    if isinstance(form, Layout):
        return Layout(tuple(FULL if f.kind == "replicate" else f for f in form.forms))
    return FULL if form.kind == "replicate" else form


def _summed_axes(form: "Form | Layout") -> tuple[int, ...]:
    """The mesh axes over which a parameter stored in layout ``form`` holds partial gradients (those
    that do not split it)."""
    return tuple(k for k, f in enumerate(form.forms) if not f.is_gather)


def _match(node, sig: Signature) -> Signature:
    """The node's own signature equal to ``sig`` up to FLOPs (the plan may come from another batch)."""
    for s in node.signatures:
        if (s.inputs, s.outputs, s.impl, s.params) == (sig.inputs, sig.outputs, sig.impl, sig.params):
            return s
    options = "; ".join(str(s) for s in node.signatures[:6])
    raise CompileError(
        f"plan chooses {sig} for node {node.name} ({node.target}"
        f"{' at ' + node.source if node.source else ''}), which is not one of its signatures "
        f"for this model/batch/world ({options}{' ...' if len(node.signatures) > 6 else ''}). "
        f"Fix: search the plan again for this model, batch and world size"
    )


def _stage_index(plan) -> dict[str, int]:
    out = {}
    for i, stage in enumerate(getattr(plan, "stages", None) or []):
        for name in stage:
            out[name] = i
    return out


def _fix_devices(value, device: torch.device):
    """Devices folded during shape propagation are ``meta``; the program runs on ``device``."""

    def fix(v):
        if isinstance(v, torch.device) and v.type == "meta":
            return device
        return v

    return map_value(value, fix)


class _Builder:
    def __init__(
        self,
        traced,
        plan,
        rank: int,
        world: int,
        device: torch.device,
        local_batch: bool,
        copies=None,
        recompute=(),
        reshard=(),
        selective=(),
        zero=None,
        reduce_dtype: str = "fp32",
        prefetch=True,
    ):
        self.traced, self.plan, self.rank, self.world = traced, plan, rank, world
        self.reduce_dtype = reduce_dtype  # the dtype parameter gradients are summed in (hidup.precision)
        # params whose gradient reductions cast to bf16 under a bf16 autocast
        self.reduce_low = reduce_low_params(traced.graph) if reduce_dtype == "bf16" else frozenset()
        self.prefetch = prefetch  # issue stored-split parameters' gathers one unit early (codegen.prefetch)
        self.zero = dict(zero or {})  # param node -> ZeRO stage asked for (hidup.codegen.zero)
        self.param_node: dict[str, str] = {}  # stored attribute -> its param node
        self.reshard = frozenset(reshard)  # param nodes whose converted copies are made again in the backward
        self.reshard_tids: set[int] = set()
        self.wire_low = wire_low_params(traced.graph)  # params sent in autocast's dtype (hidup.precision)
        self.gathered: set[torch.fx.Node] = set()  # converted copies of resharded parameters, and views of them
        self.n_reshard = 0
        self.recompute = frozenset(recompute)  # block labels whose forward runs again in the backward
        self.selective = frozenset(selective)  # of those, the ones recomputed selectively
        self.region = None  # the recomputation region new nodes join (codegen.recompute)
        self.layer = ""  # the repeated layer (ir.block_label) of the plan node being generated; "" outside one
        self.copies = copies  # hidup.copies.CopyAxis of a duplicated copy's program, else None
        self.device, self.local_batch = device, local_batch
        self.graph = torch.fx.Graph()
        self.root = nn.Module()
        self.local: dict[int, torch.fx.Node] = {}
        self.lazy_params: dict[int, str] = {}  # tid -> stored attribute, get_attr created on first use
        self.produced: dict[int, Form] = {}
        self.converted: dict[tuple[int, Form], torch.fx.Node] = {}
        self.shards: dict[str, ParamShard] = {}
        self.replicated: list[str] = []
        self.stored: dict[str, torch.Tensor] = {}  # attribute -> stored tensor
        self.input_forms: dict[str, Form | None] = {}
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        self.stage_of = _stage_index(plan)
        self.stage = 0
        mesh = tuple(traced.graph.mesh)
        self.mesh = mesh if len(mesh) > 1 else None  # a device mesh of several axes (codegen.mesh)
        self.coords = coordinates(rank, mesh) if self.mesh else None
        self.replicate_axes: dict[str, tuple[int, ...]] = {}
        self.plan_steps = {
            (c.tensor, _plain(c.dst)): c.steps for c in (getattr(plan, "conversions", None) or []) if c.steps
        }
        self.n_wrappers = 0
        self.fx_nodes: dict[str, torch.fx.Node] = {}
        self.random_ops = 0  # random ops numbered so far (hidup.rules.random)
        self.rng_key: torch.fx.Node | None = None  # the placeholder of the run-time key, made on first use

    # -- node creation (every node is tagged with the current stage)
    def _tag(self, node: torch.fx.Node) -> torch.fx.Node:
        node.meta["stage"] = self.stage
        node.meta[REGION] = self.region
        node.meta[compiled.LAYER] = self.layer
        return node

    def call(self, target, args, kwargs=None, name=None) -> torch.fx.Node:
        kwargs = kwargs or {}
        if isinstance(target, str):
            node = self.graph.call_method(target, tuple(args), kwargs)
        else:
            try:
                _get_qualified_name(target)
                node = self.graph.call_function(target, tuple(args), kwargs)
            except (AttributeError, RuntimeError):  # a callable generated code cannot name: called from a module
                path = f"fn_{self.n_wrappers}"
                self.n_wrappers += 1
                self.root.add_module(path, _CallWrapper(target))
                node = self.graph.call_module(path, tuple(args), kwargs)
        if name is not None:
            node.name = self.graph._graph_namespace.create_name(name, node)
        return self._tag(node)

    def choice(self, node) -> Signature:
        choices = self.plan.choices
        if node.name not in choices:
            if node.op == "output":
                return Signature((REDUCE,), ())
            raise CompileError(
                f"plan has no choice for node {node.name} ({node.op} {node.target}); "
                f"was it searched for this model? Fix: search again"
            )
        return _match(node, choices[node.name]) if node.op != "output" else choices[node.name]

    # -- values
    def value(self, tid: int) -> torch.fx.Node:
        if tid not in self.local:
            attr = self.lazy_params.get(tid)
            if attr is None:
                raise CompileError(f"tensor {tid} is read before it is produced")
            self.local[tid] = self._tag(self.graph.get_attr(attr))
        return self.local[tid]

    def value_in(self, tid: int, dst: "Form | Layout") -> torch.fx.Node:
        dst = _plain(dst)
        src = self.produced[tid]
        if src == dst:
            return self.value(tid)
        key = (tid, dst)
        if tid in self.traced.written:  # written through a view after it was made: convert what it holds now
            self.converted.pop(key, None)
        reshard = tid in self.reshard_tids and self.region is None  # a recomputed layer makes it again anyway
        if key not in self.converted and isinstance(dst, Layout):
            node = self.value(tid)
            # a replicated parameter's replicate -> full step is the identity here
            changes = [(axis, a, b) for axis, a, b in self._mesh_steps(tid, src, dst) if a != b]
            steps = [(axis, a, b, collectives.conversion(a, b)) for axis, a, b in changes]
            cast = not reshard and tid in self.wire_low and casts_on_wire(c.forward for *_, c in steps)
            for axis, a, b, conv in steps:
                step = hidup_reshard_convert_step if reshard else hidup_convert_step
                args = (node, axis, str(a), str(b))
                if self._kept(tid):
                    step = hidup_convert_kept_step
                send, summed = cast and is_collective(conv.forward), self._reduces_low(tid, conv)
                if reshard and summed:
                    args += (True,)
                elif send or summed:
                    step, args = hidup_convert_cast_step, args + (send, summed)
                node = self.call(step, args)
                if reshard:
                    self.gathered.add(node)
            self.converted[key] = node
        if key not in self.converted:
            if collectives.conversion(src, dst) is None:
                raise CompileError(
                    f"tensor {tid} ({self.traced.graph.tensors[tid].producer}) is produced as {src} "
                    f"but a consumer needs {dst}; no conversion exists"
                )
            convert = hidup_reshard_convert if reshard else hidup_convert
            conv = collectives.conversion(src, dst)
            args = (self.value(tid), str(src), str(dst))
            send = not reshard and tid in self.wire_low and casts_on_wire([conv.forward])
            summed = self._reduces_low(tid, conv)
            if reshard and summed:
                args += (True,)
            elif send or summed:
                convert, args = hidup_convert_cast, args + (send, summed)
            elif self._kept(tid):
                convert = hidup_convert_kept
            self.converted[key] = self.call(convert, args)
            if reshard:
                self.gathered.add(self.converted[key])
        return self.converted[key]

    def _reduces_low(self, tid: int, conv) -> bool:
        """Whether the backward of form change ``conv`` of tensor ``tid`` sums a float32 parameter's
        gradient that the plan reduces in bf16 (:mod:`hidup.precision`)."""
        return tid in self.reduce_low and is_reduction(conv.backward)

    def _kept(self, tid: int) -> bool:
        """Whether a form change of tensor ``tid`` made here is saved by a selective region: an
        activation's inside a selectively recomputed layer (a parameter's is gathered again,
        :mod:`hidup.codegen.recompute`)."""
        return self.region is not None and self.region.selective and not self.traced.graph.tensors[tid].is_param

    def _mesh_steps(self, tid: int, src: Layout, dst: Layout) -> list[tuple[int, Form, Form]]:
        """The one-axis steps ``(axis, form before, form after)`` that turn ``src`` into ``dst``: the
        ones the plan chose for this tensor and layout, else the path of
        :func:`hidup.ir.layout_conversions` with the fewest collectives."""
        steps = self.plan_steps.get((tid, dst))
        if steps:
            chain = [(s.axis, _plain(s.before), _plain(s.after)) for s in steps]
            valid = chain[0][1] == src and chain[-1][2] == dst
            valid = valid and all(a[2] == b[1] for a, b in zip(chain, chain[1:]))
            valid = valid and all(before.with_axis(axis, after.forms[axis]) == after for axis, before, after in chain)
            if valid:
                return [(axis, before.forms[axis], after.forms[axis]) for axis, before, after in chain]
        paths = layout_conversions(src, dst)
        if not paths:
            raise CompileError(
                f"tensor {tid} ({self.traced.graph.tensors[tid].producer}) is produced as {src} "
                f"but a consumer needs {dst}; no layout change exists"
            )

        def collectives_of(path) -> int:
            return sum(bool(c) for s in path.steps for c in s.conv.collectives)

        best = min(paths, key=collectives_of)
        return [(s.axis, s.before.forms[s.axis], s.after.forms[s.axis]) for s in best.steps]

    # -- IR nodes
    def add_input(self, node, sig: Signature, placeholder: torch.fx.Node) -> None:
        form = sig.outputs[0]
        tid = node.outputs[0]
        shape = self.traced.graph.tensors[tid].shape
        self.input_forms[node.name], self.input_shapes[node.name] = form, shape
        if self.local_batch:
            local = form.local_shape(shape, self.mesh or self.world)
            value = self.call(hidup_check_local, (placeholder, local, node.name))
        elif isinstance(form, Layout):
            value = placeholder
            for axis, f in enumerate(form.forms):  # axis 0's split first, then axis 1's of that piece
                if f.is_gather:
                    value = self.call(hidup_take_input, (value, str(f), axis))
        elif form.is_gather:
            value = self.call(hidup_take_input, (placeholder, str(form)))
        else:
            value = placeholder
        self.local[tid] = value
        self.produced[tid] = form

    def add_param(self, node, sig: Signature) -> None:
        form = sig.outputs[0]
        tid = node.outputs[0]
        logical = self.traced.param_names.get(node.name)
        if logical is None:
            raise CompileError(f"param node {node.name} has no parameter name in the trace")
        original = (
            self.traced.gm.get_parameter(logical)
            if node.target == "parameter"
            else operator.attrgetter(logical)(self.traced.gm)
        )
        if any(f.kind == "reduce" for f in axis_forms(form)):
            raise CompileError(
                f"plan stores parameter {logical} in form {form}; parameters are stored "
                f"replicate or gather_d. Fix: search again"
            )
        data = shard_tensor(original.detach(), form, self.rank, self.world, self.mesh).to(self.device).clone()
        attr = local_name(logical)
        if isinstance(original, nn.Parameter):
            stored = nn.Parameter(data, requires_grad=original.requires_grad)
            self.root.register_parameter(attr, stored)
            if isinstance(form, Layout):
                if _summed_axes(form) and stored.requires_grad:
                    self.replicated.append(attr)
                    self.replicate_axes[attr] = _summed_axes(form)
            elif not form.is_gather and stored.requires_grad:
                self.replicated.append(attr)
        else:
            self.root.register_buffer(attr, data)
            stored = data
        self.stored[attr] = stored
        self.param_node[attr] = node.name
        self.shards[attr] = ParamShard(logical, tuple(original.shape), form, not isinstance(original, nn.Parameter))
        self.lazy_params[tid] = attr
        self.produced[tid] = _plain(form) if isinstance(form, Layout) else form if form.is_gather else FULL
        if node.name in self.reshard and any(f.is_gather for f in axis_forms(form)):
            self.reshard_tids.add(tid)

    def add_call(self, node, sig: Signature) -> None:
        ctx = self.traced.contexts[node.name]
        n_arg = _count_meta(ctx.args) + _count_meta(ctx.kwargs)
        inputs = [self.value_in(tid, form) for tid, form in zip(node.inputs[:n_arg], sig.inputs[:n_arg])]
        if self.mesh is None:
            call = rules.localize(ctx.with_tensors(inputs), sig, self.rank)
        elif sig.axes:
            call = localize_mesh(ctx, sig, self.coords, self.mesh, rules.localize, inputs)
        else:
            raise CompileError(
                f"node {node.name}: the plan's signature {sig} has no per-axis factors for the mesh "
                f"{self.mesh}. Fix: trace and search again for this mesh"
            )
        if random.is_random_call(call):
            call = self._random(node, call)
        args, kwargs = _fix_devices(tuple(call.args), self.device), _fix_devices(dict(call.kwargs), self.device)
        reads = set(value_leaves((args, kwargs), torch.fx.Node)) & self.gathered
        if reads and self.region is None:  # it reads a resharded parameter's copy: keep a handle, not the copy
            out = self._reshard_call(rules.kernel_of(call.target), args, kwargs, node.name)
            name = call.target if isinstance(call.target, str) else getattr(call.target, "__name__", "")
            if name in VIEW_NAMES:
                self.gathered.add(out)
        else:
            out = self.call(rules.kernel_of(call.target), args, kwargs, name=node.name)
        if len(node.outputs) == 1 and not self._structured(node.name):
            self.local[node.outputs[0]] = out
        else:
            leaves = self.call(hidup_tensor_leaves, (out,))
            for j, tid in enumerate(node.outputs):
                self.local[tid] = self._tag(self.graph.call_function(_getitem, (leaves, j)))
        for tid, form in zip(node.outputs, sig.outputs):
            self.produced[tid] = form
        if self.copies is not None:  # one copy of two: halve its means over the batch, sum counts across copies
            for tid in node.outputs:
                if node.name in self.copies.scaled:
                    self.local[tid] = self.call(operator.mul, (self.local[tid], self.copies.scaled[node.name]))
                if tid in self.copies.summed:  # run-time state: never recomputed
                    region, self.region = self.region, None
                    self.local[tid] = self.call(hidup_copy_sum, (self.local[tid], tid))
                    self.region = region

    def _random(self, node, call):
        """A random op bound to this program: its number in the step, the run-time key, and in a
        duplicated copy the dim its copy axis splits (hidup.rules.random)."""
        if self.rng_key is None:
            last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
            with self.graph.inserting_after(last):  # the last input, defaulted as the inputs before it may be
                self.rng_key = self.graph.placeholder(RNG_KEY_INPUT, default_value=None)
            self.rng_key.meta.update({"stage": 0, REGION: None, compiled.LAYER: ""})
        copy_form = self.copies.forms.get(node.outputs[0]) if self.copies is not None else None
        copy_dim = copy_form.dim if copy_form is not None and copy_form.is_gather else None
        op, self.random_ops = self.random_ops, self.random_ops + 1
        return random.bind_program(call, op=op, key=self.rng_key, copy_dim=copy_dim, blocks=self.world)

    def _reshard_call(self, target, args, kwargs, name: str) -> torch.fx.Node:
        path = f"reshard_{self.n_reshard}"
        self.n_reshard += 1
        self.root.add_module(path, ReshardCall(target))
        node = self.graph.call_module(path, tuple(args), kwargs)
        node.name = self.graph._graph_namespace.create_name(name, node)
        return self._tag(node)

    def _structured(self, name: str) -> bool:
        """Whether the traced value of fx node ``name`` is a tuple/list the model indexes into."""
        fx_node = self.fx_nodes[name]
        return any(u.name in self.traced.tensor_ids and u.name not in self.traced.contexts for u in fx_node.users)

    def add_output(self, node) -> None:
        # every rank's loss a partial sum over every axis: the backward seed 1 is then exact
        loss = self.value_in(node.inputs[0], Layout((REDUCE,) * len(self.mesh)) if self.mesh else REDUCE)
        self.graph.output(loss)

    def build(self) -> RankProgram:
        ir = self.traced.graph
        placeholders = {}
        tensor_inputs = {x.name for x in ir.nodes if x.op == "input"}
        for n in self.traced.gm.graph.nodes:
            self.fx_nodes[n.name] = n
            if n.op == "placeholder":
                default = inspect.Signature.empty if n.name in tensor_inputs else None
                placeholders[n.name] = self._tag(self.graph.placeholder(n.name, default_value=default))
                self.input_forms.setdefault(n.name, None)
        for node in ir.nodes:
            if node.op == "call":  # keep stages monotone; an input or a parameter joins the stage it is in:
                # the plan files it under its first consumer's stage, which the trace may reach much later
                # (the labels feed the loss), and jumping there would put the whole step in one stage
                self.stage = max(self.stage, self.stage_of.get(node.name, self.stage))
            sig = self.choice(node)
            if node.op == "input":
                self.add_input(node, sig, placeholders[node.name])
            elif node.op == "param":
                self.add_param(node, sig)
            elif node.op == "call":
                label = block_label(node.module)
                # duplication interleaves its copies stage by stage: a region must not span stages
                stage = self.stage if self.copies is not None else 0
                self.region = RegionKey(label, stage, label in self.selective) if label in self.recompute else None
                self.layer = label
                self.add_call(node, sig)
                self.region, self.layer = None, ""
            elif node.op == "output":
                self.add_output(node)
            else:
                raise CompileError(f"node {node.name}: unknown op {node.op!r}")
        if self.prefetch:
            prefetch.prefetch_gathers(self.graph)
        outline_regions(self.graph, self.root)
        self.graph.lint()
        gm = torch.fx.GraphModule(self.root, self.graph, class_name=f"Rank{self.rank}Of{self.world}")
        # GraphModule copies only what the graph references.
        paths = {
            id(t): p
            for p, t in list(gm.named_parameters(remove_duplicate=False))
            + list(gm.named_buffers(remove_duplicate=False))
        }
        shards, replicated, replicate_axes, shapes = {}, [], {}, {}
        for attr, shard in self.shards.items():
            path = paths.get(id(self.stored[attr]))
            if path is None:
                continue  # a parameter the traced step never reads
            shards[path] = shard
            if attr in self.replicated:
                replicated.append(path)
                shapes[self.param_node[attr]] = (path, tuple(self.stored[attr].shape))
                if attr in self.replicate_axes:
                    replicate_axes[path] = self.replicate_axes[attr]
        split = zero_stages(self.zero, {name: shape for name, (_, shape) in shapes.items()}, self.world)
        return RankProgram(
            gm,
            shards,
            replicated,
            self.input_forms,
            self.input_shapes,
            max(1, len(getattr(self.plan, "stages", None) or [])),
            self.mesh or (),
            replicate_axes,
            self.random_ops,
            {shapes[name][0]: stage for name, stage in split.items()},
            self.reduce_dtype,
        )


def _getitem(seq, i):
    return seq[i]


def _count_meta(value) -> int:
    return len(value_leaves(value, TensorMeta))


def build_rank_program(traced, plan, rank: int, world: int, copies=None, options=None) -> RankProgram:
    """The program rank ``rank`` of ``world`` runs for ``traced`` (a :class:`hidup.frontend.trace.Traced`)
    under ``plan``; parameters are copied (sharded) from the traced model onto ``options.device``
    (a :class:`hidup.codegen.rewrite.CompileOptions`; None: the defaults, on the CPU).  With
    ``copies`` (a :class:`hidup.copies.CopyAxis` of ``traced``, the step at half the batch) the program
    is one of duplication's two copies: its means over the batch are halved and the tensors in
    ``copies.summed`` pass through :func:`hidup_copy_sum`.  The layers named in ``options.recompute``
    (block labels; None: the plan's ``recompute``) run their forward again in the backward, those in
    ``options.recompute_selective`` (None: the plan's) all but their saved ops
    (:mod:`hidup.codegen.recompute`).  The parameters named in ``options.reshard`` (``param`` node
    names; None: the plan's ``reshard``; True: every parameter the plan stores split) have their
    converted copies made again in the backward instead of kept (:mod:`hidup.codegen.reshard`).
    ``options.zero`` (None: the plan's ``zero``; 0, 1 or 2: that ZeRO stage for every replicated
    parameter; a dict of ``param`` node names) says which replicated parameters the runtime splits
    (:mod:`hidup.codegen.zero`, ``RankProgram.zero``).  ``options.reduce_dtype`` (None: the plan's
    ``reduce_dtype``) is the dtype the float32 parameters' gradients are summed in under a bf16 autocast
    (:mod:`hidup.precision`, ``RankProgram.reduce_dtype``).  ``options.prefetch`` (None: the plan's
    ``options["prefetch"]``, on where the plan does not say) issues the gathers of stored-split parameters
    one unit early (:mod:`hidup.codegen.prefetch`)."""
    device = getattr(options, "device", None) or "cpu"
    local_batch = bool(getattr(options, "local_batch", False))
    reshard = getattr(options, "reshard", None)
    if traced.graph.world_size != world:
        raise CompileError(f"the model was traced for world size {traced.graph.world_size}, not {world}")
    if not 0 <= rank < world:
        raise CompileError(f"rank {rank} is outside world size {world}")
    plan_mesh = tuple(getattr(plan, "mesh", None) or ())
    graph_mesh = tuple(traced.graph.mesh) if len(traced.graph.mesh) > 1 else ()
    if plan_mesh != graph_mesh and (len(plan_mesh) > 1 or graph_mesh):
        raise CompileError(
            f"the plan was searched for the device mesh {plan_mesh or (world,)} but the model was traced for "
            f"{graph_mesh or (world,)}. Fix: trace with mesh={plan_mesh or None} (hidup.compile does it from the plan)"
        )
    labels, selective = _recomputed_layers(traced, plan, options)
    params = {n.name for n in traced.graph.nodes if n.op == "param"}
    if reshard is None:
        reshard = getattr(plan, "reshard", None) or ()
    elif reshard is True:
        reshard = params
    elif reshard is False:
        reshard = ()
    unknown = sorted(set(reshard) - params)
    if unknown:
        raise CompileError(
            f"reshard names parameters the model does not have: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}. Fix: name param nodes of the trace (the plan's choices), "
            "or search again"
        )
    zero = _zero_request(traced, plan, getattr(options, "zero", None), params)
    reduce_dtype = getattr(options, "reduce_dtype", None) or getattr(plan, "reduce_dtype", "fp32")
    if reduce_dtype not in REDUCE_DTYPES:
        raise CompileError(
            f"reduce_dtype={reduce_dtype!r}: give one of {', '.join(REDUCE_DTYPES)}, or None (the plan's)"
        )
    return _Builder(
        traced,
        plan,
        rank,
        world,
        torch.device(device),
        local_batch,
        copies,
        labels | selective,
        reshard,
        selective,
        zero,
        reduce_dtype,
        _prefetching(plan, options),
    ).build()


def _prefetching(plan, options) -> bool:
    """``options.prefetch``, or where it is None the plan's (the option it was searched with; default on)."""
    prefetch = getattr(options, "prefetch", None)
    if prefetch is None:
        prefetch = (getattr(plan, "options", None) or {}).get("prefetch", True)
    return bool(prefetch)


def _zero_request(traced, plan, zero, params: set[str]) -> dict[str, int]:
    """The ZeRO stage asked for each parameter (``param`` node name): ``zero`` None reads the plan's
    ``zero``, 0 none, 1 or 2 that stage for every parameter, a dict names them (the program splits those
    stored replicate whose rows the world divides, :func:`hidup.codegen.zero.zero_stages`).  A plan on a
    device mesh takes none."""
    if zero is None:
        zero = dict(getattr(plan, "zero", None) or {})
    elif zero in (0, 1, 2) and not isinstance(zero, bool):
        zero = dict.fromkeys(params, zero) if zero else {}
    elif not isinstance(zero, dict):
        raise CompileError(f"zero={zero!r}: give 0, 1 or 2 (every replicated parameter), a dict, or None (the plan's)")
    unknown = sorted(set(zero) - params)
    if unknown:
        raise CompileError(
            f"zero names parameters the model does not have: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}. Fix: name param nodes of the trace (the plan's choices), "
            "or search again"
        )
    if zero and len(traced.graph.mesh) > 1:
        raise CompileError(
            f"ZeRO splits a replicated parameter over the ranks of one axis; this plan is on the device mesh "
            f"{tuple(traced.graph.mesh)}, where it is not supported yet. Fix: search with --zero off (zero=0), "
            "or a plan of one axis"
        )
    return zero


def _recomputed_layers(traced, plan, options) -> tuple[frozenset[str], frozenset[str]]:
    """(layers recomputed whole, layers recomputed selectively) of ``options.recompute`` and
    ``options.recompute_selective`` (None: the plan's), checked against the model's repeated layers."""
    whole, selective = getattr(options, "recompute", None), getattr(options, "recompute_selective", None)
    whole = frozenset(getattr(plan, "recompute", None) or () if whole is None else whole)
    selective = frozenset(getattr(plan, "recompute_selective", None) or () if selective is None else selective)
    known = {block_label(n.module) for n in traced.graph.nodes} - {""}
    for what, labels in (("recompute", whole), ("recompute_selective", selective)):
        unknown = sorted(labels - known)
        if unknown:
            raise CompileError(
                f"{what} names layers the model does not have: {', '.join(unknown[:5])}"
                f"{' ...' if len(unknown) > 5 else ''} (its repeated layers: "
                f"{', '.join(sorted(known)[:5]) or 'none'}{' ...' if len(known) > 5 else ''}). "
                "Fix: name repeated layers as the plan's `layers` report does, or search again"
            )
    both = sorted(whole & selective)
    if both:
        raise CompileError(
            f"layers recomputed both whole and selectively: {', '.join(both[:5])}. Fix: name each layer in "
            "one of recompute and recompute_selective"
        )
    return whole, selective
