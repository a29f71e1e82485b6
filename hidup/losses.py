"""Losses whose normalizer depends on the data, rewritten so that the normalizer is a value of its own.

``cross_entropy(x, t, reduction="mean", ignore_index=i)`` (and ``nll_loss``) divides the summed loss
by the number of counted targets, ``n = #{t != i}``, which depends on the labels: under data
parallelism or duplication each rank and each copy holds a different share of the counted tokens,
so no fixed scale of a local mean is exact.  This pass rewrites every such call, before the graph
is annotated, into

    s = cross_entropy(x, t, reduction="sum", ignore_index=i, label_smoothing=ls)
    n = sum(t != i)
    loss = s / n

which is the same number (PyTorch's mean with ``ignore_index`` and label smoothing divides by
exactly that count).  Now the rules see a sum (shardable over the sample dims, giving ``reduce``),
a count (another sum, ``reduce``) and a division whose divisor must be ``full``: the search brings
``n`` to ``full`` with one scalar all-reduce, so ``s_r / n`` on rank r sums over ranks to the mean
over the *global* count.  Duplication's two copies sum their counts before dividing
(:mod:`hidup.copies`).  Calls with class weights (the divisor is a sum of weights) are left as
they are: their rule keeps them whole on every rank, which is exact.

Both front ends are covered: ``F.cross_entropy`` / ``F.nll_loss`` nodes of a torch.fx trace and
``aten.cross_entropy_loss`` / ``aten.nll_loss(_nd)`` nodes of an export.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["explicit_normalizers"]

aten = torch.ops.aten

# target -> (argument names in order, how "mean" is spelled, how "sum" is spelled)
_LOSSES = {
    F.cross_entropy: (
        ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"],
        "mean",
        "sum",
    ),
    F.nll_loss: (["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"], "mean", "sum"),
    aten.cross_entropy_loss.default: (
        ["self", "target", "weight", "reduction", "ignore_index", "label_smoothing"],
        1,
        2,
    ),
    aten.nll_loss.default: (["self", "target", "weight", "reduction", "ignore_index"], 1, 2),
    aten.nll_loss_nd.default: (["self", "target", "weight", "reduction", "ignore_index"], 1, 2),
}
_DEFAULTS = {"weight": None, "size_average": None, "reduce": None, "ignore_index": -100, "label_smoothing": 0.0}


def _bound(node: torch.fx.Node, names: list[str], mean) -> dict | None:
    if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
        return None
    b = dict(_DEFAULTS, reduction=mean)
    b.update(zip(names, node.args))
    b.update(node.kwargs)
    return b


def explicit_normalizers(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see module docstring); returns how many losses were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LOSSES:
            continue
        names, mean, total = _LOSSES[node.target]
        b = _bound(node, names, mean)
        if (
            b is None
            or b["reduction"] != mean
            or b["weight"] is not None
            or b["size_average"] is not None
            or b["reduce"] is not None
        ):
            continue
        args = list(node.args) + [b[n] for n in names[len(node.args) :]]
        args[names.index("reduction")] = total
        for legacy in ("size_average", "reduce"):
            if legacy in names:
                args[names.index(legacy)] = None
        target = b[names[1]]
        where = node
        made = []
        for target_fn, fn_args in (
            (node.target, tuple(args)),
            (torch.ne, (target, b["ignore_index"])),
            (torch.sum, None),
            (torch.div, None),
        ):
            if fn_args is None:  # sum(counted), then div(summed, n)
                fn_args = (made[1],) if target_fn is torch.sum else (made[0], made[2])
            with gm.graph.inserting_after(where):
                where = gm.graph.call_function(target_fn, fn_args, {})
            where.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            made.append(where)
        loss = made[-1]
        node.replace_all_uses_with(loss)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
