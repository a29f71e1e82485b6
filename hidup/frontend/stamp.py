"""Export a deep model's step with four of its repeated blocks and stamp out the others.

``torch.export`` of a model with ``L`` identical decoder layers costs ``O(L)`` (a quarter of a
second per Llama-3-70B layer on a 2-core CPU, most of a trace).  When the step runs a stack of
structurally identical blocks, :func:`export_stamped` exports it twice with a short stack instead and
writes the ``L``-block graph from those two graphs:

* ``G3``: the stack holding blocks ``[0, 1, L-1]``;  ``G4``: blocks ``[0, 1, 2, L-1]``.

(The short stack is the model's own ``nn.ModuleList`` with its members swapped for the export, so
every kept block is the model's real module with its own parameters and ``layer_idx``.)

Which stacks qualify (:func:`repeated_stack`)
---------------------------------------------
An ``nn.ModuleList`` whose members repeat with a period ``p`` (the smallest of 1 .. 8 that works):
member ``i`` and member ``i + p`` are distinct modules of one class whose submodules match pairwise
-- the same relative names and classes, the same parameter and buffer names with the same shapes,
dtypes, devices and ``requires_grad``, no module hooks, every other attribute equal except integer
attributes that count the position (``v_{i+p} = v_i + p``, ``layer_idx``) -- and no tensor is shared
between members.  A *block* is ``p`` consecutive members (a decoder layer; a dense and an MoE layer
in turn), and the list must hold at least ``min_blocks`` of them.  A member holding a plain tensor
attribute or an attribute that does not compare equal (a per-layer ``sliding_window``) breaks the
period.  Of several such lists the one holding the most parameter elements is taken (a model's
layers, not the experts inside one layer).

The graph as a function of ``L``
--------------------------------
Let ``P`` be block 2's nodes in ``G4`` (its ``get_attr`` runs and its ops: the nodes from block 2's
first op up to block 3's first op, ops of the parent module between blocks included) and ``Q`` the
``|P|`` ops that follow it (block ``L-1``).  Every fx name and every numbered path component splits
as fx splits names, ``base_num``.  The stamped graph rests on two equalities, both checked node for
node (op, target, literal arguments, the wiring, ``nn_module_stack`` with block indices abstracted,
``stack_trace``):

1. **A block reading a middle block is a middle block:** ``P`` and ``Q`` are equal position for
   position, where a reference to the ``|P|`` nodes before the block is compared by its position
   there, a reference inside the block by its position in the block, a parameter of the block by its
   path with the block index abstracted, anything else by identity.  ``Q`` reads ``P`` where ``P``
   reads block 1, so block ``k`` (``2 <= k <= L-2``) is ``P`` with its reads of block 1 redirected to
   block ``k-1``.  Per node, ``delta = num(Q) - num(P)`` is how many names of its base one block
   takes.
2. **The rest does not depend on ``L``:** ``G4`` without ``P`` equals ``G3`` node for node, references
   to ``P`` compared as the corresponding references to block 1 in ``G3``.  Per node, ``num(G4) -
   num(G3)`` is the shift one more block causes (0 before the stack, ``delta`` after it).

Then the ``L``-block graph is ``G4`` with ``P`` repeated: after each run of ``P`` (its parameters'
``get_attr`` nodes, its constants', its ops) come copies ``j = 1 .. L-4`` of it, block ``2+j``, each
number ``num(P) + j * delta``; a node outside ``P`` keeps its ``G4`` place with each number
extrapolated linearly, ``num(G4) + (L-4) * (num(G4) - num(G3))`` (block ``L-1``'s index among them),
and reads block ``L-2``, the last copy, where it read ``P``.  This is the order ``torch.export`` gives
the whole model: parameters in ``named_parameters`` order, constants and ops in execution order, names
from fx's per-base counters.  Parameters and buffers are the model's own tensors at their full paths;
a constant the block's code creates (``lifted_tensor_N``) is cloned per copy.

What is assumed, and checked where it can be
--------------------------------------------
A block's exported ops are a function of its class, its attributes and the metadata of what it reads
(torch.export runs its Python for those).  The attributes are checked above.  The metadata is checked
after shape propagation (:meth:`Stamped.agrees`): every stamped op's outputs have the shapes, dtypes
and ``requires_grad`` of its template's in ``P``.  So copy ``j`` reads what copy ``j-1`` made, which
has the metadata of ``P``'s outputs, which is what block ``L-1`` read in ``G4``, whose export is
``P``'s (equality 1): by induction each copy is what torch.export gives that block.  Code that
branches on ``layer_idx`` itself for blocks other than 0, 1, 2 and ``L-1`` (exported as themselves)
cannot be seen; per-layer behaviour held in an attribute (``sliding_window``) breaks the stack.
Whenever a check fails, either short export fails, or the stack is too short (fewer than 5 blocks),
the caller exports the whole model.
"""

from __future__ import annotations

import operator
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch import nn

from hidup.fxvalues import map_value

__all__ = ["Stack", "Stamped", "repeated_stack", "export_stamped", "AUTO_MIN_BLOCKS", "MIN_BLOCKS"]

# Stamping needs a block between the two kept middle ones and the last.  The two short exports cost
# about what a 7-block export does (a Llama-3-70B shape on an 8x8 mesh: 6 blocks traced in 2.3 s whole,
# 2.7 s stamped; 8 blocks 3.3 / 2.8 s), so the default stamps from 8 blocks on.
MIN_BLOCKS = 5
AUTO_MIN_BLOCKS = 8
MAX_PERIOD = 8  # the longest repeating pattern of members looked for

_SUFFIX = re.compile(r"^(.*)_(\d+)$")  # how torch.fx splits a name into base and counter
_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_OWN = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOKS}


class _Mismatch(Exception):
    """The short exports do not determine the whole graph (the caller exports the whole model)."""


@dataclass
class Stack:
    """A list whose members repeat: its qualified path, the list, and the period of the repetition
    (1: identical members; 2: a dense and an MoE layer in turn).  A *block* is ``period``
    consecutive members; ``len`` counts blocks."""

    path: str
    blocks: nn.ModuleList
    period: int = 1

    def __len__(self) -> int:
        return len(self.blocks) // self.period

    def members(self, block: int) -> list[int]:
        """Indices in the list of the members of block ``block``."""
        return [block * self.period + j for j in range(self.period)]


@dataclass
class Stamped:
    """The stamped whole-model graph and, per stamped op, the op of block 2 it copies."""

    gm: torch.fx.GraphModule
    stack: Stack
    templates: dict[str, str] = field(default_factory=dict)  # stamped fx op name -> name of the op it copies
    # per copy ``j = 0 .. L-4`` of block 2 (blocks 2 .. L-2; copy 0 is block 2 as exported), the name of
    # its node per node of block 2 (its ``get_attr`` runs and ops, by their names in the 4-block export),
    # in the order of the 4-block export
    blocks: list[dict[str, str]] = field(default_factory=list)

    def agrees(self, tensor_ids: dict[str, list[int]], tensors: dict) -> bool:
        """Whether every stamped op's outputs have its template's shapes, dtypes and requires_grad
        (``tensor_ids`` / ``tensors``: fx node name -> IR tensor ids, IR id -> tensor)."""

        def meta(name):
            return [(t.shape, t.dtype, t.requires_grad) for t in (tensors[i] for i in tensor_ids.get(name, []))]

        return all(meta(copy) == meta(original) for copy, original in self.templates.items())


# ----------------------------------------------------------------------------------------------
# which stack


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 - an attribute that cannot be compared is taken as different
        return False


def _tensor_key(t: torch.Tensor | None):
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _own_tensors(module: nn.Module) -> set[int]:
    return {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}


def _repeats(members: list[nn.Module], period: int) -> bool:
    """Whether ``members`` repeat with ``period`` (module docstring): member ``i`` is like member
    ``i % period``, index attributes counting by ``period``, and no tensor is shared between members."""
    if len(members) % period or len({id(m) for m in members}) != len(members):
        return False
    owned = [_own_tensors(m) for m in members]
    if sum(map(len, owned)) != len(set().union(*owned)):
        return False
    return all(_identical(members[j::period], period) for j in range(period))


def _identical(blocks: list[nn.Module], step: int = 1) -> bool:
    """Whether ``blocks`` are alike: classes, parameters and buffers, equal attributes except integer
    ones that go up by ``step`` from one block to the next, no hooks."""
    if len({type(b) for b in blocks}) != 1:
        return False
    trees = [list(b.named_modules(remove_duplicate=False)) for b in blocks]
    if any([(n, type(m)) for n, m in tree] != [(n, type(m)) for n, m in trees[0]] for tree in trees):
        return False
    for parts in zip(*trees):
        mods = [m for _, m in parts]
        first = mods[0]
        for m in mods:
            if any(getattr(m, h, None) for h in _HOOKS):
                return False
            for table in ("_parameters", "_buffers"):
                own, ref = getattr(m, table), getattr(first, table)
                if list(own) != list(ref) or any(_tensor_key(own[k]) != _tensor_key(ref[k]) for k in own):
                    return False
            if getattr(m, "_non_persistent_buffers_set", set()) != getattr(first, "_non_persistent_buffers_set", set()):
                return False
        keys = [sorted(k for k in vars(m) if k not in _OWN) for m in mods]
        if any(k != keys[0] for k in keys):
            return False
        for key in keys[0]:
            values = [vars(m)[key] for m in mods]
            if all(_same_value(v, values[0]) for v in values):
                continue
            counts = all(type(v) is int for v in values) and all(
                v == values[0] + k * step for k, v in enumerate(values)
            )
            if not counts:
                return False
    return True


def repeated_stack(model: nn.Module, min_blocks: int = MIN_BLOCKS) -> Stack | None:
    """The ``nn.ModuleList`` of ``model`` to stamp (module docstring), or None.  A list whose path
    also ends another module's path (``layers`` beside ``encoder.layers``) is left alone: the
    stamped module paths rename ``<path>.<index>`` wherever it starts a path or follows a dot."""
    best, best_size = None, 0
    paths = [path for path, _ in model.named_modules()]
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < max(min_blocks, MIN_BLOCKS):
            continue
        if not path or any(f".{path}." in f".{q}." and not q.startswith(path) for q in paths):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size <= best_size:
            continue
        members = list(module)
        for period in range(1, MAX_PERIOD + 1):
            if len(members) // period < max(min_blocks, MIN_BLOCKS):
                break
            if _repeats(members, period):
                best, best_size = Stack(path, module, period), size
                break
    return best


# ----------------------------------------------------------------------------------------------
# the two short exports


def _short_export(export: Callable[[], torch.fx.GraphModule], stack: Stack, keep: list[int]):
    """``export()`` while ``stack`` holds only the blocks ``keep`` (their members renumbered 0..)."""
    modules = stack.blocks._modules
    kept = [i for block in keep for i in stack.members(block)]
    stack.blocks._modules = OrderedDict((str(i), modules[str(k)]) for i, k in enumerate(kept))
    try:
        return export()
    finally:
        stack.blocks._modules = modules


def export_stamped(export: Callable[[], torch.fx.GraphModule], model: nn.Module, stack: Stack) -> Stamped | None:
    """The whole step's graph from two short exports (module docstring); None when they do not
    determine it.  ``export()`` exports ``model``'s step as it stands; an exception it raises on a
    short stack means None."""
    n = len(stack)
    if n < MIN_BLOCKS:
        return None
    try:
        g3 = _short_export(export, stack, [0, 1, n - 1])
        g4 = _short_export(export, stack, [0, 1, 2, n - 1])
    except Exception:  # noqa: BLE001 - the whole export runs next and reports its own failure
        return None
    try:
        return _Stamper(g3, g4, model, stack).build()
    except Exception:  # noqa: BLE001 - _Mismatch, or a graph the stamper does not understand: export it whole
        return None


# ----------------------------------------------------------------------------------------------
# stamping


def _split(name: str) -> tuple[str, int]:
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _renumber(name: str, num: int) -> str:
    base, old = _split(name)
    return name if num == old else (f"{base}_{num}" if num else base)


def _step(a: str, b: str) -> int:
    """How many counts of its base name ``b`` is past ``a`` (``_Mismatch`` if the bases differ)."""
    (base_a, num_a), (base_b, num_b) = _split(a), _split(b)
    if base_a != base_b:
        raise _Mismatch(f"{a} / {b}")
    return num_b - num_a


def _positions(nodes: list) -> dict:
    return {x: i for i, x in enumerate(nodes)}


def _literal(v: Any) -> tuple:
    return ("literal", type(v), v)


class _Stamper:
    """Checks the two equalities of the module docstring on ``g3`` / ``g4`` and writes the graph."""

    def __init__(self, g3: torch.fx.GraphModule, g4: torch.fx.GraphModule, model: nn.Module, stack: Stack):
        self.g3, self.g4, self.model, self.stack = g3, g4, model, stack
        self.n, self.period = len(stack), stack.period
        # "<stack>.<index>" at the start of a path or after a dot (repeated_stack made it unambiguous)
        self.block_re = re.compile(r"(?<![^.])" + re.escape(stack.path) + r"\.(\d+)(?!\d)")
        self.nodes3, self.nodes4 = list(g3.graph.nodes), list(g4.graph.nodes)

    # -- paths and blocks
    def block(self, node: torch.fx.Node) -> int | None:
        """The stack position a node of a short graph belongs to: by its ``get_attr`` path, or by the
        innermost module that issued the op; None outside the stack."""
        if node.op == "get_attr":
            path = str(node.target)
        elif node.op == "call_function" and node.meta.get("nn_module_stack"):
            path = list(node.meta["nn_module_stack"].values())[-1][0]
        else:
            return None
        m = self.block_re.match(path)
        return int(m.group(1)) // self.period if m else None

    def reindex(self, text: str, old: int, new: int | str) -> str:
        """``text`` with the members of block ``old`` renamed to those of block ``new`` (an int), or
        to ``<new><position in the block>`` (a label such as ``*``)."""

        def rename(m: re.Match) -> str:
            block, j = divmod(int(m.group(1)), self.period)
            if block != old:
                return m.group(0)
            return f"{self.stack.path}.{new * self.period + j if isinstance(new, int) else f'{new}{j}'}"

        return self.block_re.sub(rename, text)

    def module_stack(self, node: torch.fx.Node, old: int, new: int | str) -> dict | None:
        stack = node.meta.get("nn_module_stack")
        if stack is None:
            return None
        return {self.reindex(k, old, new): (self.reindex(path, old, new), kind) for k, (path, kind) in stack.items()}

    def same_source(self, a: torch.fx.Node, a_block: int, b: torch.fx.Node, b_block: int) -> bool:
        return self.module_stack(a, a_block, "*") == self.module_stack(b, b_block, "*") and a.meta.get(
            "stack_trace"
        ) == b.meta.get("stack_trace")

    @staticmethod
    def attr(gm: torch.fx.GraphModule, node: torch.fx.Node):
        return operator.attrgetter(str(node.target))(gm)

    def leaf_step(self, a: torch.fx.Node, a_block: int, b: torch.fx.Node, b_block: int) -> int:
        """How far ``b``'s path counts past ``a``'s in its last component (``lifted_tensor_N``); the
        rest of the paths, block indices abstracted, must be equal."""
        head_a, _, leaf_a = self.reindex(str(a.target), a_block, "*").rpartition(".")
        head_b, _, leaf_b = self.reindex(str(b.target), b_block, "*").rpartition(".")
        if head_a != head_b:
            raise _Mismatch(f"{a.target} / {b.target}")
        return _step(leaf_a, leaf_b)

    # -- the layout of G4
    def layout(self) -> None:
        nodes = self.nodes4
        blocks = [self.block(x) for x in nodes]
        first: dict[int | None, int] = {}
        for i, x in enumerate(nodes):
            if x.op == "call_function":
                first.setdefault(blocks[i], i)
        if any(k not in first for k in (1, 2, 3)):
            raise _Mismatch("a kept block has no op")
        start, end = first[2], first[3]
        size = end - start
        if start < size or end + size > len(nodes):
            raise _Mismatch("no room for the block before block 2 or for block 3")
        if any(x.op != "call_function" or b not in (2, None) for x, b in zip(nodes[start:end], blocks[start:end])):
            raise _Mismatch("block 2's ops are not contiguous")
        if any(b == 2 for b in blocks[end:]):
            raise _Mismatch("block 2 has ops after block 3's")
        self.body = nodes[start:end]  # P's ops
        self.before = nodes[start - size : start]  # what P reads as its previous block
        self.last = nodes[end : end + size]  # Q
        self.attrs = [x for x, b in zip(nodes, blocks) if x.op == "get_attr" and b == 2]
        self.attrs_last = [x for x, b in zip(nodes, blocks) if x.op == "get_attr" and b == 3]
        if len(self.attrs) != len(self.attrs_last):
            raise _Mismatch("blocks 2 and 3 hold different tensors")
        self.in_p = set(self.body) | set(self.attrs)
        self.pos = {
            "body": _positions(self.body),
            "before": _positions(self.before),
            "last": _positions(self.last),
            "attrs": _positions(self.attrs),
            "attrs_last": _positions(self.attrs_last),
        }
        self.run_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # last node of a run of P -> the run
        run: list[torch.fx.Node] = []
        for x in nodes + [None]:
            if x is not None and x in self.in_p:
                run.append(x)
            elif run:
                self.run_of[run[-1]] = run
                run = []

    # -- equality 1: P = Q position for position
    def check_blocks(self) -> None:
        def encode(node, own: str, prev: str, attrs: str):
            """Arguments with each node read as ("self", i) inside the block, ("prev", i) in the
            block before, ("attr", i) among the block's tensors, or itself elsewhere."""

            def ref(a):
                if not isinstance(a, torch.fx.Node):
                    return _literal(a)
                for label, kind in (("self", own), ("prev", prev), ("attr", attrs)):
                    if a in self.pos[kind]:
                        return (label, self.pos[kind][a])
                return ("node", a)

            return map_value((node.args, node.kwargs), ref)

        self.delta: dict[torch.fx.Node, int] = {}  # per node of P: how many counts one block takes
        for p, q in zip(self.body, self.last):
            same_args = _equal(encode(p, "body", "before", "attrs"), encode(q, "last", "body", "attrs_last"))
            if p.target != q.target or not same_args or not self.same_source(p, 2, q, 3):
                raise _Mismatch(f"{p.name} / {q.name}")
            self.delta[p] = _step(p.name, q.name)
        for p, q in zip(self.attrs, self.attrs_last):
            self.delta[p] = self.leaf_step(p, 2, q, 3)
            if _tensor_key(self.attr(self.g4, p)) != _tensor_key(self.attr(self.g4, q)):
                raise _Mismatch(f"{p.target} / {q.target}")

    # -- equality 2: G4 without P = G3
    def check_rest(self) -> None:
        rest = [x for x in self.nodes4 if x not in self.in_p]
        if len(rest) != len(self.nodes3):
            raise _Mismatch("the graph outside the stack depends on its length")
        pair = dict(zip(rest, self.nodes3))
        # where G4's block 3 reads P, G3's block 2 reads its block 1 at the same positions
        start3 = self.nodes3.index(pair[self.last[0]])
        pair.update(zip(self.body, self.nodes3[start3 - len(self.body) : start3]))
        self.shift: dict[torch.fx.Node, int] = {}  # per node outside P: how far one more block moves it
        for a, b in zip(rest, self.nodes3):
            block_a = self.block(a)
            if a.op != b.op or self.block(b) != (2 if block_a == 3 else block_a):
                raise _Mismatch(f"{a.name} / {b.name}")
            if a.op == "get_attr":
                self.shift[a] = self.leaf_step(b, 2, a, 3)
                continue
            if a.op == "call_function":
                if a.target != b.target:
                    raise _Mismatch(f"{a.name} / {b.name}")
                self.shift[a] = _step(b.name, a.name)
                if a in self.pos["last"] and self.shift[a] != self.delta[self.body[self.pos["last"][a]]]:
                    raise _Mismatch(f"{a.name}: one more block moves it unlike one block's count")
            elif a.name != b.name:
                raise _Mismatch(f"{a.name} / {b.name}")
            args_a = map_value(
                (a.args, a.kwargs), lambda v: ("node", pair.get(v, v)) if isinstance(v, torch.fx.Node) else _literal(v)
            )
            args_b = map_value(
                (b.args, b.kwargs), lambda v: ("node", v) if isinstance(v, torch.fx.Node) else _literal(v)
            )
            if not _equal(args_a, args_b) or not self.same_source(a, 3, b, 2):
                raise _Mismatch(f"{a.name} / {b.name}")

    # -- writing the whole graph
    def build(self) -> Stamped:
        self.layout()
        self.check_blocks()
        self.check_rest()
        n, extra = self.n, self.n - 4  # blocks 3 .. n-2 are copies 1 .. extra of P
        state = {
            **dict(self.model.named_parameters(remove_duplicate=False)),
            **dict(self.model.named_buffers(remove_duplicate=False)),
        }
        graph = torch.fx.Graph()
        attrs: dict[str, Any] = {}
        env: dict[torch.fx.Node, torch.fx.Node] = {}  # G4's nodes, P included (copy 0)
        copies: list[dict[torch.fx.Node, torch.fx.Node]] = [env] + [{} for _ in range(extra)]
        templates: dict[str, str] = {}

        def get_attr(path: str, value) -> torch.fx.Node:
            attrs[path] = value
            return graph.get_attr(path)

        def renumbered_leaf(path: str, step: int) -> str:
            head, dot, leaf = path.rpartition(".")
            return head + dot + _renumber(leaf, _split(leaf)[1] + step)

        def call(x: torch.fx.Node, ref, name: str, block: int, new_block: int) -> torch.fx.Node:
            node = graph.create_node(
                "call_function", x.target, map_value(x.args, ref), map_value(x.kwargs, ref), name=name
            )
            if node.name != name:
                raise _Mismatch(f"the name {name} is taken")
            if "stack_trace" in x.meta:
                node.meta["stack_trace"] = x.meta["stack_trace"]
            stack = self.module_stack(x, block, new_block)
            if stack is not None:
                node.meta["nn_module_stack"] = stack
            return node

        def outside(a):  # what a node outside P reads: block n-2, the last copy, where it read P
            if not isinstance(a, torch.fx.Node):
                return a
            return copies[extra][a] if a in self.in_p else env[a]

        def inside(a):  # what P itself reads
            return env[a] if isinstance(a, torch.fx.Node) else a

        for x in self.nodes4:
            if x.op == "placeholder":
                env[x] = graph.placeholder(x.name)
            elif x.op == "output":
                graph.output(map_value(x.args[0], outside))
            elif x in self.in_p:  # block 2 as exported
                if x.op == "get_attr":
                    env[x] = get_attr(str(x.target), self.attr(self.g4, x))
                else:
                    env[x] = call(x, inside, x.name, 2, 2)
            elif x.op == "get_attr":  # extrapolated: block 3 becomes block n-1, counters move on
                path = renumbered_leaf(self.reindex(str(x.target), 3, n - 1), extra * self.shift[x])
                env[x] = get_attr(path, state.get(path, self.attr(self.g4, x)))
            else:
                name = _renumber(x.name, _split(x.name)[1] + extra * self.shift[x])
                env[x] = call(x, outside, name, 3, n - 1)
            for j in range(1, extra + 1) if x in self.run_of else ():
                own, prev = copies[j], copies[j - 1]

                def ref(a, own=own, prev=prev):
                    if not isinstance(a, torch.fx.Node):
                        return a
                    if a in self.in_p:
                        return own[a]
                    if a in self.pos["before"]:
                        return prev[self.body[self.pos["before"][a]]]
                    return env[a]

                for y in self.run_of[x]:
                    if y.op == "get_attr":
                        path = renumbered_leaf(self.reindex(str(y.target), 2, 2 + j), j * self.delta[y])
                        value = state.get(path)
                        if value is None:  # a constant the block's code made: one per block
                            value = self.attr(self.g4, y).detach().clone()
                        own[y] = get_attr(path, value)
                    else:
                        own[y] = call(y, ref, _renumber(y.name, _split(y.name)[1] + j * self.delta[y]), 2, 2 + j)
                        templates[own[y].name] = y.name
        in_p = [x for x in self.nodes4 if x in self.in_p]
        blocks = [{y.name: copy[y].name for y in in_p} for copy in copies]
        return Stamped(torch.fx.GraphModule(attrs, graph, self.g4.__class__.__name__), self.stack, templates, blocks)


def _equal(a: Any, b: Any) -> bool:
    """Structural equality of encoded arguments: literals by type and value, nodes by identity."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (torch.fx.Node, type)):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - literals that cannot be compared are taken as different
        return False
