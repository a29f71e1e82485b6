"""What autograd saves in a stamped stack's middle blocks, stamped out instead of run block by block.

:mod:`hidup.frontend.saved` runs the exported step once more on fake tensors to see what every node's backward
keeps.  That run costs ``O(L)`` in the number of layers, as the export did.  A trace whose stack was
stamped (:mod:`hidup.frontend.stamp`) holds block 2 and its copies ``j = 1 .. L-4`` (blocks ``3 .. L-2``), copy
``j`` reading copy ``j-1`` where block 2 reads block 1; :attr:`hidup.frontend.stamp.Stamped.blocks` names each
copy's node per node of block 2 (its ``get_attr`` nodes and ops).  Here copies 0, 1 and 2 run as any
other node does, and the ops of copies ``3 .. L-4`` are not run: their record is copy 2's, renamed.

Storages, relative to a block
-----------------------------
The record of a node reads of its run: the metadata of its output tensors, and per storage its
backward keeps its bytes, dtype, shape and how it relates to the node's inputs and outputs (an alias of
input ``i``, of output ``k``, made from one of them element for element, or made alongside); then,
across the step, which storages are the same (a storage is counted once, by its first saver).  Each
storage a copy's node touches (an output's, a saved one's) is named relative to the copy ``c`` it
runs in: ``own (y, s)`` -- the ``s``-th new storage node ``y`` of block 2's copy made (a ``get_attr``'s
tensor included); ``prev (y, s)`` -- made so by copy ``c - 1``; ``outside K`` -- storage ``K``, made
outside copies 0, 1 and 2 (an input, the rotary tables, a parameter of the embedding); ``far`` --
anything else.  The *description* of copy ``c`` lists, per op, its outputs (named so, with dtype, shape,
stride, offset and ``requires_grad``) and its saved storages (named so, with what the record reads).

When copies 1 and 2 have equal descriptions with no ``far``, copy ``j >= 3`` runs as copy 2 does with
the names read relative to copy ``j``: a fake tensor op's result, and what it packs for its backward,
is a function of its inputs' metadata and of which of its inputs share storage (no data); copy ``j``'s
inputs have copy 2's metadata (the stamp checks every copy's outputs against its template), and
by induction the storages copy ``j`` reads relate as copy 2's do -- its own, copy ``j-1``'s, shared
outside ones -- since copy ``j-1``'s outputs are described as copy 1's.  So copy ``j``'s node ``y``
makes the record of copy 2's ``y`` with every storage renamed::

    own (y, s)  -> copy j's storage (y, s)        (a new storage, or copy j's parameter)
    prev (y, s) -> copy (j-1)'s storage (y, s)
    outside K   -> K

and the step's numbering and ownership (which node saves a storage first, which storages are held)
follow from those names in node order, exactly as for a node that runs.  The nodes after the stack
(block ``L-1``, the head, the loss) run on copy 2's values, which stand for copy ``L-4``'s: a storage
copy 2 or copy 1 made stands for that of copy ``L-4`` or ``L-5`` (``alias``).  Equal descriptions are
checked, not assumed; where they differ, a ``far`` storage appears, or a copy's ``get_attr`` nodes have
not run before copy 3's first op, every copy runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from hidup.fxvalues import dtype_name

__all__ = ["BlockStamper", "FIRST_STAMPED"]

FIRST_STAMPED = 3  # copies 0 .. 2 run: copy 2 reading copy 1 is the template of copy j reading copy j-1


class BlockStamper:
    """Stamps the record of copies ``3 .. L-4`` of block 2 for a :class:`hidup.frontend.saved._SavingInterpreter`
    (module docstring).  ``blocks``: :attr:`hidup.frontend.stamp.Stamped.blocks`."""

    def __init__(self, interp, blocks: list[dict[str, str]]):
        self.interp, self.blocks = interp, blocks
        self.node_named = {n.name: n for n in interp.module.graph.nodes}
        self.where = {name: (j, y) for j, copy in enumerate(blocks) for y, name in copy.items()}
        self.ops = [y for y, name in blocks[0].items() if self.node_named[name].op == "call_function"]
        self.attrs = [y for y, name in blocks[0].items() if self.node_named[name].op == "get_attr"]
        self.stamped = {copy[y] for copy in blocks[FIRST_STAMPED:] for y in self.ops}
        self.last = len(blocks) - 1  # copy L-4, whose values the nodes after the stack read
        self.rel: dict[Any, tuple[int, str, int]] = {}  # storage -> (copy, node of block 2, s): made there
        self.made: list[dict[tuple[str, int], Any]] = [{} for _ in blocks]  # per copy: (y, s) -> storage
        self.known: set = set()  # every storage seen so far
        self.described: dict[int, dict[str, tuple]] = {1: {}, 2: {}}  # copy -> node of block 2 -> description
        self.template: dict[str, tuple[list, list]] = {}  # node y -> copy 2's (outputs, saved facts) of y
        self.active: bool | None = None  # decided at copy 3's first op
        self.left = len(self.stamped)

    # -- nodes that run
    def ran(self, n: torch.fx.Node, leaves: list[torch.Tensor], keys: list, facts: list[tuple]) -> None:
        """Note what node ``n`` made (its output leaves and their storages ``keys``, its saved ``facts``)."""
        touched = keys + [f[0] for f in facts]
        place = self.where.get(n.name)
        if place is None:
            self.known.update(touched)
            return
        j, y = place
        s = 0
        for key in touched:
            if key not in self.known:
                self.known.add(key)
                self.rel[key] = (j, y, s)
                self.made[j][(y, s)] = key
                s += 1
        if j in self.described and n.op == "call_function":
            outputs = tuple(
                (self._name(key, j), dtype_name(t.dtype), tuple(t.shape), _layout(t), t.requires_grad)
                for key, t in zip(keys, leaves)
            )
            self.described[j][y] = (outputs, tuple((self._name(f[0], j), *f[1:]) for f in facts))
            if j == 2:
                self.template[y] = ([(key, dtype_name(t.dtype)) for key, t in zip(keys, leaves)], facts)

    def _name(self, key, copy: int) -> tuple:
        place = self.rel.get(key)
        if place is None:
            return ("outside", key)
        c, y, s = place
        if c == copy:
            return ("own", y, s)
        if c == copy - 1:
            return ("prev", y, s)
        return ("far",)

    # -- nodes that are stamped
    def stamps(self, name: str) -> bool:
        """Whether op ``name`` is stamped instead of run (decided, for all copies, at the first one)."""
        if name not in self.stamped:
            return False
        if self.active is None:
            self.active = self._decide()
        return self.active

    def _decide(self) -> bool:
        one, two = self.described[1], self.described[2]
        if any(y not in one or y not in two for y in self.ops) or one != two:
            return False
        if any(item[0] == ("far",) for described in two.values() for part in described for item in part):
            return False
        env = self.interp.env
        return all(self.node_named[copy[y]] in env for copy in self.blocks[FIRST_STAMPED:] for y in self.attrs)

    def storage(self, j: int, key) -> Any:
        """The storage that copy 2's storage ``key`` names in copy ``j`` (module docstring)."""
        place = self.rel.get(key)
        if place is None or place[0] not in (1, 2):
            return key
        c, y, s = place
        target = j - (2 - c)
        made = self.made[target]
        found = made.get((y, s))
        if found is None:
            found = made[(y, s)] = ("stamped", target, y, s)
        return found

    def stamp(self, n: torch.fx.Node) -> Any:
        """Record op ``n`` of copy ``j >= 3`` from copy 2's; its value is copy 2's (a stand-in)."""
        j, y = self.where[n.name]
        interp = self.interp
        outputs, facts = self.template[y]
        tids = interp.rec.tensor_ids.get(n.name, [])
        interp.outputs(tids, [self.storage(j, key) for key, _ in outputs], [dtype for _, dtype in outputs])
        node = interp.rec.graph_nodes.get(n.name)
        if facts and node is not None and node.op == "call":
            interp.own(node, [(self.storage(j, f[0]), *f[1:]) for f in facts])
        self.left -= 1
        if self.left == 0:  # the nodes after the stack read copy 2's values for copy L-4's
            interp.alias = {key: self.storage(self.last, key) for key, (c, _, _) in self.rel.items() if c in (1, 2)}
        return interp.env[self.node_named[self.blocks[2][y]]]


def _layout(t: torch.Tensor) -> tuple:
    try:
        return tuple(t.stride()), t.storage_offset()
    except RuntimeError:  # a tensor without strides (sparse, nested): described by its shape alone
        return ()
