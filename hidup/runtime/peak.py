"""Peak memory of one rank's program, predicted by running it on fake tensors.

The search's memory model (:mod:`hidup.search.memory`) is a sum of per-node terms, so that the DP
and the ILP can use it: parameters, gradients, the optimizer state and what autograd saves for the
backward. What lives only around an op is not a per-node quantity: the loss's gradient of the
logits, the buffers of a form change, a backward's temporaries, the weights a duplicated stage keeps.
Without them measured peaks were 12-47% above the model's sum; the model now bounds the peak with its
largest op's temporaries where they occur (:meth:`hidup.search.memory.MemoryModel.plan_peak`, the
figure the search's budget constrains), and this module checks that bound by running the program.

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

A plan whose optimizer is offloaded to the host (``plan.offload``, :mod:`hidup.codegen.offload`) keeps
Adam's state and its copies of the weights in host memory, which a fake run on the CPU cannot tell
from the device's: its program runs without the host copies and steps with stateless SGD, what the
device holds of an offloaded step (the weights, their gradients, the activations and temporaries;
the gradients' copy to the host and the weights' copy back allocate nothing on the device).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import hidup.models
from hidup.codegen import compile as hidup_compile
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.errors import UserError
from hidup.frontend.export import fake_cpu_like, fake_cpu_stand_ins
from hidup.frontend.trace import forward_inputs
from hidup.plan import Plan
from hidup.runtime.options import ModelChoice, ModelRequest, build_graph, settle_model
from hidup.search.memory import MEMORY_PARTS, MemoryModel

__all__ = [
    "PeakMemory",
    "PeakError",
    "predict_peak",
    "rank_peak",
    "predicted_memory",
    "peak_parts",
    "PeakOptions",
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


class PeakError(UserError, ValueError):
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
            model, plan, rank, world, fake_inputs, duplication=duplication, device=torch.device("cpu"), offload="off"
        )
        offloaded = getattr(plan, "offload", "off") != "off"  # the state on the host (module docstring)
        autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        try:
            with fake_mode:
                params = module.optimizer_parameters()
                opt = module.bind_optimizer(
                    torch.optim.SGD(params, lr=lr, foreach=True) if offloaded else fused_adam(params, lr, "cpu")
                )
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


def rank_peak(
    choice: ModelChoice, plan, rank: int, precision: str, duplication: bool | None, steps: int = 2
) -> PeakMemory:
    """:func:`predict_peak` of rank ``rank`` of the plan's model as the command line names it
    (``choice``): a zoo model built on the meta device, a factory's model where the factory puts it
    (the ranks trace it there, see :func:`hidup.runtime.options.build_graph`)."""
    device = None if hidup.models.is_factory(choice.model) else "meta"
    model, inputs = hidup.models.build(choice.model, world_size=plan.world_size, device=device, **choice.model_args)
    return predict_peak(model, forward_inputs(model, inputs), plan, rank, precision, duplication, steps)


def predicted_memory(choice: ModelChoice, plan, precision: str, *, quiet: bool = False) -> dict | None:
    """The memory model's bytes per rank of ``plan`` at ``precision`` (module docstring), by part, with
    its recomputed layers and ZeRO stage, and its peak bound (``peak``, with the largest op's temporaries
    ``transient`` and the prefetched copies ``prefetch``: :meth:`MemoryModel.plan_peak`); None
    when the plan's model cannot be traced here.  ``quiet``: no status lines while it traces."""
    try:
        graph = build_graph(choice, "tracing the plan's model for its memory", quiet=quiet)
    except SystemExit:
        return None
    factor = (getattr(plan, "options", None) or {}).get("optimizer_factor", 2.0)
    model = MemoryModel(
        graph,
        factor,
        "bf16" if precision == "bf16" else "fp32",
        frozenset(plan.recompute),
        frozenset(getattr(plan, "reshard", None) or ()),
        frozenset(getattr(plan, "recompute_selective", None) or ()),
        zero=plan.zero_stage,
        offload=getattr(plan, "offload", "off") != "off",
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
    prefetch = 0.0
    if (getattr(plan, "options", None) or {}).get("prefetch", True):
        prefetch = model.plan_prefetched(plan.choices, model.reshard)
    # the peak bound (the largest op's temporaries where the activations live then), what the budget constrains
    parts.update(model.plan_peak(plan.choices, parts, prefetch), prefetch=prefetch)
    return parts


# ---------------------------------------------------------------------------------------- hidup peak
@dataclass(frozen=True)
class PeakOptions:
    """What ``hidup peak`` predicts (the flags of the same names; :mod:`hidup.cli.peak_flags`): rank
    ``rank``'s program of the plan file ``plan`` (its model as ``model`` asks, checked against the
    plan's record) at ``precision`` (None: the plan's), ``duplication`` ``"plan"``, ``"on"`` or
    ``"off"``, over ``steps`` training steps; ``memory`` GB per GPU that the peak must fit (None: no
    check); ``out`` a JSON file for the figures."""

    plan: Path
    model: ModelRequest = field(default_factory=ModelRequest)
    rank: int = 0
    precision: str | None = None
    duplication: str = "plan"
    steps: int = 2
    memory: float | None = None
    out: Path | None = None


def _fail(message: str):
    raise SystemExit(f"hidup peak: error: {message}")


def run(opts: PeakOptions) -> int:
    """``hidup peak``: print the predicted peak beside the memory model's figures; 1 when it does not
    fit ``memory``."""
    if not opts.plan.is_file():
        _fail(f"no plan file at {opts.plan}. Fix: run `hidup search ... --out {opts.plan}` first")
    plan = Plan.load(opts.plan)
    choice = settle_model(opts.model, plan, opts.plan)
    if not 0 <= opts.rank < plan.world_size:
        _fail(f"--rank {opts.rank} is outside the plan's {plan.world_size} ranks; choose 0..{plan.world_size - 1}")
    if opts.steps < 1:
        _fail(f"--steps {opts.steps}: at least one step")
    precision = opts.precision or (plan.options or {}).get("precision", "fp32")
    duplication = {"on": True, "off": False}.get(opts.duplication)
    try:
        peak = rank_peak(choice, plan, opts.rank, precision, duplication, opts.steps)
    except PeakError as e:
        _fail(str(e))
    modelled = predicted_memory(choice, plan, precision) or {}
    gib = 2**30
    print(
        f"rank {opts.rank} of {plan.world_size} under {opts.plan} ({precision}, duplication "
        f"{'on' if peak.duplication else 'off'}): predicted peak {peak.total / gib:.3f} GiB",
        flush=True,
    )
    print(f"{'part':<12} {'memory model':>14} {'at the peak':>14}")
    for part in ("params", "grads", "optimizer", "activations", "temporaries", "inputs"):
        left = f"{modelled[part] / gib:.3f} GiB" if part in modelled else "-"
        right = f"{peak.parts[part] / gib:.3f} GiB" if part in peak.parts else "-"
        print(f"{part:<12} {left:>14} {right:>14}")
    print(f"{'total':<12} {modelled.get('total', 0) / gib:>10.3f} GiB {peak.total / gib:>10.3f} GiB")
    if "peak" in modelled:
        print(
            f"{'peak':<12} {modelled['peak'] / gib:>10.3f} GiB {peak.total / gib:>10.3f} GiB   (the memory model's "
            f"bound: its largest op's temporaries, {modelled['peak_transient'] / gib:.3f} GiB, where they peak)"
        )
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(
            json.dumps({"plan": str(opts.plan), "predicted_peak": peak.to_dict(), "memory_model": modelled}, indent=1)
        )
    if opts.memory is not None and peak.total > opts.memory * 1e9:
        print(f"does not fit {opts.memory:g} GB per GPU ({peak.total / 1e9:.2f} GB)", flush=True)
        return 1
    return 0
