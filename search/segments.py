"""Repeated layers: find runs of positions that form identical blocks, so the DP solves one and reuses it.

A position's *block label* is the repeated-layer prefix of its node's module path
(``layers.3.attn.q`` -> ``layers.3``, see :func:`hidup.ir.block_label`); a node without
inputs (parameter, input) takes the label of the node after it (its first consumer).  A block
occurrence is a maximal run of consecutive positions with the same non-empty label.

Two occurrences have the same *type* when their structure is identical position by position: op,
target, where every input comes from (an external tensor, numbered by first use, or an output of
an earlier position of the block), tensor sizes/dtypes/gradient/batch flags, the allowed
signatures with their forms, compute times and memory, the prefetch windows of its gathers
(:mod:`hidup.search.problem`, "Prefetched gathers": the first layer's follow the embedding, not a
layer), and which tensors are still live after the block (the *exit* tensors).  Equal types imply equal
transition costs, so a block's effect depends only on the states of its external inputs (the *entry*):
the DP computes, once per (type, entry), the exit states it can reach and reuses that table for every
occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

from hidup.ir import block_label
from hidup.search.problem import Problem

__all__ = ["Occurrence", "find_blocks"]


@dataclass(frozen=True)
class Occurrence:
    start: int  # first position of the block
    end: int  # one past the last position
    type: int  # index of the block type; occurrences of one type share a table
    label: str
    ext_idx: tuple[int, ...]  # indices in live[start] of the external inputs, in first-use order
    exit_tensors: tuple[int, ...]  # tensor ids of the exit state, in canonical order
    exit_src: tuple[tuple[int, int], ...]  # per entry of live[end]: (0, index in live[start]) or (1, exit index)


def _labels(problem: Problem) -> list[str]:
    labels = [block_label(node.module) if node.inputs else "" for node in problem.order]
    for i in range(problem.n - 1, -1, -1):
        if not problem.order[i].inputs and i + 1 < problem.n:
            labels[i] = labels[i + 1]
    return labels


def _describe(problem: Problem, start: int, end: int):
    """(structural signature, external tensor ids, exit tensor ids) of positions [start, end)."""
    g, cost = problem.graph, problem.cost
    ext: dict[int, int] = {}
    internal: dict[int, tuple[int, int]] = {}
    struct = []

    def tinfo(t: int):
        x = g.tensors[t]
        return (x.shape, x.dtype, x.requires_grad, cost.batch.get(t, False))

    for r, i in enumerate(range(start, end)):
        node = problem.order[i]
        ins = []
        for t in node.inputs:
            if t in internal:
                ins.append(("i",) + internal[t])
            else:
                if t not in ext:
                    ext[t] = len(ext)
                ins.append(("e", ext[t], tinfo(t)))
        for j, t in enumerate(node.outputs):
            internal[t] = (r, j)
        sigs = tuple(
            (
                problem.in_forms[i][k],
                problem.out_forms[i][k],
                problem.compute[i][k],
                problem.mem[i][k],
                problem.sigs[i][k].kind,
            )
            for k in range(len(problem.sigs[i]))
        )
        struct.append(
            (
                node.op,
                node.target,
                tuple(ins),
                tuple(tinfo(t) for t in node.outputs),
                problem.node_batch[i],
                sigs,
                problem.windows[i],  # a prefetched gather's window: the first layer's differs from the others'
                problem.back_windows[i],  # and the last layer's in the backward
            )
        )
    live_end = problem.live[end]
    exits = []
    for t in live_end:
        if t in ext:
            exits.append(((0, ext[t]), t))
        elif t in internal:
            exits.append(((1,) + internal[t], t))
    exits.sort()
    return (tuple(struct), tuple(d for d, _ in exits)), tuple(ext), tuple(t for _, t in exits)


def find_blocks(problem: Problem, min_repeats: int = 2, min_len: int = 2) -> list[Occurrence]:
    """Occurrences of block types that appear at least ``min_repeats`` times, in position order."""
    labels = _labels(problem)
    runs = []
    i = 0
    while i < problem.n:
        j = i
        while j < problem.n and labels[j] == labels[i]:
            j += 1
        if labels[i] and j - i >= min_len:
            runs.append((i, j))
        i = j
    types: dict[tuple, int] = {}
    found = []
    for start, end in runs:
        sig, ext, exit_tensors = _describe(problem, start, end)
        tid = types.setdefault(sig, len(types))
        found.append((start, end, tid, ext, exit_tensors))
    counts: dict[int, int] = {}
    for f in found:
        counts[f[2]] = counts.get(f[2], 0) + 1
    out = []
    for start, end, tid, ext, exit_tensors in found:
        if counts[tid] < min_repeats:
            continue
        li = problem.live_index[start]
        pos_exit = {t: e for e, t in enumerate(exit_tensors)}
        exit_src = tuple((1, pos_exit[t]) if t in pos_exit else (0, li[t]) for t in problem.live[end])
        out.append(Occurrence(start, end, tid, labels[start], tuple(li[t] for t in ext), exit_tensors, exit_src))
    return out
