"""Duplication: two half-batch copies of a rank's program, interleaved so that one copy's
communication overlaps the other's computation.

Splitting.  A batch input of ``M`` rows along its batch dim is cut into two copies by viewing the
rows as ``[blocks, 2, M / (2 blocks)]`` and taking index ``c`` of the middle axis, with
``blocks = N`` for a global input and ``blocks = 1`` for a local input that is already this rank's
slice along the batch dim (on a device mesh, ``blocks = N / P`` for a local input whose layout cuts
the batch dim into ``P`` pieces: it holds ``N / P`` consecutive blocks).  Both views select the same
rows of the global batch, so a module fed the global batch and one fed local batches run identical
copies, and copy ``c`` on rank ``r``
receives exactly rank ``r``'s share of copy ``c``'s half of the global batch.  Each copy is the
plan's program traced at half the global batch, adjusted by :mod:`hidup.copies` so that its loss is
its *part* of the whole batch's loss (means over the batch halved, label counts summed across the
copies), whatever the loss -- sum, mean, or mean over a masked count; so ``loss = loss_copy0 +
loss_copy1`` equals the loss of the whole batch and one backward over the sum yields the same
gradients.  A model whose loss is not such a sum runs one copy (:func:`hidup.codegen.compile` warns).

Scheduling.  On CPU the copies run one after the other (``streams=True`` runs the CUDA schedule
below without streams, to test it).  On CUDA the program is split at the
plan's stage boundaries (``node.meta["stage"]``) and the stages run in lockstep: stage ``s`` of copy
0 on stream 0, then stage ``s`` of copy 1 on stream 1, and so on.  Each copy communicates on its own
process group, so the NCCL calls of the two copies never interleave on one communicator, and the
GPU overlaps copy 0's collectives with copy 1's kernels.  Autograd runs every backward op on the
stream of its forward op, so the backward interleaves the same way.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from hidup.codegen.compiled import compile_module
from hidup.codegen.prefetch import confine_links
from hidup.codegen.program import using_group

__all__ = ["half", "copy_inputs", "SequentialCopies", "StagedCopies"]


def half(x: torch.Tensor, dim: int, copy: int, blocks: int) -> torch.Tensor:
    """Copy ``copy`` (0 or 1) of ``x`` along ``dim`` (see module docstring)."""
    m = x.shape[dim]
    if m % (2 * blocks):
        raise ValueError(
            f"duplication splits dim {dim} of an input of shape {tuple(x.shape)} into 2 x {blocks} "
            f"blocks, which does not divide {m}; use a batch that is a multiple of {2 * blocks} "
            f"or turn duplication off"
        )
    return (
        x.unflatten(dim, (blocks, 2, m // (2 * blocks))).select(dim + 1, copy).flatten(dim, dim + 1).contiguous()
        if blocks > 1
        else x.narrow(dim, copy * (m // 2), m // 2)
    )


def copy_inputs(values: list, batch_dims: list, blocks: list[int], copy: int) -> list:
    """Copy ``copy``'s inputs; ``batch_dims[i]`` None (or a non-tensor input) passes it unchanged."""
    return [
        half(v, d, copy, b) if isinstance(v, torch.Tensor) and d is not None else v
        for v, d, b in zip(values, batch_dims, blocks)
    ]


class SequentialCopies:
    """Run the copies one after the other (CPU, or CUDA without streams)."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.run = gm

    def compile(self, backend: str | None) -> None:
        """Run the program through ``torch.compile(backend=...)`` (None: eagerly)."""
        if backend is not None:
            confine_links(self.gm, lambda node: 0)  # one graph (but for its breaks)
        self.run = self.gm if backend is None else compile_module(self.gm, backend)

    def __call__(self, inputs_of, groups):
        """``inputs_of(c)``: copy ``c``'s inputs; ``groups``: each copy's process group."""
        total = None
        for c, group in enumerate(groups):
            with using_group(group):
                loss = self.run(*inputs_of(c))
            total = loss if total is None else total + loss
        return total


class StagedCopies:
    """Run the copies stage by stage on two CUDA streams (see module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device):
        stages = {n.meta.get("stage", 0) for n in gm.graph.nodes}
        self.num_stages = len(stages)
        order = {s: i for i, s in enumerate(sorted(stages))}

        def partition(node):
            users = list(node.users)
            stage = node.meta.get("stage")
            if stage is None and users:
                stage = min(u.meta.get("stage", 0) for u in users)
            return order.get(stage if stage is not None else 0, 0)

        confine_links(gm, partition)  # a compiled stage waits only for its own prefetched gathers

        self.split = split_module(gm, gm, partition, keep_original_order=True) if self.num_stages > 1 else gm
        self.device = device
        self.compiled: dict[str, object] = {}  # stage submodule -> its torch.compile'd callable
        self.cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)] if self.cuda else None
        if self.cuda:
            # Both copies feed the same parameters from different streams by design, so the
            # gradient accumulation of a parameter always meets one foreign stream; autograd
            # synchronizes it correctly and would otherwise warn on every step.
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)

    def compile(self, backend: str | None) -> None:
        """Run each stage through its own ``torch.compile(backend=...)`` (None: eagerly); the stage
        runner, its streams and process groups stay as they are."""
        self.compiled = {}
        if backend is None:
            return
        if self.num_stages == 1:
            self.compiled[""] = compile_module(self.split, backend)
            return
        for node in self.split.graph.nodes:
            if node.op == "call_module":
                self.compiled[node.target] = compile_module(self.split.get_submodule(node.target), backend)

    def _on(self, c: int):
        return torch.cuda.stream(self.streams[c]) if self.cuda else contextlib.nullcontext()

    def __call__(self, inputs_of, groups):
        """``inputs_of(c)``: copy ``c``'s inputs, made on copy ``c``'s stream.  A half that is a new
        tensor (a global input's rows gathered by :func:`half`) is then allocated on the stream that
        reads it, in the forward and, saved for it, in the backward: made on the calling stream, it
        would return to that stream's pool when the backward frees it, while the copy stream's
        kernels reading it may not have run yet, and the next allocation there (a gradient bucket,
        say) could overwrite it first."""
        if self.num_stages == 1:
            single = SequentialCopies(self.split)
            single.run = self.compiled.get("", self.split)
            return single(inputs_of, groups)
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            for s in self.streams:
                s.wait_stream(main)
        envs = [{}, {}]
        results = [None, None]
        graph = self.split.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for c in (0, 1):
            with self._on(c):
                values = inputs_of(c)
            for ph, value in zip(placeholders, values):
                envs[c][ph] = value
        for node in graph.nodes:
            if node.op == "placeholder":
                continue
            for c in (0, 1):
                env = envs[c]
                load = env.__getitem__
                args = torch.fx.node.map_arg(node.args, load)
                kwargs = torch.fx.node.map_arg(node.kwargs, load)
                if node.op == "output":
                    results[c] = args[0]
                    continue
                with self._on(c), using_group(groups[c]):
                    if node.op == "call_module":
                        run = self.compiled.get(node.target)
                        run = self.split.get_submodule(node.target) if run is None else run
                        env[node] = run(*args, **kwargs)
                    elif node.op == "call_function":
                        env[node] = node.target(*args, **kwargs)
                    elif node.op == "get_attr":
                        env[node] = operator.attrgetter(node.target)(self.split)
                    else:
                        raise RuntimeError(f"unexpected node {node.op} in the staged program")
        if self.cuda:
            for s in self.streams:
                main.wait_stream(s)
            for c in (0, 1):
                results[c].record_stream(main)
        return results[0] + results[1]
