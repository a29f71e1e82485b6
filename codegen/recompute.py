"""Recomputation: run a layer's forward again in the backward instead of keeping what it saved.

A plan lists in ``plan.recompute`` the repeated layers (block labels such as ``layers.3``,
:func:`hidup.ir.block_label`) whose activations are not kept.  The rank program's nodes of
such a layer -- its ops, the form changes its ops need (a parameter's all-gather included), and the
loss-scaling multiplications of a duplicated copy -- form *regions*: maximal runs of consecutive
generated nodes of one layer, and in a duplicated copy of one plan stage too (duplication
interleaves its copies stage by stage, so a region never spans two stages there; each piece then
keeps its own inputs).  Each region becomes one submodule called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:

* forward: the region runs under ``no_grad``-like bookkeeping: autograd keeps only the region's
  inputs (the tensors it reads from outside: the previous layer's output, the parameters) and the
  random-number state;
* backward: when the first saved tensor of the region is needed, the region's forward runs again
  (its collectives included, in the same order on every rank, so they still match, and on the
  process groups its forward used: a duplicated copy's, or a device mesh's axis groups) and its
  backward proceeds as usual.

The values are identical to the plain program's (same ops, same order, the RNG state replayed), so
losses and gradients match it exactly.  What it costs and saves -- one more forward of the layer,
its communication included, and activation memory down to the regions' inputs plus one region's
activations at a time -- is priced by the search (:mod:`hidup.search.memory`,
:mod:`hidup.search.problem`).

A parameter read by a region enters as one of its inputs (``get_attr`` stays outside), so the
parameters keep their places in the rank module, and a gathered copy of a sharded parameter made
inside the region is freed after the forward and gathered again in the backward.  A node that reads
run-time state of the copy runner (:func:`hidup.codegen.program.hidup_copy_sum`) is never in a region:
the recomputation would not see that state.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.utils.checkpoint

from hidup.codegen.mesh import current_group, using_group

__all__ = ["Recomputed", "outline_regions", "REGION"]

REGION = "recompute_region"  # node.meta key: the region a generated node belongs to (None: none)


class Recomputed(nn.Module):
    """A region of the rank program whose forward runs again in the backward."""

    def __init__(self, region: torch.fx.GraphModule):
        super().__init__()
        self.region = region

    def forward(self, *args):
        if torch.compiler.is_compiling():  # the compiled collectives carry their group's token
            return torch.utils.checkpoint.checkpoint(self.region, *args, use_reentrant=False)
        group = current_group()  # the recomputation, in the backward, communicates on the forward's groups
        return torch.utils.checkpoint.checkpoint(
            self.region,
            *args,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), using_group(group)),
        )


def _runs(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Maximal runs of consecutive nodes with one region key; ``get_attr`` nodes neither join nor
    break a run (they are read as inputs)."""
    runs: list[list[torch.fx.Node]] = []
    key = None
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        k = node.meta.get(REGION)
        if k is None or node.op in ("placeholder", "output"):
            key = None
            continue
        if k != key:
            runs.append([])
            key = k
        runs[-1].append(node)
    return runs


def outline_regions(graph: torch.fx.Graph, root: nn.Module, prefix: str = "recompute") -> int:
    """Replace every region of ``graph`` (nodes tagged ``meta[REGION]``) by a call of a
    :class:`Recomputed` submodule added to ``root``; returns the number of regions.  The call and its
    result unpacking take the region's ``meta["stage"]``."""
    count = 0
    for run in _runs(graph):
        members = set(run)
        if not any(n.op in ("call_function", "call_method", "call_module") for n in run):
            continue
        sub = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[torch.fx.Node] = []

        def arg(n: torch.fx.Node, env=env, inputs=inputs, sub=sub) -> torch.fx.Node:
            if n not in env:
                env[n] = sub.placeholder(f"in_{len(inputs)}")
                inputs.append(n)
            return env[n]

        sub_root = nn.Module()
        for node in run:
            env[node] = sub.node_copy(node, arg)
            if node.op == "call_module":
                sub_root.add_module(node.target, root.get_submodule(node.target))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        sub.output(tuple(env[n] for n in outputs))
        sub.lint()
        name = f"{prefix}_{count}"
        root.add_module(name, Recomputed(torch.fx.GraphModule(sub_root, sub, class_name="Region")))
        stage = run[0].meta.get("stage", 0)
        with graph.inserting_after(run[-1]):
            call = graph.call_module(name, tuple(inputs))
        call.meta["stage"] = stage
        anchor = call
        for j, out in enumerate(outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, j))
            item.meta["stage"] = stage
            out.replace_all_uses_with(item, delete_user_cb=lambda user, members=members: user not in members)
            anchor = item
        for node in reversed(run):
            graph.erase_node(node)
        count += 1
    return count
