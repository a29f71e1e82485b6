"""Peak memory of one rank's program, predicted by running it on fake tensors.

The search's memory model (:mod:`hidup.search.memory`) is a sum of per-node terms, so that the DP
and the ILP can use it: parameters, gradients, the optimizer state and what autograd saves for the
backward. What lives only around an op is not a per-node quantity and is left out: the loss's
gradient of the logits, the buffers of a form change, a backward's temporaries, the weights a
duplicated stage keeps. On one GPU that put measured peaks 12-47% above the model.

This module predicts the peak as the device would see it. The model's parameters, buffers and inputs
are made fake CPU tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes, strides and
storages, no memory; the model is best built on the ``meta`` device, so that no weights are ever
allocated), rank ``r``'s program (:func:`hidup.codegen.compile`) is generated from it, and ``steps``
training steps run exactly as ``hidup train`` and ``hidup bench-rank`` run them
(:class:`hidup.codegen.graphs.GraphedStep` eager: gradients set to None, forward under autocast for
``bf16``, backward, a fused Adam step) under torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``), which follows every storage from its allocation to its
release, and keeps the peak of their sum and its parts at that moment: parameters, gradients,
optimizer state, activations (what autograd keeps for the backward), temporaries. The peak over the
steps is the prediction: the first step has no optimizer state yet, the later ones have it.
Collectives run on torch's fake process group (as in ``hidup bench-rank``): they return tensors of
the right shape and dtype, so the buffers they make are counted.

What this does not see: the caching allocator's rounding of every block to 512 bytes (the tracker
rounds only CUDA storages; a few KiB on a model of hundreds of tensors), memory it holds beyond what
tensors use (fragmentation; ``max_memory_allocated`` does not count it either), kernel workspaces
that do not go through the allocator, and autocast's CUDA policy where it differs from the CPU
policy the fake run follows (it runs on the CPU: no GPU is needed). A program with data-dependent
shapes (a ``nonzero`` whose size depends on values) cannot run on fake tensors without values; that
is refused with one message.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import hidup.models
from hidup.codegen import compile as hidup_compile
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.frontend.export import fake_cpu_like, fake_cpu_stand_ins
from hidup.frontend.trace import forward_inputs
from hidup.plan import Plan
from hidup.runtime.options import add_model_args, build_graph, settle_model
from hidup.search.memory import MEMORY_PARTS, MemoryModel

__all__ = [
    "PeakMemory",
    "PeakError",
    "predict_peak",
    "rank_peak",
    "predicted_memory",
    "peak_parts",
    "add_parser",
    "run",
]

# MemTracker's categories, by the names hidup reports them under (:func:`peak_parts`: looked up at first
# use, since importing torch's MemTracker takes about a second that commands which never track memory skip)
_PART_NAMES = {
    "params": "PARAM",
    "buffers": "BUFFER",
    "grads": "GRAD",
    "optimizer": "OPT",
    "activations": "ACT",
    "temporaries": "TEMP",
    "other": "OTH",
}


def peak_parts() -> dict:
    """Part name -> MemTracker's category of it."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    return {name: getattr(_MemRefType, member) for name, member in _PART_NAMES.items()}


class PeakError(ValueError):
    """The rank program cannot be run on fake tensors (the message says why and what to do)."""


@dataclass(frozen=True)
class PeakMemory:
    """The predicted peak of one rank, in bytes, and what was live at that moment by part."""

    total: float
    parts: dict[str, float]
    rank: int
    precision: str
    duplication: bool
    steps: int

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            **self.parts,
            "rank": self.rank,
            "precision": self.precision,
            "duplication": self.duplication,
            "steps": self.steps,
            "method": "fake-tensor run of the rank program under torch's MemTracker",
        }


@contextlib.contextmanager
def _fake_group(rank: int, world: int):
    """Torch's fake process group as rank ``rank`` of ``world``: one made here (and destroyed after),
    or the one already initialized when it is a fake group of that rank and size."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_rank() != rank or dist.get_world_size() != world:
            raise PeakError(
                f"a process group ({dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}) "
                f"is already initialized here; the peak of rank {rank} of {world} runs on a fake group of its "
                "own. Fix: predict the peak in a process of its own (hidup peak), before training starts"
            )
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def predict_peak(
    model: nn.Module,
    inputs,
    plan,
    rank: int = 0,
    precision: str = "fp32",
    duplication: bool | None = None,
    steps: int = 2,
    lr: float = 1e-4,
) -> PeakMemory:
    """The predicted peak memory of rank ``rank``'s program of ``plan`` (module docstring).

    ``model`` and ``inputs`` are the user's, best built on the ``meta`` device (nothing is allocated;
    a model with real weights works too, its values are not read).  The model's parameters and
    buffers are replaced by fake tensors: pass a model that is not needed afterwards.  ``inputs`` are the forward's
    inputs as :func:`hidup.frontend.trace.forward_inputs` gives them.  ``precision``: ``bf16`` runs the forward
    under autocast, any other the traced dtypes.  ``duplication``: None as the plan says."""
    if steps < 1:
        raise ValueError(f"steps {steps}: at least one training step is needed")
    world = plan.world_size
    with _fake_group(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the user's model becomes fake (its parameters and buffers; nothing is allocated) before the
        # program is generated from it, so that the program's own tensors and hooks are the fake ones
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_cpu_stand_ins(model, fake_mode)  # for good: the model is not needed afterwards
        fake_inputs = [fake_cpu_like(fake_mode, x) if isinstance(x, torch.Tensor) else x for x in inputs]
        module = hidup_compile(
            model, plan, rank, world, fake_inputs, duplication=duplication, device=torch.device("cpu")
        )
        autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        try:
            with fake_mode:
                opt = fused_adam([p for p in module.parameters() if p.requires_grad], lr, "cpu")
                step = GraphedStep(module, fake_inputs, autocast_dtype=autocast_dtype, enabled=False, optimizer=opt)
                tracker.track_external(module, opt)
                with tracker:
                    for _ in range(steps):
                        step(*fake_inputs)
                        tracker.reset_mod_stats()  # per-module statistics only; the peak stays
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise PeakError(
                f"rank {rank}'s program has an op whose output depends on tensor values ({e}); fake tensors "
                "carry no values, so its peak cannot be predicted this way. Fix: measure it on a GPU with "
                "`hidup bench-rank`"
            ) from None
        snapshot = tracker.get_tracker_snapshot("peak")
    device = next((d for d in snapshot if torch.device(d).type == "cpu"), None)
    if device is None:
        raise PeakError(f"rank {rank}'s program allocated nothing the tracker saw; it has no tensors to run")
    peak = snapshot[device]
    parts = {name: float(peak.get(kind, 0)) for name, kind in peak_parts().items()}
    return PeakMemory(float(peak["Total"]), parts, rank, precision, bool(getattr(module, "duplication", False)), steps)


def rank_peak(args, plan, precision: str, duplication: bool | None, steps: int = 2) -> PeakMemory:
    """:func:`predict_peak` of rank ``args.rank`` of the plan's model as the command line names it
    (``args.model``/``args.model_args``): a zoo model built on the meta device, a factory's model
    where the factory puts it (the ranks trace it there, see :func:`hidup.runtime.options.build_graph`)."""
    device = None if hidup.models.is_factory(args.model) else "meta"
    model, inputs = hidup.models.build(args.model, world_size=plan.world_size, device=device, **args.model_args)
    return predict_peak(model, forward_inputs(model, inputs), plan, args.rank, precision, duplication, steps)


def predicted_memory(args, plan, precision: str) -> dict | None:
    """The memory model's bytes per rank of ``plan`` at ``precision`` (module docstring), by part; None
    when the plan's model cannot be traced here."""
    try:
        graph = build_graph(args, "tracing the plan's model for its memory")
    except SystemExit:
        return None
    factor = (getattr(plan, "options", None) or {}).get("optimizer_factor", 2.0)
    model = MemoryModel(
        graph,
        factor,
        "bf16" if precision == "bf16" else "fp32",
        frozenset(plan.recompute),
        frozenset(getattr(plan, "reshard", None) or ()),
    )
    parts = dict.fromkeys(MEMORY_PARTS, 0.0)
    for node in graph.nodes:
        sig = plan.choices.get(node.name)
        if sig is not None and node.op != "output":
            for part, value in zip(MEMORY_PARTS, model.breakdown(node, sig)):
                parts[part] += value
    parts["activations_per_node"] = parts["activations"]
    parts["activations"] = model.plan_activations(plan.choices)
    parts["total"] = sum(parts[p] for p in MEMORY_PARTS)
    return parts


# ---------------------------------------------------------------------------------------- hidup peak
def add_parser(sub) -> None:
    """Register ``hidup peak`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "peak",
        help="predict one rank's peak memory under a plan by running its program on fake tensors (no GPU)",
        description="Predict the peak memory of one rank's program of a saved plan: the program runs a few "
        "training steps on fake tensors (shapes, no memory) while torch's MemTracker follows every tensor. "
        "Printed beside the search's memory model.",
    )
    add_model_args(p, world_default=None)
    g = p.add_argument_group("peak")
    g.add_argument("--plan", type=Path, required=True, help="plan JSON (from hidup search --out)")
    g.add_argument("--rank", type=int, default=0, help="which rank's program (default 0)")
    g.add_argument(
        "--precision",
        choices=("fp32", "tf32", "bf16"),
        default=None,
        help="default: the precision the plan was searched for",
    )
    g.add_argument(
        "--duplication", choices=("plan", "on", "off"), default="plan", help="two half-batch copies as the plan says"
    )
    g.add_argument("--steps", type=int, default=2, help="training steps run (default 2; the peak is over all)")
    g.add_argument("--memory", type=float, default=None, help="GB per GPU: exit 1 when the peak exceeds it")
    g.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")


def _fail(message: str):
    raise SystemExit(f"hidup peak: error: {message}")


def run(args) -> int:
    if not args.plan.is_file():
        _fail(f"no plan file at {args.plan}. Fix: run `hidup search ... --out {args.plan}` first")
    plan = Plan.load(args.plan)
    settle_model(args, plan, args.plan)
    if not 0 <= args.rank < plan.world_size:
        _fail(f"--rank {args.rank} is outside the plan's {plan.world_size} ranks; choose 0..{plan.world_size - 1}")
    if args.steps < 1:
        _fail(f"--steps {args.steps}: at least one step")
    precision = args.precision or (plan.options or {}).get("precision", "fp32")
    duplication = {"on": True, "off": False}.get(args.duplication)
    try:
        peak = rank_peak(args, plan, precision, duplication, args.steps)
    except PeakError as e:
        _fail(str(e))
    modelled = predicted_memory(args, plan, precision) or {}
    gib = 2**30
    print(
        f"rank {args.rank} of {plan.world_size} under {args.plan} ({precision}, duplication "
        f"{'on' if peak.duplication else 'off'}): predicted peak {peak.total / gib:.3f} GiB",
        flush=True,
    )
    print(f"{'part':<12} {'memory model':>14} {'at the peak':>14}")
    for part in ("params", "grads", "optimizer", "activations", "temporaries", "inputs"):
        left = f"{modelled[part] / gib:.3f} GiB" if part in modelled else "-"
        right = f"{peak.parts[part] / gib:.3f} GiB" if part in peak.parts else "-"
        print(f"{part:<12} {left:>14} {right:>14}")
    print(f"{'total':<12} {modelled.get('total', 0) / gib:>10.3f} GiB {peak.total / gib:>10.3f} GiB")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"plan": str(args.plan), "predicted_peak": peak.to_dict(), "memory_model": modelled}, indent=1)
        )
    if args.memory is not None and peak.total > args.memory * 1e9:
        print(f"does not fit {args.memory:g} GB per GPU ({peak.total / 1e9:.2f} GB)", flush=True)
        return 1
    return 0
