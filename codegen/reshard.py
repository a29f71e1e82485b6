"""Reshard after forward: a stored-split parameter's gathered copy is not kept for the backward.

A parameter stored split (its ``param`` node produces a ``gather_d`` form, or a layout with a
``gather`` axis on a device mesh) is converted -- all-gathered, as a rule -- before the ops that read
it.  Such an op's backward usually needs the converted copy (a matmul saves its weight), so autograd
keeps it from the forward to the backward and the rank holds every gathered weight of the model at
once.  A plan lists in ``plan.reshard`` the parameters (``param`` node names) whose converted copies
are instead freed after their forward use and made again when the backward needs them, as FSDP2's
``reshard_after_forward`` does -- without running the ops that read them again (recomputation,
:mod:`hidup.codegen.recompute`, runs a whole layer again).

How the rank program does it:

* the conversion of such a parameter is :func:`hidup.codegen.program.hidup_reshard_convert` (on a
  device mesh, one :func:`~hidup.codegen.program.hidup_reshard_convert_step` per axis): the ordinary
  conversion, whose output's storage is then *registered* with how to make it again -- the shard it
  came from (or the registered step before it), the two forms and the process group the forward ran
  on (a duplicated copy's, a mesh axis's);
* every op that reads such a copy (or a view the program makes of it) runs inside :class:`ReshardCall`,
  under ``torch.autograd.graph.saved_tensors_hooks``: a tensor the op saves for its backward whose
  storage is registered (and was not written in place since) is packed as a small handle (the recipe
  plus the view's size, strides and offset) instead of the tensor; anything else goes to the hooks
  that were active around the op (none, or a caller's), unchanged;
* after the forward nothing holds the converted copy any more, so it is freed when the program drops
  its last use; in the backward the first unpack of a handle converts the shard again -- the same
  collective on the same group, outside autograd -- and returns the saved view of it; later unpacks
  of the same copy reuse it while it is alive.

The values are those of the plain program (the same collective of the same shard), so losses and
gradients match it exactly.  The gradient of the parameter still flows through the forward
conversion's own backward (a reduce-scatter for an all-gather), which saves nothing; with gradients
reduced in bf16 (:mod:`hidup.precision`) that conversion is ``convert_cast`` sending the copy in its
own dtype and summing the gradient in bf16.  Collectives
of the backward run in the order of the ops that unpack, the same on every rank.

Under ``torch.compile`` the saved tensors are AOTAutograd's to choose, not autograd's, so there the
conversion is a checkpoint region of its own (:func:`compiled_convert`) whose selective-checkpoint
policy says ``MUST_RECOMPUTE``: the partitioner saves the shard (a parameter, held anyway) instead of
the copy and puts the conversion again in the backward graph; the ops that read the copy are compiled as
usual.

What it does not cover: a copy read inside a recomputed layer (the layer's region frees and makes it
again already).  Under autocast a matmul saves its low-precision cast of the weight rather than the
gathered copy, so the copy is freed either way and the cast is kept (:mod:`hidup.frontend.saved` counts it).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from hidup.codegen import collectives
from hidup.ir import Form, conversion

__all__ = ["ReshardCall", "register", "registered", "begin_forward", "compiled_convert", "VIEW_NAMES"]

# storage of a converted copy of a resharded parameter -> how to make it again
_REGISTRY: dict[StorageWeakRef, "_Recipe"] = {}
# id(process group) -> the recipes of its current forward by unit (begin_forward starts one): each recipe
# holds its own forward's, so a backward makes ahead only the copies of the forward it runs back through
_SESSIONS: dict[int, dict] = {}
# (device index, current stream id) -> the side stream copies made ahead run on
_SIDE: dict[tuple, torch.cuda.Stream] = {}

# names of the functions and methods whose output is a view of their first input: an op reading such a
# view of a converted copy runs in a ReshardCall too
VIEW_NAMES = frozenset(
    "t T mT transpose permute view view_as reshape expand expand_as unsqueeze squeeze flatten unflatten "
    "narrow select split chunk unbind movedim moveaxis swapaxes swapdims as_strided detach".split()
)


class _Recipe:
    """How to make a registered converted copy again: convert ``source`` (a detached shard) or what
    ``parent`` makes, seen through the input geometry ``geometry``, from ``src`` to ``dst`` on ``group``."""

    __slots__ = (
        "source",
        "parent",
        "geometry",
        "src",
        "dst",
        "group",
        "dtype",
        "layout",
        "version",
        "cache",
        "unit",
        "session",
        "packed",
        "ahead",
        "__weakref__",
    )

    def __init__(self, x: torch.Tensor, parent: "_Recipe | None", src: Form, dst: Form, group, out: torch.Tensor):
        self.source = None if parent is not None else x.detach()
        self.parent = parent
        self.geometry = (tuple(x.shape), tuple(x.stride()), x.storage_offset())
        self.src, self.dst, self.group = src, dst, group
        self.dtype = out.dtype
        self.layout = (tuple(out.shape), tuple(out.stride()), out.storage_offset())
        self.version = out._version  # changed: the copy was written in place, and is kept as it is
        self.cache: weakref.ref | None = None
        self.unit = -1  # the program unit whose op reads the copy (hidup.codegen.prefetch); -1: not prefetched
        self.session: dict | None = None  # its forward's recipes by unit (weak references), in registration order
        self.packed = False  # a saved tensor of the backward is a view of the copy: the backward makes it
        self.ahead = None  # the copy made ahead of its first unpack (_Ahead), held until then

    def make(self) -> torch.Tensor:
        """The converted copy, made again (outside autograd) unless a copy made earlier is still alive
        (or made ahead, :func:`_make_ahead`)."""
        out = self.cache() if self.cache is not None else None
        if out is not None:
            return out
        ahead, self.ahead = self.ahead, None
        out = ahead.take() if ahead is not None else self._convert()
        self.cache = weakref.ref(out)
        return out

    def _convert(self) -> torch.Tensor:
        if self.parent is not None:
            x = self.parent.make().as_strided(*self.geometry)
        else:
            x = self.source
        with torch.no_grad():
            out = collectives.apply_op(conversion(self.src, self.dst).forward, x, self.src, self.dst, self.group)
        if (tuple(out.shape), tuple(out.stride()), out.storage_offset()) != self.layout:  # the forward's strides
            out = torch.empty_strided(self.layout[0], self.layout[1], dtype=out.dtype, device=out.device).copy_(out)
        self.cache = weakref.ref(out)
        return out


class _Packed:
    """What a saved view of a registered copy is packed as: its recipe and the view's geometry."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = recipe, tuple(t.shape), tuple(t.stride()), t.storage_offset()
        recipe.packed = True

    def unpack(self) -> torch.Tensor:
        recipe = self.recipe
        out = recipe.make().as_strided(self.size, self.stride, self.offset)
        if recipe.unit > 0:  # the backward reached this unit: the unit before it is next
            _make_ahead(recipe.session.get(recipe.unit - 1, ()))
        return out


def _key(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a plain storage
        return None


def _prune() -> None:
    for key in [k for k in _REGISTRY if k.expired()]:
        del _REGISTRY[key]


def register(out: torch.Tensor, x: torch.Tensor, src: Form, dst: Form, group, unit: int = -1) -> torch.Tensor:
    """Register ``out``, the conversion ``src -> dst`` of ``x`` on ``group``, as a copy that the ops of
    :class:`ReshardCall` do not keep for the backward; returns ``out``.  ``unit``: the program unit of
    the op that reads it (:mod:`hidup.codegen.prefetch`), whose backward makes it ahead; -1: none."""
    if torch.compiler.is_compiling() or not out.requires_grad:
        return out
    key = _key(out)
    if key is None or key == _key(x) or out.storage_offset():  # the identity (one rank): nothing was made
        return out
    _prune()
    parent = _REGISTRY.get(_key(x))
    recipe = _REGISTRY[key] = _Recipe(x, parent, src, dst, group, out)
    if unit >= 0:  # the forward's session (begin_forward), by unit
        session = _SESSIONS.setdefault(id(group), {})
        recipe.unit, recipe.session = unit, session
        session.setdefault(unit, []).append(weakref.ref(recipe))
    return out


def begin_forward(group) -> None:
    """A forward that registers copies by unit starts on ``group``: its recipes are a session of their own,
    so its backward makes ahead only its own copies (:func:`_make_ahead`)."""
    _SESSIONS[id(group)] = {}


class _Ahead:
    """A copy made ahead of its first unpack: on a side stream with an event on CUDA."""

    __slots__ = ("value", "event")

    def __init__(self, recipe: _Recipe):
        root = recipe
        while root.parent is not None:
            root = root.parent
        device = root.source.device
        if device.type != "cuda":
            self.value, self.event = recipe._convert(), None
            return
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.value = recipe._convert()
            self.event = torch.cuda.Event()
            self.event.record(side)

    def take(self) -> torch.Tensor:
        if self.event is not None:
            current = torch.cuda.current_stream(self.value.device)
            current.wait_event(self.event)
            self.value.record_stream(current)
        return self.value


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    key = (device.index, torch.cuda.current_stream(device).stream_id)
    side = _SIDE.get(key)
    if side is None:
        side = _SIDE[key] = torch.cuda.Stream(device=device)
    return side


def _make_ahead(refs) -> None:
    """Make the copies of ``refs`` (one unit's recipes of one forward) that the backward will unpack,
    ahead, in the order the forward registered them (the same on every rank)."""
    for ref in refs:
        recipe = ref()
        if recipe is None or not recipe.packed or recipe.ahead is not None:
            continue
        if recipe.cache is not None and recipe.cache() is not None:
            continue
        recipe.ahead = _Ahead(recipe)


def registered() -> int:
    """How many registered copies are alive (for tests: none once a forward's copies are freed)."""
    _prune()
    return len(_REGISTRY)


def _pack(outer, t: torch.Tensor):
    recipe = _REGISTRY.get(_key(t)) if _REGISTRY else None
    if recipe is not None and t.dtype == recipe.dtype and t._version == recipe.version:
        return _Packed(recipe, t)
    return (outer[0](t),) if outer is not None else t


def _unpack(outer, packed):
    if isinstance(packed, _Packed):
        return packed.unpack()
    return outer[1](packed[0]) if outer is not None else packed


def _must_recompute(ctx, op, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE


_RECOMPUTE_CONTEXT = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _must_recompute)


def compiled_convert(
    x: torch.Tensor, src: str, dst: str, world: int, token: torch.Tensor, summed: torch.dtype | None = None
) -> torch.Tensor:
    """The conversion ``hidup::convert`` of a resharded parameter under ``torch.compile``: in a
    checkpoint region of its own whose policy recomputes it, so AOTAutograd's partitioner makes the copy
    again in the backward from the shard instead of saving it (module docstring).  With ``summed`` (its
    gradient summed in that dtype, :mod:`hidup.precision`) the op is ``hidup::convert_cast`` sending ``x``
    in its own dtype."""
    if summed is None:
        op, args = torch.ops.hidup.convert, (x, src, dst, world, token)
    else:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        op, args = torch.ops.hidup.convert_cast, (x, src, dst, world, token, name(x.dtype), name(summed))
    return torch.utils.checkpoint.checkpoint(op, *args, use_reentrant=False, context_fn=_RECOMPUTE_CONTEXT)


def _method(name: str):
    return lambda obj, *args, **kwargs: getattr(obj, name)(*args, **kwargs)


class ReshardCall(nn.Module):
    """An op of the rank program that reads a converted copy of a resharded parameter: it runs under
    saved-tensor hooks that keep a handle instead of the copy (module docstring)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = _method(fn) if isinstance(fn, str) else fn
        self.name = fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__)

    def extra_repr(self) -> str:
        return self.name

    def forward(self, *args, **kwargs):
        if (
            torch.compiler.is_compiling()
            or not _REGISTRY
            or not torch.is_grad_enabled()
            or not torch._C._autograd._saved_tensors_hooks_is_enabled()
        ):
            return self.fn(*args, **kwargs)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(_pack, outer), functools.partial(_unpack, outer)
        ):
            return self.fn(*args, **kwargs)
