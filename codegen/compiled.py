"""Inductor-compiled rank programs: the collectives as ``torch.library`` custom ops.

A rank program (:mod:`hidup.codegen.program`) is straight-line fx code of ATen-level ops with form
conversions (:func:`hidup.codegen.program.hidup_convert`) between them.  ``torch.compile`` of it
(``hidup.compile(..., compile=True)``, ``hidup train --compile``) must not trace into the
collectives: they are Python that talks to a process group, and their backward is the conjugate
collective of the gradient convention (:mod:`hidup.codegen.collectives`).  So, under compilation
only, a conversion is one opaque custom op

    hidup::convert(Tensor x, str src, str dst, int world, Tensor group) -> Tensor

whose eager kernel is exactly the eager path's forward (:func:`hidup.codegen.collectives.apply_op`
of :func:`hidup.ir.conversion`'s forward op, on the process group ``group`` names), whose fake
kernel gives the output shape on ``world`` ranks (``gather_d -> full`` multiplies dim ``d`` by N,
``full -> gather_d`` and ``reduce -> gather_d`` divide it, an all-to-all ``gather_a -> gather_b``
does both, the others keep the shape; outputs are contiguous and never alias the input), and whose
autograd formula is the op ``hidup::convert_backward`` running the conversion's backward op on the
same group -- the adjoint table of :class:`hidup.codegen.collectives._Convert`.  Dynamo therefore
sees no graph break at a collective: inductor compiles the whole forward, AOTAutograd the whole
backward, and the collectives run between the fused kernels exactly as eagerly (the same values in
the same order), so parity is that of the eager program up to the rounding of the fused kernels.  Every rank compiles
a graph of the same structure (programs differ between ranks only in constants), and inductor orders
extern ops such as these the same way on every rank (its compute/communication reordering passes are
off by default), so the ranks issue their collectives in the same order.

Prefetched weight gathers are the exception (:mod:`hidup.codegen.prefetch`): issued a unit early as
torch's functional all-gather (:func:`gather_start`) and waited for at the consumer
(:func:`gather_wait`), they overlap the compute between; a graph that has them is compiled with
inductor's ``sink_waits`` pass (:data:`SINK_WAITS`), which schedules each wait as late as its readers
allow and reorders nothing by measured times, so every rank still makes the same schedule.  Their
gradients' reduce-scatters are issued the same way in the backward (:class:`_GatherStart`): the wait,
and the cast and gradient accumulation that read it, sink past the rest of that graph's backward,
which the reduce-scatter overlaps as FSDP2's does on its own stream.  What that holds: a weight's
gradient in the dtype it is summed in, from the end of its reader's backward to the end of the graph,
where its gathered copy (held from the forward to the end of that backward, in the dtype it travelled
in) is no longer held; so no more bytes than the copy's at a time, where the gradient is summed in the
dtype the weight travelled in (bf16 with ``reduce_dtype="bf16"``), twice as many where a bf16 copy's
gradient is summed in float32.

Why custom ops rather than compiling the regions between collectives: one graph per program (per
stage with duplication) lets inductor fuse across what would otherwise be a dozen small regions,
and dynamo dispatches one compiled function instead of one per region; the collectives remain the
eager ones, so nothing about their numerics, streams or process groups changes.

Process groups are not values a graph can hold, so each has an integer key (:func:`group_key`)
and a *token*, a CPU int64 scalar holding the key.  :func:`hidup.codegen.program.using_group` makes
the active group's token :data:`ACTIVE`'s, the compiled conversion reads it as a graph *input* (a
tensor, so dynamo does not specialize on its value) and the op's kernel looks the group up from it;
the autograd formula saves the token, so the backward -- which autograd may run on another thread,
after the forward's ``using_group`` has ended, interleaving duplication's two copies -- runs on the
group of its own forward.  Duplication's two copies, on two process groups, thus share one compiled
graph per stage.

Duplication keeps its structure: :class:`hidup.codegen.duplicate.StagedCopies` compiles each stage
submodule on its own, so stage ``s`` of copy 0 and of copy 1 still run on their two streams in
lockstep, each launching its own compiled kernels and collectives.  Within one compiled graph the
gradients of all its parameters are produced together at the end of its backward, so the gradient
buckets of replicated parameters (:mod:`hidup.codegen.grads`) could launch only after that graph's
backward.  Without duplication the program is therefore compiled in segments of at least one gradient
bucket each, cut at layer boundaries (:func:`bucket_segments`, :func:`compile_segments`): a segment's
backward ends, its buckets are all-reduced while the earlier segments' backward runs.  With
duplication the stages play that part.  ``hidup train --compile auto`` times the compiled program
against the eager one and keeps the faster.

The values :func:`hidup.codegen.program.hidup_copy_sum` adds across the two copies come from a
side pass at run time, so that call is left to eager Python (a graph break in the one stage that
has it, for masked-mean losses only).  Compilation goes through torch's own caches (FX graph and
autotuning caches, on disk by default), so a second run of the same program compiles much faster.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx
from torch.fx.passes.split_module import split_module

from hidup.codegen import collectives
from hidup.ir import FORM_CHANGE_OPS, Form, conversion, graph_segments

LAYER = "layer"  # node.meta key: the repeated layer (hidup.ir.block_label) a generated node belongs to, "" if none

__all__ = [
    "LAYER",
    "group_key",
    "group_of",
    "ACTIVE",
    "backend_of",
    "compile_module",
    "bucket_segments",
    "compile_segments",
    "gather_start",
    "gather_wait",
    "gathers_async",
]

# Process groups named by integer keys (key 0: the default group, ``None``); each key also has a
# CPU int64 scalar holding it (its *token*), which compiled graphs take as an input.
_GROUPS: dict[int, object] = {0: None}
_KEYS: dict[int, int] = {id(None): 0}
_TOKENS: dict[int, torch.Tensor] = {0: torch.zeros((), dtype=torch.int64)}


class _Active:
    """The process group the generated code currently communicates on: its key, its token and its
    number of ranks; on a device mesh also ``axes[k]``, the (ranks, token) of mesh axis ``k``'s group
    (:mod:`hidup.codegen.mesh`), and ``axis_keys`` their keys."""

    key: int = 0
    token: torch.Tensor = _TOKENS[0]
    world: int = 1
    name: str = ""  # the group's name, which torch's functional collectives take (gather_start)
    axes: tuple = ()
    axis_keys: tuple = ()
    axis_names: tuple = ()

    def set(self, key: int, axis_keys: tuple = ()) -> None:
        self.key, self.token, self.world = key, _TOKENS[key], world_of_key(key)
        self.name = name_of_key(key)
        self.axis_keys = tuple(axis_keys)
        self.axes = tuple((world_of_key(k), _TOKENS[k]) for k in self.axis_keys)
        self.axis_names = tuple(name_of_key(k) for k in self.axis_keys)


ACTIVE = _Active()


def group_key(group) -> int:
    """A stable integer naming ``group`` in compiled graphs (the group is kept alive)."""
    key = _KEYS.get(id(group))
    if key is None or _GROUPS.get(key) is not group:
        key = len(_GROUPS)
        _GROUPS[key] = group
        _KEYS[id(group)] = key
        _TOKENS[key] = torch.tensor(key, dtype=torch.int64)
    return key


def group_of(key) -> object:
    """The process group registered under ``key`` (an int or its token)."""
    return _GROUPS[int(key)]


def world_of_key(key: int) -> int:
    """Ranks of the group registered under ``key`` (asked each time: the default group may be
    destroyed and created again with another size)."""
    return collectives.world_of(_GROUPS[key])


def name_of_key(key: int) -> str:
    """The name of the group registered under ``key`` (the default group's for key 0), as torch's
    functional collectives take it; "" with no process group, and on torch's fake process group (one
    device standing in for a rank, whose collectives hidup mirrors: :mod:`hidup.codegen.collectives`)."""
    if not dist.is_available() or not dist.is_initialized():
        return ""
    group = _GROUPS[key] if _GROUPS[key] is not None else dist.group.WORLD
    return "" if collectives._backend(group) == "fake" else group.group_name


def _contiguous_new(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` as a contiguous tensor that does not alias ``x`` (a custom op may not return an alias)."""
    out = out.contiguous()
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return out.clone(memory_format=torch.contiguous_format)
    return out


def _backward_op(src: Form, dst: Form) -> str:
    return conversion(src, dst).backward


def _shape_after(op: str, shape: list[int], frm: Form, to: Form, n: int) -> list[int]:
    """The local shape after form-change op ``op`` (its ``resizes`` in :data:`hidup.ir.FORM_CHANGE_OPS`)."""
    shape = list(shape)
    if op == "grad_sync":  # the local op of a replicated parameter's backward (to -> frm forward)
        op = conversion(to, frm).backward_local
    resizes = FORM_CHANGE_OPS[op].resizes
    if n == 1 or not resizes or (resizes == "move" and frm.dim == to.dim):
        return shape
    if resizes in ("join_src", "move"):
        shape[frm.dim] *= n
    if resizes in ("split_dst", "move"):
        shape[to.dim] //= n
    return shape


@torch.library.custom_op("hidup::convert", mutates_args=())
def convert(x: torch.Tensor, src: str, dst: str, world: int, group: torch.Tensor) -> torch.Tensor:
    """This rank's piece in form ``dst`` of ``x`` (its piece in form ``src``), on the group of ``world``
    ranks whose token is ``group``."""
    return _converted(x, src, dst, group)


def _converted(x: torch.Tensor, src: str, dst: str, group: torch.Tensor) -> torch.Tensor:
    frm, to = Form.parse(src), Form.parse(dst)
    op = conversion(frm, to).forward
    return _contiguous_new(collectives.apply_op(op, x, frm, to, group_of(group)), x)


@convert.register_fake
def _convert_fake(x, src, dst, world, group):
    frm, to = Form.parse(src), Form.parse(dst)
    return x.new_empty(_shape_after(conversion(frm, to).forward, list(x.shape), frm, to, world))


@torch.library.custom_op("hidup::convert_backward", mutates_args=())
def convert_backward(grad: torch.Tensor, src: str, dst: str, world: int, group: torch.Tensor) -> torch.Tensor:
    """The gradient in form ``src`` of a conversion ``src -> dst`` whose output gradient is ``grad``."""
    frm, to = Form.parse(src), Form.parse(dst)
    return _contiguous_new(collectives.apply_op(_backward_op(frm, to), grad, to, frm, group_of(group)), grad)


@convert_backward.register_fake
def _(grad, src, dst, world, group):
    frm, to = Form.parse(src), Form.parse(dst)
    return grad.new_empty(_shape_after(_backward_op(frm, to), list(grad.shape), to, frm, world))


def _setup_context(ctx, inputs, output):
    _, ctx.src, ctx.dst, ctx.world, group = inputs
    ctx.save_for_backward(group)


def _convert_grad(ctx, grad):
    (group,) = ctx.saved_tensors
    return torch.ops.hidup.convert_backward(grad, ctx.src, ctx.dst, ctx.world, group), None, None, None, None


convert.register_autograd(_convert_grad, setup_context=_setup_context)


@torch.library.custom_op("hidup::convert_kept", mutates_args=())
def convert_kept(x: torch.Tensor, src: str, dst: str, world: int, group: torch.Tensor) -> torch.Tensor:
    """:func:`convert` of an activation inside a selectively recomputed layer, eager and compiled: the
    same kernel, shape and gradient, under a name of its own, which selective recomputation's policy
    saves (:mod:`hidup.codegen.recompute`), so the backward runs no collective to make it again."""
    return _converted(x, src, dst, group)


convert_kept.register_fake(_convert_fake)
convert_kept.register_autograd(_convert_grad, setup_context=_setup_context)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# why: the custom op's schema: convert's five arguments and the two dtypes
@torch.library.custom_op("hidup::convert_cast", mutates_args=())
def convert_cast(
    x: torch.Tensor, src: str, dst: str, world: int, group: torch.Tensor, dtype: str, reduce: str
) -> torch.Tensor:
    """:func:`convert` of ``x.to(dtype)``: the data travels in ``dtype``; the backward reduces in
    ``reduce`` and returns ``x``'s dtype (:func:`hidup.codegen.collectives.convert_cast`)."""
    frm, to = Form.parse(src), Form.parse(dst)
    op = conversion(frm, to).forward
    return _contiguous_new(collectives.apply_op(op, x.to(_DTYPES[dtype]), frm, to, group_of(group)), x)


@convert_cast.register_fake
def _(x, src, dst, world, group, dtype, reduce):
    frm, to = Form.parse(src), Form.parse(dst)
    shape = _shape_after(conversion(frm, to).forward, list(x.shape), frm, to, world)
    return x.new_empty(shape, dtype=_DTYPES[dtype])


def _setup_cast_context(ctx, inputs, output):
    x, ctx.src, ctx.dst, ctx.world, group, _, reduce = inputs
    ctx.x_dtype, ctx.reduce = x.dtype, _DTYPES[reduce]
    ctx.save_for_backward(group)


def _convert_cast_grad(ctx, grad):
    (group,) = ctx.saved_tensors
    back = torch.ops.hidup.convert_backward(grad.to(ctx.reduce), ctx.src, ctx.dst, ctx.world, group)
    return back.to(ctx.x_dtype), None, None, None, None, None, None


convert_cast.register_autograd(_convert_cast_grad, setup_context=_setup_cast_context)


# ------------------------------------------------------------------------------------------------
# Prefetched all-gathers under compilation: torch's functional collective, issued early, waited late.


class _GatherStart(torch.autograd.Function):
    """Issue the all-gather along dim 0 of ``x`` cast to ``dtype`` as torch's functional collective,
    not waited for.  Its backward is the adjoint :func:`convert_cast` runs, the reduce-scatter along dim 0
    of the gradient cast to ``summed``, returned in ``x``'s dtype, bit for bit -- issued the same way, as
    torch's functional ``reduce_scatter_tensor`` on the same group, and waited for (``wait_tensor``) where
    the gradient is read: inductor's ``sink_waits`` (:data:`SINK_WAITS`) moves that wait, and the cast
    after it, past the rest of the graph's backward compute, which the reduce-scatter thus overlaps
    (FSDP2's reduce-scatter on its own stream; :mod:`hidup.search.schedule` prices it so)."""

    # why: the collective's spec whole (group size and name, both dtypes)
    @staticmethod
    def forward(ctx, x, world, name, dtype, summed):
        ctx.world, ctx.name, ctx.x_dtype, ctx.summed = world, name, x.dtype, summed
        return torch.ops._c10d_functional.all_gather_into_tensor(x.to(dtype).contiguous(), world, name)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.to(ctx.summed).contiguous()
        h = torch.ops._c10d_functional.reduce_scatter_tensor(summed, "sum", ctx.world, ctx.name)
        return torch.ops._c10d_functional.wait_tensor(h).to(ctx.x_dtype), None, None, None, None


class _GatherWait(torch.autograd.Function):
    """Wait for a functional collective's result (its gradient passes through)."""

    @staticmethod
    def forward(ctx, h):
        return torch.ops._c10d_functional.wait_tensor(h)

    @staticmethod
    def backward(ctx, grad):
        return grad


def gather_start(
    x: torch.Tensor, dim: int, axis: int | None = None, dtypes: tuple[torch.dtype, torch.dtype] | None = None
) -> torch.Tensor:
    """Under compilation: issue the all-gather ``gather_dim -> full`` of ``x`` on the active group (mesh
    axis ``axis``'s where given), sent in ``dtypes[0]`` and its gradient summed in ``dtypes[1]`` (both
    ``x``'s dtype where None), and return the collective's output, which :func:`gather_wait` makes
    readable.  The values and gradient are :func:`convert`'s (``convert_cast``'s); only the waits move (the
    gradient's reduce-scatter is asynchronous too, :class:`_GatherStart`)."""
    active = ACTIVE
    world = active.world if axis is None else active.axes[axis][0]
    name = active.name if axis is None else active.axis_names[axis]
    front = x.movedim(dim, 0) if dim else x
    dtype, summed = dtypes if dtypes is not None else (x.dtype, x.dtype)
    return _GatherStart.apply(front.contiguous(), world, name, dtype, summed)


def gathers_async(axis: int | None = None) -> bool:
    """Whether :func:`gather_start` may issue on the active group (mesh axis ``axis``'s where given): a
    real process group, not torch's fake one."""
    return bool(ACTIVE.name if axis is None else ACTIVE.axis_names[axis])


def gather_wait(h: torch.Tensor, dim: int) -> torch.Tensor:
    """The gathered tensor of :func:`gather_start`'s ``h`` (gather dim ``dim``), once it has arrived."""
    out = _GatherWait.apply(h)
    return out.movedim(0, dim).contiguous() if dim else out


# ------------------------------------------------------------------------------------------------

BACKENDS = ("inductor", "aot_eager", "eager")


def backend_of(compile) -> str | None:  # noqa: A002 - the option's name
    """The torch.compile backend an option ``compile`` asks for: ``False``/``None``/``"off"`` -> None
    (eager), ``True``/``"on"`` -> ``"inductor"``, a backend name as given."""
    if compile in (None, False, "off"):
        return None
    if compile in (True, "on"):
        return "inductor"
    if isinstance(compile, str):
        if compile not in BACKENDS and compile not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(
                f"compile={compile!r}: not a torch.compile backend; use True (inductor), False, "
                f"or one of {', '.join(BACKENDS)}"
            )
        return compile
    raise ValueError(f"compile={compile!r}: expected True, False or a torch.compile backend name")


# inductor's options for a graph that issues prefetched gathers asynchronously (compile_module): its one
# pass that sinks each functional collective's wait to right before the wait's first reader
SINK_WAITS = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}


def _issues_async(module: torch.nn.Module) -> bool:
    """Whether ``module`` (an fx program) issues a prefetched gather asynchronously under compilation
    (a ``hidup_prefetch`` call, or a ``hidup_prefetch_wait`` that issues it, with its ``link``,
    :mod:`hidup.codegen.prefetch`): its forward waits for it, its backward for the reduce-scatter."""
    graph = getattr(module, "graph", None)
    return isinstance(graph, torch.fx.Graph) and any(
        getattr(n.target, "__name__", "") in ("hidup_prefetch", "hidup_prefetch_wait") and n.kwargs.get("link")
        for n in graph.nodes
    )


def compile_module(module: torch.nn.Module, backend: str):
    """``torch.compile`` of one program (or stage) module: static shapes, graph breaks allowed
    (only :func:`hidup.codegen.program.hidup_copy_sum` makes one).  Inductor sinks the waits of the
    asynchronous prefetched gathers where the module has them (:data:`SINK_WAITS`; module docstring)."""
    options = dict(SINK_WAITS) if backend == "inductor" and _issues_async(module) else None
    return torch.compile(module, backend=backend, dynamic=False, options=options)


def bucket_segments(gm: torch.fx.GraphModule, replicated: list[str], bucket_mb: float) -> dict[str, int]:
    """Segment of every call node of ``gm`` for :func:`compile_segments`, in program order
    (:func:`hidup.ir.graph_segments`): once the replicated parameters (``replicated``: gm paths) first
    read in the open segment hold ``bucket_mb`` MB or more, a new segment starts at the next *cut*.  A
    cut is the first node of a repeated layer (``meta[LAYER]``, :func:`hidup.ir.block_label` of the
    plan node it comes from), so a segment ends where only the layer's output (the residual stream)
    crosses to the next; in a program without repeated layers it is any node that first reads a
    replicated parameter.  Each segment thus holds at least about one gradient bucket's parameters
    (:class:`hidup.codegen.grads.GradBucketer` packs them by first use too), and a whole number of
    layers where the model has them.

    Why at layer boundaries: a boundary inside a layer makes the tensors crossing it (normalized
    activations, attention inputs) graph outputs that inductor must materialize and autograd save,
    where one graph would fuse or recompute them; measured on one H100 with a 4-layer
    ``transformers`` Llama (bf16), a cut at every bucket inside the layers cost 5% of the step."""
    attr_of = {n: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    wanted = set(replicated)
    seen: set[str] = set()
    names, labels, new_bytes = [], [], []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        new = [
            attr_of[a] for a in node.all_input_nodes if a in attr_of and attr_of[a] in wanted and attr_of[a] not in seen
        ]
        seen.update(new)
        names.append(node.name)
        labels.append(node.meta.get(LAYER, ""))
        new_bytes.append(sum(gm.get_parameter(path).numel() * gm.get_parameter(path).element_size() for path in new))
    return dict(zip(names, graph_segments(labels, new_bytes, max(1, int(bucket_mb * 2**20)))))


def compile_segments(gm: torch.fx.GraphModule, segment_of: dict[str, int], backend: str) -> torch.nn.Module:
    """``gm`` split at the segments of ``segment_of`` (node name -> segment, in program order), each
    segment compiled on its own; one compiled module when there is one segment.

    Why: one compiled graph produces every parameter gradient at the end of its backward, so the
    gradient buckets could only be all-reduced after the whole backward.  With a graph per segment
    the backward of segment ``k`` ends, its parameters' gradients are accumulated and their buckets
    launch, while segments ``k-1, ..., 0`` run their backward: the all-reduces overlap the backward
    as they do eagerly, which is what the cost model prices (:mod:`hidup.search.schedule`), at the
    price of no fusion across the segments' boundaries (DDP's compiled mode splits its graph the same
    way)."""
    segments = sorted(set(segment_of.values()))
    if len(segments) <= 1:
        return compile_module(gm, backend)

    def partition(node: torch.fx.Node) -> int:
        if node.name in segment_of:
            return segment_of[node.name]
        users = [segment_of[u.name] for u in node.users if u.name in segment_of]
        return min(users, default=0)

    split = split_module(gm, gm, partition, keep_original_order=True)
    for node in split.graph.nodes:
        if node.op == "call_module":
            setattr(split, node.target, compile_module(split.get_submodule(node.target), backend))
    return split
