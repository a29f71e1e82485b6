"""The ``torch.export`` front end: one training step as a flat graph of ATen ops.

``export_step(model, values, names)`` exports ``model(*values)`` (``values`` in the order of
``model.forward``'s parameters, as :func:`hidup.frontend.trace.forward_inputs` gives them) with
``torch.export.export(strict=False)`` -- the training IR, so ``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention`` and ``aten.cross_entropy_loss`` stay whole -- and returns it
as a plain ``torch.fx.GraphModule`` that :mod:`hidup.frontend.trace` reads:

* one placeholder per forward parameter, named after it (non-tensor values are specialised by
  export and their placeholders are unused);
* every parameter and buffer is a ``get_attr`` of the model's own tensor at its qualified name
  (``model.layers.0.attn.q_proj.weight``), so nothing is copied; tensors that export lifts out of
  the code (``lifted_tensor_0``) are held by the GraphModule;
* ``no_grad`` regions (``wrap_with_set_grad_enabled`` higher-order ops, e.g. rotary tables) are
  inlined: their ops read no trainable tensor, so running them with grad enabled changes nothing;
* every ``torch.device`` constant becomes ``meta``, the device of shape propagation; code
  generation maps it to the device the rank runs on;
* a model on the ``meta`` device (a large model planned without its weights) is exported on fake
  CPU tensors standing in for its parameters, buffers and inputs (:func:`_meta_as_fake_cpu`), so
  its graph is the one a CPU run traces: code that makes constants on the weights' device or
  whose layouts depend on the device (``torch.tensor(..., device=x.device)``, attention output
  strides) would otherwise trace differently on ``meta``, and ``hidup peak`` or ``hidup verify``
  would not recognise the plan; lifted constants become meta tensors (they had no values);
* the output is the loss itself, not a one-element tuple; export's input guard call is dropped;
* a fresh tensor filled by ``copy_`` into slices covering it is a ``cat`` (:func:`_filled_slices_as_cat`);
* an in-place op on a tensor the step created is made out-of-place (:func:`_functionalize`); where
  the write goes through a view (``shifted[..., 1:] = ids[..., :-1]``: ``slice`` then ``copy_``), the
  tensor, its views and the writes are named by :func:`written_through_views` and run whole.

Python control flow is resolved at export time for the example shapes (``if x.size(0) != y.size(0)``
costs nothing), so ``transformers`` models, ``nn.Transformer`` and the zoo all export; opaque work
that depends on tensor values is a ``torch.library`` custom op (``hidup::moe_gating``).  Failures
become :class:`hidup.frontend.trace.TraceFailure` with the model's source line.
"""

from __future__ import annotations

import contextlib
import operator
import traceback
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind

from hidup.errors import UserError
from hidup.fxvalues import map_value, value_leaves
from hidup.rules.experts import routed_experts_as_custom_op

__all__ = ["export_step", "ExportFailure", "written_through_views", "fake_cpu_like", "fake_cpu_stand_ins"]

_META = torch.device("meta")


class ExportFailure(UserError, RuntimeError):
    """torch.export could not capture the step (the message says where and why)."""


class _Step(nn.Module):
    """``model(*values)`` with the tensor values as the only inputs."""

    def __init__(self, model: nn.Module, values: list, tensor_slots: list[int]):
        super().__init__()
        self.m = model
        self.values = values
        self.tensor_slots = tensor_slots

    def forward(self, *tensors):
        values = list(self.values)
        for i, t in zip(self.tensor_slots, tensors):
            values[i] = t
        return self.m(*values)


def _strip(path: str) -> str:
    return path[2:] if path.startswith("m.") else path


def _hop_body(n: torch.fx.Node, owner: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, tuple] | None:
    """(subgraph, operands) of an inlinable higher-order op node, else None."""
    if n.op != "call_function" or getattr(n.target, "__name__", "") != "wrap_with_set_grad_enabled":
        return None
    body = n.args[1]
    return owner.get_submodule(body.target), tuple(n.args[2:])


def _fix_device(v: Any) -> Any:
    return _META if isinstance(v, torch.device) else v


def _user_location(e: BaseException) -> str:
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not frame.filename.startswith(torch_dir) and not frame.filename.endswith(("hidup/frontend/export.py",)):
            return f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")
    return "<unknown location>"


def _check_one_device(model: nn.Module, values: list, names: list[str], slots: list[int]) -> None:
    """The step runs on one device: tensors of the model and of its inputs on two devices cannot be
    traced (torch.export fails deep inside an op), so say which ones differ and how to fix it.  CPU
    scalars (0-dim), which torch lets mix with tensors of any device, are left out."""
    where: dict[str, str] = {}
    tensors = [(f"model tensor {n!r}", t) for n, t in list(model.named_parameters()) + list(model.named_buffers())]
    tensors += [(f"input {names[i]!r}", t) for i in slots for t in value_leaves(values[i], torch.Tensor)]
    for what, t in tensors:
        if not (t.dim() == 0 and t.device.type == "cpu"):
            where.setdefault(str(t.device), what)
    if len(where) > 1:
        raise ExportFailure(
            "the model and its inputs are on different devices: "
            + ", ".join(f"{what} is on {dev}" for dev, what in where.items())
            + ". Fix: create the example inputs on the model's device (or move the model with "
            "model.to(device)) before handing them to hidup."
        )


def export_step(model: nn.Module, values: list, names: list[str]) -> torch.fx.GraphModule:
    """The step ``model(*values)`` as an ATen GraphModule (see module docstring)."""
    slots = [i for i, v in enumerate(values) if value_leaves(v, torch.Tensor)]
    for i in slots:
        if not isinstance(values[i], torch.Tensor):
            raise ExportFailure(
                f"model input {names[i]!r} is a {type(values[i]).__name__} of tensors; hidup traces "
                "tensor or non-tensor inputs only. Fix: pass each tensor as its own forward argument."
            )
    _check_one_device(model, values, names, slots)
    try:
        with _meta_as_fake_cpu(model, values, slots) as values:
            step = _Step(model, list(values), slots)
            with torch.enable_grad(), routed_experts_as_custom_op(model):
                exported = torch.export.export(step, tuple(values[i] for i in slots), strict=False)
    except Exception as e:  # re-raised with the user's location and a fix
        raise ExportFailure(
            f"torch.export cannot capture {type(model).__name__}: {type(e).__name__}: {str(e).strip()[:1500]}\n"
            f"  at {_user_location(e)}\n"
            "  Fix: ops whose output shape depends on tensor values (nonzero, masked_select, .item(), .tolist()) "
            "cannot be captured for a fixed shape; compute such values from shapes or configuration, or wrap the "
            "code in a torch.library custom op with a fake (meta) implementation and declare a rule for it in "
            "hidup.rules."
        ) from e
    return _rebuild(exported, model, names, slots)


def fake_cpu_like(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of ``mode`` with ``t``'s shape, strides and dtype (no memory, no values)."""
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def fake_cpu_stand_ins(model: nn.Module, mode: FakeTensorMode) -> list[tuple[dict, str, torch.Tensor]]:
    """Replace every parameter and buffer of ``model`` (on any device) by a fake CPU tensor of ``mode``;
    a tensor held by several modules (tied weights) becomes one fake tensor held by all of them.
    Returns ``(holder, name, original)`` for each replaced entry, to put the originals back."""
    fakes: dict[int, torch.Tensor] = {}
    replaced = []
    for mod in model.modules():
        for holder in (mod._parameters, mod._buffers):
            for name, t in list(holder.items()):
                if t is None:
                    continue
                if id(t) not in fakes:
                    f = fake_cpu_like(mode, t)
                    is_param = isinstance(t, nn.Parameter)
                    fakes[id(t)] = nn.Parameter(f, t.requires_grad) if is_param else f.requires_grad_(t.requires_grad)
                holder[name] = fakes[id(t)]
                replaced.append((holder, name, t))
    return replaced


@contextlib.contextmanager
def _meta_as_fake_cpu(model: nn.Module, values: list, slots: list[int]) -> Iterator[list]:
    """While the block runs, a model on ``meta`` holds fake CPU tensors in place of its parameters and
    buffers (:func:`fake_cpu_stand_ins`), and the values it yields have fake CPU tensors for meta
    inputs; a model elsewhere is left alone (module docstring)."""
    tensors = [*model.parameters(), *model.buffers(), *(values[i] for i in slots)]
    if not any(t.device.type == "meta" for t in tensors):
        yield values
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    replaced = fake_cpu_stand_ins(model, mode)
    try:
        yield [fake_cpu_like(mode, v) if i in slots and v.device.type == "meta" else v for i, v in enumerate(values)]
    finally:
        for holder, name, t in replaced:
            holder[name] = t


def _as_meta(t: Any) -> Any:
    """A lifted constant of a fake-CPU export as a meta tensor (its values never existed)."""
    if not isinstance(t, FakeTensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)


def _lifted_inputs(exported: torch.export.ExportedProgram) -> dict[str, Any] | None:
    """Placeholder name -> input spec of the exported graph, or None when the step mutates a buffer or
    an input (the unlifted module then writes the new values back)."""
    signature = exported.graph_signature
    if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT) for s in signature.output_specs):
        return None
    return {s.arg.name: s for s in signature.input_specs}


def _rebuild(
    exported: torch.export.ExportedProgram, model: nn.Module, names: list[str], slots: list[int]
) -> torch.fx.GraphModule:
    # The exported graph takes parameters, buffers and lifted constants as placeholders; each becomes a
    # get_attr of the model's own tensor here (what ``exported.module()`` does, without generating and
    # compiling the code of a module that is never run).

    lifted = _lifted_inputs(exported)
    unlifted = exported.graph_module if lifted is not None else exported.module()
    lifted_values = {k: _as_meta(v) for k, v in {**exported.state_dict, **exported.constants}.items()}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [graph.placeholder(name) for name in names]
    tensor_placeholders = iter(placeholders[i] for i in slots)
    attrs: dict[str, Any] = {}
    model_state = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    # A tensor reached by several names (tied weights) keeps the first name the model lists it under:
    # which one export lifts differs between devices and versions, and a plan names its tensors.
    first_name: dict[int, str] = {}
    for path, tensor in model_state.items():
        first_name.setdefault(id(tensor), path)

    def canonical(path: str) -> str:
        tensor = model_state.get(path)
        return path if tensor is None else first_name[id(tensor)]

    attr_nodes: dict[str, torch.fx.Node] = {}

    def get_attr(path: str) -> torch.fx.Node:
        """One get_attr node per tensor path (tied weights lifted twice read one node)."""
        if path not in attr_nodes:
            attr_nodes[path] = graph.get_attr(path)
        return attr_nodes[path]

    def load(a):
        return env[a]

    def copy_graph(source: torch.fx.GraphModule, inputs: list | None) -> Any:
        """Copy ``source``'s nodes into ``graph``; ``inputs`` feed its placeholders (None: the step's)."""
        feed = iter(inputs) if inputs is not None else None
        for n in source.graph.nodes:
            if n.op == "placeholder":
                spec = lifted.get(n.name) if lifted is not None and feed is None else None
                if spec is None or spec.kind == InputKind.USER_INPUT:
                    env[n] = next(feed) if feed is not None else next(tensor_placeholders)
                    continue
                if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                    raise ExportFailure(
                        f"the exported step takes a {spec.kind.name} input ({spec.target}), which hidup cannot hold"
                    )
                path = canonical(_strip(spec.target))
                attrs[path] = model_state.get(path, lifted_values.get(spec.target))
                env[n] = get_attr(path)
            elif n.op == "get_attr":
                obj = operator.attrgetter(n.target)(source)
                if isinstance(obj, torch.fx.GraphModule):
                    env[n] = obj
                    continue
                path = canonical(_strip(n.target)) if source is unlifted else f"{n.target}"
                attrs[path] = model_state.get(path, obj)
                env[n] = get_attr(path)
                env[n].meta.update(n.meta)
            elif n.op == "call_module":
                continue  # export's input guard
            elif n.op == "output":
                return map_value(n.args[0], lambda a: env[a] if isinstance(a, torch.fx.Node) else a)
            else:
                body = _hop_body(n, source)
                if body is not None:
                    sub, operands = body
                    env[n] = copy_graph(sub, [env[a] if isinstance(a, torch.fx.Node) else a for a in operands])
                    continue
                if n.target is operator.getitem and isinstance(env.get(n.args[0]), (tuple, list)):
                    env[n] = env[n.args[0]][n.args[1]]
                    continue
                args = map_value(torch.fx.node.map_arg(n.args, load), _fix_device)
                kwargs = map_value(torch.fx.node.map_arg(n.kwargs, load), _fix_device)
                new = graph.create_node(n.op, n.target, tuple(args), dict(kwargs), name=n.name)
                new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack")})
                if n.target in _EMPTY and "val" in n.meta:  # its dtype, for _filled_slices_as_cat
                    new.meta["dtype"] = n.meta["val"].dtype
                stack = new.meta.get("nn_module_stack")
                if stack:
                    new.meta["nn_module_stack"] = {
                        k: (_strip(path), kind) for k, (path, kind) in stack.items() if _strip(path) and path != "m"
                    }
                env[n] = new
        raise ExportFailure("the exported graph has no output")

    out = copy_graph(unlifted, None)
    while isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    graph.output(out)
    _filled_slices_as_cat(graph)
    _functionalize(graph)
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(attrs, graph, type(model).__name__)


_EMPTY = (torch.ops.aten.new_empty.default, torch.ops.aten.empty.memory_format)


def _empty_shape(base: torch.fx.Node) -> list:
    """The shape an :data:`_EMPTY` node makes (``new_empty(x, shape)`` or ``empty(shape)``)."""
    return list(base.args[1] if base.target is torch.ops.aten.new_empty.default else base.args[0])


def _slice_bounds(view: torch.fx.Node, shape) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of a step-1 ``aten.slice`` of a tensor of ``shape``, else None."""
    if view.target is not torch.ops.aten.slice.Tensor:
        return None
    dim, start, end, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1 :])[:4]
    if step != 1 or not isinstance(dim, int):
        return None
    dim %= len(shape)
    size = shape[dim]
    start, end = min(start or 0, size), min(size if end is None else end, size)
    return dim, start, end


def _cover(base: torch.fx.Node, order: dict) -> tuple[int, list[tuple[int, int, torch.fx.Node]]] | None:
    """``(dim, [(start, end, write)])`` when the fresh ``base`` is filled by ``copy_`` into slices along one
    dim that cover it exactly, each slice written once and read by nothing else, and every other reader
    of ``base`` comes after the writes; else None."""
    shape = _empty_shape(base)
    pieces, readers = [], []
    for user in base.users:
        bounds = _slice_bounds(user, shape)
        writes = list(user.users)
        if bounds is None or len(writes) != 1 or writes[0].target is not torch.ops.aten.copy_.default:
            readers.append(user)
            continue
        if writes[0].args[0] is not user or writes[0].users:
            return None
        pieces.append((*bounds, writes[0]))
    if not pieces or len({p[0] for p in pieces}) != 1:
        return None
    pieces.sort(key=lambda p: p[1])
    ends = [0] + [end for _, _, end, _ in pieces]
    if [start for _, start, _, _ in pieces] != ends[:-1] or ends[-1] != shape[pieces[0][0]]:
        return None
    last = max(order[w] for *_, w in pieces)
    if any(order[r] < last for r in readers):
        return None
    return pieces[0][0], [(start, end, w) for _, start, end, w in pieces]


def _filled_slices_as_cat(graph: torch.fx.Graph) -> None:
    """A fresh tensor filled slice by slice, ``k = x.new_empty(shape); k[..., :d] = a; k[..., d:] = b``
    (DeepSeek-V3's keys), becomes ``cat`` of the sources broadcast to their slices and cast to the
    tensor's dtype: the same values, and no write through a view left (:func:`written_through_views`),
    so the rules cut it like any ``cat``."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    for base in list(graph.nodes):
        if base.op != "call_function" or base.target not in _EMPTY:
            continue
        cover = _cover(base, order)
        if cover is None or "dtype" not in base.meta:
            continue
        dim, pieces = cover
        shape, dtype = _empty_shape(base), base.meta["dtype"]
        with graph.inserting_before(max((w for *_, w in pieces), key=order.__getitem__).next):
            parts = []
            for start, end, write in pieces:
                part = graph.call_function(
                    aten.expand.default, (write.args[1], shape[:dim] + [end - start] + shape[dim + 1 :])
                )
                parts.append(graph.call_function(aten._to_copy.default, (part,), {"dtype": dtype}))
            cat = graph.call_function(aten.cat.default, (parts, dim))
        for *_, write in pieces:
            view = write.args[0]
            graph.erase_node(write)
            graph.erase_node(view)
        base.replace_all_uses_with(cat)
        graph.erase_node(base)
        order = {n: i for i, n in enumerate(graph.nodes)}


def _fresh(n: Any) -> bool:
    """Whether fx node ``n`` computes a new tensor (an ATen op whose result aliases no input)."""
    if not isinstance(n, torch.fx.Node) or not isinstance(n.target, torch._ops.OpOverload):
        return False
    returns = n.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None


def _functionalize(graph: torch.fx.Graph) -> None:
    """In-place ATen ops on a tensor the step itself created (``zeros_like(mask).masked_fill_(mask,
    -inf)`` inside ``nn.MultiheadAttention``) become their out-of-place overload, and every later
    reader of that tensor reads the result instead; nothing else can see the old value, so the values
    are unchanged and the op gets the rule of its functional form (or, unread, is dropped as dead)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        name = op._schema.name.split("::")[-1]
        if not name.endswith("_") or name.endswith("__") or not n.args or not _fresh(n.args[0]):
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, op._overloadname, None) if packet is not None else None
        if functional is None:
            continue
        target = n.args[0]
        for user in list(target.users):
            if user is not n and order[user] > order[n]:
                user.replace_input_with(target, n)
        n.target = functional


def _aliases_first_input(n: torch.fx.Node) -> bool:
    """Whether ATen node ``n``'s result is its first argument or a view of it."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not n.args:
        return False
    returns = n.target._schema.returns
    return isinstance(n.args[0], torch.fx.Node) and len(returns) == 1 and returns[0].alias_info is not None


def _writes_first_input(n: torch.fx.Node) -> bool:
    if not _aliases_first_input(n):
        return False
    arguments = n.target._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def written_through_views(graph: torch.fx.Graph) -> set[str]:
    """Names of the nodes of every tensor the step creates and then writes in place where a view of
    it can see the write: the tensor, every view of it, and the writes.

    Run whole on every rank, they alias as on one device.  Cut into pieces, they do not: a rank's piece
    of a view is a copy of it (a form change), so a write into the piece never reaches the tensor, and a
    later reader would see the tensor unwritten.  So the trace offers these nodes only their all-``full``
    signature, and code generation converts such a tensor anew for each reader (its value changes).
    In-place writes on a fresh tensor itself, with no view of it, are made out-of-place before
    (:func:`_functionalize`) and need none of this."""
    base_of: dict[torch.fx.Node, torch.fx.Node] = {}
    written: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if not _aliases_first_input(n):
            continue
        base = base_of.get(n.args[0], n.args[0])
        base_of[n] = base
        if _writes_first_input(n) and _fresh(base):
            written.add(base)
    members = {n for n, base in base_of.items() if base in written} | written
    return {n.name for n in members}
