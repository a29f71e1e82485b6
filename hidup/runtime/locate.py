"""Where a plan first goes wrong: the first op whose forward value differs from one device's.

When ``hidup verify`` finds a difference, every rank runs its program's forward once more and records
the value of each op of the plan (the program's node of that name); the values travel to rank 0, which
rebuilds each op's logical value from the pieces by the form the plan gives it

    gather_d: concatenation of the pieces along d      reduce: their sum
    full / replicate: the piece every rank holds (the ranks must agree)

axis after axis on a device mesh (innermost first), and compares it, op after op in the trace's order,
with the same op of the plan's program for one rank (every form ``full``), run on rank 0:

    rel = max|a - b| / max(max|b|, 1e-30)

The first op above the tolerance is named with its target and the user's source line.  Both sides
draw the random values of step 0 (:mod:`hidup.rules.random`) and run without duplication, so the
values are comparable one to one.  When the forward matches op by op, the difference is in the
backward (a gradient convention, a form change's adjoint) and the report says so.  Values travel
pickled and rank 0 holds every rank's activations: this is a tool for the small models ``verify``
runs, not for a full-size job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx

from hidup import codegen
from hidup.codegen.mesh import coordinates, using_group
from hidup.codegen.program import hidup_tensor_leaves
from hidup.ir import Form, Layout

__all__ = ["Comparison", "first_mismatch"]


class _Recorder(torch.fx.Interpreter):
    """Runs a rank program, keeping the tensors of the nodes named in ``names``."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str]):
        super().__init__(gm)
        self.names, self.values = names, {}

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        if n.name in self.names:
            self.values[n.name] = [t.detach().double().cpu() for t in hidup_tensor_leaves(out)]
        return out


def _forward_values(module, batch, names: set[str]) -> dict[str, list[torch.Tensor]]:
    """Each named op's output tensors (as float64 on the CPU) in one forward of ``module`` at step 0."""
    module.rng_step = 0
    module.begin_step()
    values = module.program_inputs(*batch)
    recorder = _Recorder(module.gm, names)
    with torch.no_grad(), using_group(module.run_group):
        recorder.run(*values)
    return recorder.values


def _join(pieces: list[torch.Tensor], form: Form) -> tuple[torch.Tensor, bool]:
    """One axis's pieces joined by ``form``; the flag says whether ``full`` pieces agreed."""
    if form.is_gather:
        return torch.cat(pieces, form.dim), True
    if form.kind == "reduce":
        return torch.stack(pieces).sum(0), True
    return pieces[0], all(torch.equal(p, pieces[0]) for p in pieces[1:])


def _rebuild(by_rank: list[torch.Tensor], forms: tuple[Form, ...], mesh: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
    """The logical tensor from every rank's piece, innermost axis first (module docstring)."""
    pieces = {coordinates(r, mesh): t for r, t in enumerate(by_rank)}
    agree = True
    for axis in reversed(range(len(mesh))):
        joined = {}
        for prefix in {c[:axis] for c in pieces}:
            value, same = _join([pieces[prefix + (i,)] for i in range(mesh[axis])], forms[axis])
            joined[prefix], agree = value, agree and same
        pieces = joined
    return pieces[()], agree


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


@dataclass(frozen=True)
class Comparison:
    """What :func:`first_mismatch` compares: ``plan`` and ``graph``, the plan's traced step
    (:class:`hidup.ir.Graph`), against ``reference_plan``, a plan of the same step for one rank (needed
    on rank 0 only), both run with the random values of ``seed``; an op differs above ``tolerance``."""

    plan: object
    graph: object
    reference_plan: object
    seed: int = 0
    tolerance: float = 1e-5


def first_mismatch(model_of, batch, comparison: Comparison, rank: int, world: int) -> dict | None:
    """Run on every rank (collective).  ``model_of()`` builds a fresh copy of the model, ``batch`` is the
    global batch and ``comparison`` says what to compare (:class:`Comparison`).  Returns (rank 0)
    ``{"node", "target", "source", "rel", "why"}`` for the first op whose forward value differs, with
    ``"node": None`` when none does; other ranks return None."""
    plan, graph, seed, tolerance = comparison.plan, comparison.graph, comparison.seed, comparison.tolerance
    calls = [n for n in graph.nodes if n.op == "call" and n.name in plan.choices]
    names = {n.name for n in calls}
    module = codegen.compile(model_of(), plan, rank, world, batch, duplication=False, seed=seed)
    mine = _forward_values(module, batch, names)
    singles = [dist.new_group([r]) for r in range(world)]  # the one-rank program runs on a group of its own
    reference = None
    if rank == 0:
        one = codegen.compile(
            model_of(), comparison.reference_plan, 0, 1, batch, duplication=False, seed=seed, group=singles[0]
        )
        reference = _forward_values(one, batch, names)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    mesh = tuple(graph.mesh)
    for node in calls:
        if node.name not in reference or any(node.name not in v for v in everyone):
            continue  # a value without tensors, or an op the program folded away
        for j, form in enumerate(plan.choices[node.name].outputs):
            per_axis = form.forms if isinstance(form, Layout) else (form,)
            value, agree = _rebuild([v[node.name][j] for v in everyone], per_axis, mesh)
            rel = _rel(value, reference[node.name][j])
            if not agree or not rel <= tolerance:
                why = f"the ranks disagree on its replicated output {j}" if not agree else f"its output {j} ({form})"
                return {"node": node.name, "target": node.target, "source": node.source, "rel": rel, "why": why}
    return {"node": None, "why": "the forward matches op by op: the difference is in the backward"}
