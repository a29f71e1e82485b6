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

Selective recomputation
-----------------------
A plan lists in ``plan.recompute_selective`` the layers recomputed *selectively* (torchtitan's
``selective`` activation checkpointing): their regions run under the same checkpoint with
``context_fn=functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
selective_policy)``.  The policy says ``MUST_SAVE`` for the outputs of the ops in :data:`SAVED_OPS` --
the matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, ``convolution``: what
``linear``, ``matmul`` and ``einsum`` dispatch to; the routed experts' op), the attention kernels
(``_scaled_dot_product_*``) and an activation's form change (``hidup::convert_kept``) -- and
``PREFER_RECOMPUTE`` for every other op.  So the forward keeps the region's inputs and those outputs;
the backward runs the region's forward again, in which a saved op returns its saved output instead of
running, and only the cheap ops between them (norms, elementwise ops, softmax, views, casts, dropout's
mask) compute again.  The saved outputs are what the plain program's later ops read anyway (a matmul's
output feeds the activation, the next matmul reads that); :mod:`hidup.search.memory` counts them.

Collectives inside a selective region.  An activation's form change (an all-reduce of a row-parallel
matmul's output, the all-gather of sequence-split activations) is ``hidup::convert_kept``, a
``torch.library`` op of its own name, eager as well as compiled (:mod:`hidup.codegen.compiled`): the policy
saves its output, so the backward's recomputation runs no collective for it -- cheaper than running it
again, for one activation-sized copy.  A parameter's form change (a stored-split weight's all-gather)
is recomputed instead: keeping every gathered weight of the layer would undo what a stored-split plan
saves, so the region gathers it again in the backward, as a whole recomputed layer and resharding do.
Recomputing a collective is allowed: the recomputation runs in the same order on every rank (the
backward's order is the same program on every rank), on the process groups the forward used.  (Eager
collectives write into a buffer the op was handed, which a saved output could not refill: a kept
form change is therefore the functional custom op, never the in-place c10d call.)

Under ``torch.compile`` the same policy tags the traced ops and AOTAutograd's partitioner saves the
``MUST_SAVE`` outputs and recomputes the rest in the backward graph.  Random ops (dropout) are
counter-based (:mod:`hidup.rules.random`) and recomputed with the same key, and the checkpoint replays the
RNG state besides: the values are those of the plain program.

A parameter read by a region enters as one of its inputs (``get_attr`` stays outside), so the
parameters keep their places in the rank module, and a gathered copy of a sharded parameter made
inside the region is freed after the forward and gathered again in the backward.  A node that reads
run-time state of the copy runner (:func:`hidup.codegen.program.hidup_copy_sum`) is never in a region:
the recomputation would not see that state.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import NamedTuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import hidup.rules.experts  # noqa: F401 - registers hidup::routed_experts, which SAVED_OPS names
from hidup.codegen import compiled  # noqa: F401 - registers hidup::convert_kept
from hidup.codegen.mesh import current_group, using_group

__all__ = ["Recomputed", "outline_regions", "REGION", "RegionKey", "SAVED_OPS", "selective_policy"]

REGION = "recompute_region"  # node.meta key: the RegionKey of the region a generated node belongs to (None: none)


class RegionKey(NamedTuple):
    """Which region a generated node belongs to: its layer, its duplication stage, and whether the
    layer is recomputed selectively (module docstring)."""

    layer: str
    stage: int = 0
    selective: bool = False


def _ops(*names: str, namespace=torch.ops.aten) -> frozenset:
    """The ``.default`` overloads of the ops ``names`` that this torch has."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# ops whose outputs a selectively recomputed region saves (module docstring): the matmul kernels, the
# attention kernels, the routed experts and an activation's form change
SAVED_OPS = (
    _ops("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution")
    | _ops(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    | _ops("routed_experts", "convert_kept", namespace=torch.ops.hidup)
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective recomputation's policy: save the outputs of :data:`SAVED_OPS`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_CONTEXT = functools.partial(create_selective_checkpoint_contexts, selective_policy)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def _eager_contexts(group, selective: bool) -> tuple:
    """The checkpoint's (forward, recomputation) contexts of an eager region: the recomputation
    communicates on the forward's groups; a selective region adds torch's caching modes."""
    if not selective:
        return contextlib.nullcontext(), using_group(group)
    forward, again = _SELECTIVE_CONTEXT()
    return forward, _both(again, using_group(group))


class Recomputed(nn.Module):
    """A region of the rank program whose forward runs again in the backward (all of it, or with
    ``selective`` only what :func:`selective_policy` does not save)."""

    def __init__(self, region: torch.fx.GraphModule, selective: bool = False):
        super().__init__()
        self.region, self.selective = region, selective

    def extra_repr(self) -> str:
        return "selective" if self.selective else ""

    def forward(self, *args):
        if torch.compiler.is_compiling():  # the compiled collectives carry their group's token
            extra = {"context_fn": _SELECTIVE_CONTEXT} if self.selective else {}
            return torch.utils.checkpoint.checkpoint(self.region, *args, use_reentrant=False, **extra)
        group = current_group()  # the recomputation, in the backward, communicates on the forward's groups
        return torch.utils.checkpoint.checkpoint(
            self.region,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(_eager_contexts, group, self.selective),
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
        selective = bool(run[0].meta[REGION].selective)
        root.add_module(name, Recomputed(torch.fx.GraphModule(sub_root, sub, class_name="Region"), selective))
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
