"""Train a model under a plan: ``hidup train`` and ``exp/train.py``.

The model is a zoo model or the user's ``package.module:function`` (:mod:`hidup.models.source`);
with ``--plan`` it is the model the plan records, so no model flags are needed, and the plan's world
size is the job's (a launch of another size is refused before any rank starts).  Each rank builds
the same model (same seed, so the same weights), compiles it for its rank under the plan (loaded
with ``--plan`` or searched on the spot), and runs ``--iterations`` optimizer steps on a
deterministic stream of global batches: step ``t`` always sees the same batch, and dropout draws step
``t``'s values (:mod:`hidup.rules.random`), so a run resumed from a checkpoint continues the loss curve
of an uninterrupted one exactly.  Batches are shaped like the
example inputs: floating-point inputs are standard normal; integer inputs are uniform in
``[0, vocab)`` for zoo language models (``[0, num_classes)`` for class labels) and, for a factory's
model, in ``[0, max + 1)`` with ``max`` the example input's largest entry -- an input with negative
entries (labels padded with -100) or of dtype bool, and anything that is not a tensor, is passed as
the example holds it.

With ``--compile`` the rank program runs through ``torch.compile`` (:mod:`hidup.codegen.compiled`):
``on`` compiles it with inductor and prints the time of the compiling step, ``auto`` does so on GPUs
only and keeps it when a short trial (:func:`hidup.codegen.trial.choose_compile`, after the
duplication trial, steps captured as CUDA graphs when they will be) shows compiled steps faster.  A
compiled module is warmed up and then captured by the CUDA-graph step like an eager one.  On GPUs
Adam is the fused kernel; when steps are captured, its step is captured with them (one graph per
step: forward, backward, update), unless ``--clip`` or fp16's loss scaler must see the gradients
between backward and update, which then run as separate steps after the replay.

Reported per run (rank 0): the loss of every step (the true global loss: the sum over ranks of the
local ``reduce``-form losses), the iteration time as mean ± std over the last ``--last-k`` steps,
tokens (or images) per second, and the peak memory of the device.

Checkpoints (``--checkpoint-dir``/checkpoint: each rank writes its own shards, atomically; a run
resumes from one on any world size or plan; ``--keep-checkpoints K`` keeps the K - 1 before it as
``checkpoint.step-<N>``) are taken every ``--checkpoint-every``
steps and when the process receives SIGTERM or SIGUSR1; on SIGTERM the run then says where it
saved and exits with status 143 (128 + SIGTERM, as a process ended by the signal), so that a
scheduler requeues it.  The signal flag is combined across ranks with a max-all-reduce each step, so
every rank saves at the same step.  A non-finite loss stops every rank before that step's update is
saved, and a checkpoint already in ``--checkpoint-dir`` is continued (``--resume``) or replaced
(``--overwrite``) only when asked.

Structure: the command line (:mod:`hidup.cli.train_flags`) makes a :class:`TrainOptions`; :func:`run`
settles the model (:func:`hidup.runtime.options.settle_model`) and launches the ranks, and each rank
runs a :class:`Trainer`, which holds the rank's module, optimizer, data, precision and checkpoint
state and runs the steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

import hidup.models
import hidup.profiler
from hidup import codegen
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.codegen.offload import host_adam
from hidup.codegen.timing import Stopwatch, max_over_ranks
from hidup.codegen.trial import choose_compile, compile_step
from hidup.frontend.trace import trace
from hidup.ir import OFFLOAD_CHOICES, ZERO_CHOICES
from hidup.optionset import OptionSet
from hidup.plan import Plan, PlanError
from hidup.precision import check_reduce_dtype
from hidup.rules.dispatch import host_synchronizes
from hidup.runtime import checkpoint
from hidup.runtime.data import StdlibCorpus
from hidup.runtime.launch import Distributed, LaunchOptions, launch, layout_from_env
from hidup.runtime.options import (
    DEFAULT_PROFILE,
    CommandError,
    ModelChoice,
    ModelRequest,
    check_plan_fits,
    mesh_phrase,
    settle_model,
)
from hidup.search import search

__all__ = ["TrainOptions", "Trainer", "batch_at", "check_run_options", "run", "run_rank"]


@dataclass(frozen=True)
class TrainOptions(OptionSet):
    """What ``hidup train`` runs (the flags of the same names; :mod:`hidup.cli.train_flags`).

    ``model`` the model asked for (settled by :func:`run`); ``plan`` a plan file (None: search one
    now with ``profile``); ``duplication`` ``"auto"``, ``"plan"``, ``"on"`` or ``"off"``;
    ``iterations`` optimizer steps, the time reported over the ``last_k`` after ``warmup``; ``lr``,
    ``optimizer`` (``"adam"`` or ``"sgd"``), ``clip`` the global gradient norm (None: none); ``zero``
    the ZeRO stage of the replicated weights, ``"auto"`` (the plan's, or the search's when searching
    now), ``"off"``, ``"1"`` or ``"2"`` (:mod:`hidup.codegen.zero`); ``offload`` where Adam's state lives,
    ``"auto"`` (the plan's, or the search's), ``"off"`` or ``"optimizer"`` (the host, :mod:`hidup.codegen.offload`);
    ``precision`` (fp32, tf32, bf16, fp16); ``reduce_dtype`` the dtype the weights' gradients are summed
    in, ``"auto"`` (the plan's; fp32 when searching now), ``"fp32"`` or ``"bf16"`` (bf16 autocast only,
    :mod:`hidup.precision`); ``cuda_graphs`` and ``compile`` ``"auto"``, ``"on"`` or
    ``"off"``; ``data`` ``"synthetic"`` or ``"stdlib"``; ``seed`` of the weights, data and dropout;
    ``chrome_trace`` a folder for a trace of 3 steps per rank; ``checkpoint_dir`` (None: none),
    ``checkpoint_every`` K steps (0: only on a signal), ``keep_checkpoints``, ``resume``,
    ``overwrite``; ``stop_after`` steps of this invocation (None: all); ``json`` rank 0's results file;
    ``launch`` how the ranks start.  A frozen dataclass: it travels to the ranks pickled."""

    model: ModelRequest = field(default_factory=ModelRequest)
    plan: Path | None = None
    profile: str = DEFAULT_PROFILE
    duplication: str = "auto"
    iterations: int = 20
    warmup: int = 3
    last_k: int = 10
    lr: float = 1e-4
    optimizer: str = "adam"
    clip: float | None = None
    zero: str = "auto"
    offload: str = "auto"
    precision: str = "fp32"
    reduce_dtype: str = "auto"
    cuda_graphs: str = "auto"
    compile: str = "auto"
    data: str = "synthetic"
    seed: int = 0
    chrome_trace: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 1
    resume: bool = False
    overwrite: bool = False
    stop_after: int | None = None
    json: Path | None = None
    launch: LaunchOptions = field(default_factory=lambda: LaunchOptions(announce=True))
    WHAT = "train"

    def captures(self, cuda: bool) -> bool:
        """Whether steps are captured as CUDA graphs (``cuda_graphs``; fp16's loss scaler reads the
        gradients on the host every step, so auto leaves it eager)."""
        if self.cuda_graphs == "auto":
            return cuda and self.precision != "fp16"
        return self.cuda_graphs == "on"


class _Signals:
    """Remember SIGTERM/SIGUSR1 until the end of the current step."""

    def __init__(self):
        self.save = False
        self.stop = False
        for sig, stop in ((signal.SIGTERM, True), (getattr(signal, "SIGUSR1", None), False)):
            if sig is not None:
                with contextlib.suppress(ValueError):  # not the main thread
                    signal.signal(sig, self._handler(stop))

    def _handler(self, stop: bool):
        def handle(signum, frame):
            self.save = True
            self.stop = self.stop or stop

        return handle

    def agreed(self, device) -> tuple[bool, bool]:
        save, stop = max_over_ranks([float(self.save), float(self.stop)], None, device)
        return bool(save), bool(stop)


def batch_at(example_inputs, step: int, seed: int, cfg, data) -> tuple:
    """The global batch of ``step``: deterministic in (seed, step), shaped like the example inputs
    (``cfg`` is the zoo configuration, None for a factory's model; the module docstring gives the
    value ranges)."""
    if data is not None:
        return data.batch_at(step)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = []
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool:
            out.append(x)
        elif x.dtype.is_floating_point or x.dtype.is_complex:
            out.append(torch.randn(x.shape, generator=g, dtype=x.dtype))
        elif cfg is not None:
            high = getattr(cfg, "vocab", 2) if i == 0 or x.dim() > 1 else getattr(cfg, "num_classes", 2)
            out.append(torch.randint(0, high, x.shape, generator=g, dtype=x.dtype))
        elif x.numel() and int(x.min()) < 0:
            out.append(x.clone())
        else:
            high = int(x.max()) + 1 if x.numel() else 1
            out.append(torch.randint(0, high, x.shape, generator=g, dtype=x.dtype))
    return tuple(out)


def _to(values, device) -> tuple:
    """``values`` with every tensor moved to ``device``."""
    return tuple(x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x for x in values)


def _recompute_text(plan) -> str:
    layers = getattr(plan, "recompute", None) or []
    selective = getattr(plan, "recompute_selective", None) or []
    params = getattr(plan, "reshard", None) or []
    return (
        (f", {len(layers)} layers recomputed in the backward" if layers else "")
        + (f", {len(selective)} layers recomputed selectively" if selective else "")
        + (f", {len(params)} parameters resharded after forward" if params else "")
    )


# --zero -> hidup.compile's zero (None: the plan's)
ZERO_STAGE = {choice: None if choice == "auto" else 0 if choice == "off" else int(choice) for choice in ZERO_CHOICES}


def _reduce_request(opts: TrainOptions) -> str | None:
    """``--reduce-dtype`` as :func:`hidup.compile`'s ``reduce_dtype`` (None: the plan's)."""
    return None if opts.reduce_dtype == "auto" else opts.reduce_dtype


def _zero_text(plan, opts: TrainOptions) -> str:
    stage = ZERO_STAGE[opts.zero]
    if stage is None:
        stages = sorted(set((getattr(plan, "zero", None) or {}).values()))
        return f", ZeRO-{'/'.join(map(str, stages))} (the plan's)" if stages else ""
    return f", ZeRO-{stage}" if stage else ""


def _zero_on(opts: TrainOptions, plan: Plan) -> bool:
    stage = ZERO_STAGE[opts.zero]
    return bool(getattr(plan, "zero", None)) if stage is None else bool(stage)


def _offload_request(opts: TrainOptions) -> str | None:
    """``--offload`` as :func:`hidup.compile`'s ``offload`` (None: the plan's)."""
    return None if opts.offload == "auto" else opts.offload


def _offload_on(opts: TrainOptions, plan: Plan) -> bool:
    return (getattr(plan, "offload", "off") if opts.offload == "auto" else opts.offload) != "off"


def _capturable(opts: TrainOptions, plan: Plan) -> bool:
    """Whether the plan's step can be captured as one CUDA graph: not when a node reads split sizes on
    the host (the routed experts' all-to-all dispatcher), nor with ZeRO (its optimizer steps slices and
    all-gathers them after the step, which the captured step does not hold yet), nor with the optimizer
    offloaded (its copies and the CPU's step are host work); ``--cuda-graphs on`` then stops with the fix."""
    if _offload_on(opts, plan):
        if opts.cuda_graphs == "on":
            raise SystemExit(
                "--cuda-graphs on: with the optimizer offloaded to the host each step copies the gradients there, "
                "steps on the CPU and copies the weights back, host work a CUDA graph cannot hold. Fix: "
                "--cuda-graphs auto or off, or --offload off"
            )
        return False
    if _zero_on(opts, plan):
        if opts.cuda_graphs == "on":
            raise SystemExit(
                "--cuda-graphs on: with ZeRO the optimizer steps each rank's rows and all-gathers them after "
                "the step, which a captured step does not hold yet. Fix: --cuda-graphs auto or off, or --zero off"
            )
        return False
    syncing = sorted(name for name, sig in plan.choices.items() if host_synchronizes(sig))
    if not syncing:
        return True
    if opts.cuda_graphs == "on":
        raise SystemExit(
            f"--cuda-graphs on: the plan's routed experts {', '.join(syncing[:3])}"
            f"{' ...' if len(syncing) > 3 else ''} dispatch tokens by all-to-all, which reads split sizes on the "
            "host, so the step cannot be captured. Fix: --cuda-graphs auto or off (the search priced this "
            "plan uncaptured), or a plan searched for experts dispatched by all-gather"
        )
    return False


class Trainer:
    """One rank's training run under :class:`TrainOptions` (module docstring), in the spirit of
    torchtitan's ``Trainer``: :meth:`setup` builds the rank's model, data, plan, compiled module,
    optimizer and precision state and resumes from a checkpoint; :meth:`train_step` runs one optimizer
    step; :meth:`save_checkpoint` writes one; :meth:`run` does it all and returns the run's results
    (rank 0 prints them).  ``choice`` is the model :func:`run` settled."""

    def __init__(self, ctx: Distributed, opts: TrainOptions, choice: ModelChoice):
        self.ctx, self.opts, self.choice = ctx, opts, choice
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device
        self.cuda = self.device.type == "cuda"
        self.ckpt_path = opts.checkpoint_dir / "checkpoint" if opts.checkpoint_dir else None
        # made by setup(): the model and its example inputs, the zoo configuration (None for a factory's
        # model), the data (None: synthetic batches), the plan, the rank's module and its trial, the
        # optimizer, fp16's loss scaler, the autocast dtype, whether steps are captured (and the update
        # with them), the compile setting, and the step resumed at
        self.model = self.inputs = self.cfg = self.data = self.plan = None
        self.module = self.opt = self.scaler = self.autocast_dtype = None
        self.trial, self.compiled = {}, {}
        self.use_graph = self.opt_in_graph = False
        self.start = 0
        self.graphed = None  # the captured step, made at the first step when steps are captured
        self.step, self.done, self.losses, self.times = 0, 0, [], []  # step: optimizer steps taken in all
        self.stopped_by = None
        self.profiler = None

    # ------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything before the first step: precision, model and data, plan, compiled module,
        optimizer, the compile setting, and the checkpoint resumed from."""
        if self.opts.precision == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._build_model()
        self.plan = self._plan_for()
        self.model = self.model.to(self.device)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.opts.precision)
        self.use_graph = self.opts.captures(self.cuda) and _capturable(self.opts, self.plan)
        self._compile_module()
        self._make_optimizer()
        self.compiled = self._settle_compile()
        self._resume()

    def _build_model(self) -> None:
        """The model (the same weights on every rank: same seed), its example inputs, the zoo
        configuration (None for a factory's model) and the data (None: synthetic batches)."""
        opts, choice = self.opts, self.choice
        zoo = not hidup.models.is_factory(choice.model)
        self.cfg = hidup.models.config(choice.model, world_size=self.world, **choice.model_args) if zoo else None
        self.model, self.inputs = hidup.models.build(
            choice.model, world_size=self.world, seed=opts.seed, **choice.model_args
        )
        self.data = None
        if opts.data == "stdlib":
            if not zoo:
                raise SystemExit(
                    f"--data stdlib feeds the zoo's language models; {choice.model} gets synthetic batches "
                    "shaped like its example inputs (leave out --data)"
                )
            if getattr(self.cfg, "vocab", 0) < 256 or self.inputs[0].dtype.is_floating_point:
                raise SystemExit("--data stdlib needs a language model with --vocab >= 256")
            self.data = StdlibCorpus(self.inputs[0].shape[0], self.inputs[0].shape[1])

    def _plan_for(self):
        """The plan: loaded from ``--plan``, or searched now."""
        opts = self.opts
        if opts.plan is not None:
            return Plan.load(opts.plan)
        graph = trace(self.model, self.inputs, world_size=self.world, half_batch=True, mesh=self.choice.mesh)
        return search(
            graph,
            hidup.profiler.load(opts.profile),
            world_size=self.world,
            duplication=opts.duplication != "off",
            precision=opts.precision,
            cuda_graphs=opts.captures(torch.cuda.is_available()),
            zero=opts.zero,
            offload=opts.offload,
            reduce_dtype="fp32" if opts.reduce_dtype == "auto" else opts.reduce_dtype,
        )

    def batch(self, step: int) -> tuple:
        """The global batch of ``step`` (:func:`batch_at`), on the rank's device."""
        return _to(batch_at(self.inputs, step, self.opts.seed, self.cfg, self.data), self.device)

    def _compile_module(self) -> None:
        """The rank's module: with ``--duplication auto`` on GPUs and more than one rank, the faster of
        duplication on and off by a trial (:func:`hidup.codegen.choose_duplication`); else as asked."""
        opts, mode = self.opts, self.opts.duplication
        self.trial = {}
        if mode == "auto" and self.cuda and self.world > 1:
            self.module, self.trial = codegen.choose_duplication(
                self.model,
                self.plan,
                self.rank,
                self.world,
                self.batch(0),
                cuda_graphs=self.use_graph,
                autocast_dtype=self.autocast_dtype,
                seed=opts.seed,
                zero=ZERO_STAGE[opts.zero],
                reduce_dtype=_reduce_request(opts),
                offload=_offload_request(opts),
            )
            if self.rank == 0:
                print(self.trial["reason"], flush=True)
        else:
            duplication = {"on": True, "off": False}.get(mode)  # plan / auto off the GPU: as the plan says
            self.module = codegen.compile(
                self.model,
                self.plan,
                self.rank,
                self.world,
                _to(self.inputs, self.device),
                duplication=duplication,
                seed=opts.seed,
                zero=ZERO_STAGE[opts.zero],
                reduce_dtype=_reduce_request(opts),
                offload=_offload_request(opts),
            )

    def _make_optimizer(self) -> None:
        """The optimizer (fused Adam on GPUs; over each rank's rows of the weights ZeRO splits, and bound to
        all-gather them after each step), fp16's loss scaler, and whether the update joins the captured
        step."""
        opts, device = self.opts, self.device
        params = self.module.optimizer_parameters()
        if self.module.offload is not None and opts.precision == "fp16":
            raise SystemExit(
                "--precision fp16 with the optimizer offloaded: the loss scaler unscales the gradients the "
                "optimizer holds before its step, and they reach the host only inside it. Fix: --precision bf16, "
                "or --offload off"
            )
        if opts.optimizer == "adam" and self.module.offload is not None:
            self.opt = host_adam(params, opts.lr)  # the host's copies, stepped on the CPU
        elif opts.optimizer == "adam" and self.cuda:
            self.opt = fused_adam(params, opts.lr, device)
        elif opts.optimizer == "adam":
            self.opt = torch.optim.Adam(params, lr=opts.lr)
        else:
            self.opt = torch.optim.SGD(params, lr=opts.lr, momentum=0.9)
        self.module.bind_optimizer(self.opt)
        self.scaler = torch.amp.GradScaler(device.type) if opts.precision == "fp16" else None
        if self.use_graph and not self.cuda:
            raise SystemExit("--cuda-graphs on needs GPUs (this run is on the CPU); use --cuda-graphs auto or off")
        if self.use_graph and self.scaler is not None:
            raise SystemExit(
                "--cuda-graphs on does not combine with --precision fp16 (the loss scaler inspects the "
                "gradients on the host every step); use bf16, or --cuda-graphs off"
            )
        # the update joins the captured step when nothing must see the gradients in between
        self.opt_in_graph = self.use_graph and opts.optimizer == "adam" and opts.clip is None and self.scaler is None

    def _settle_compile(self) -> dict:
        """Settle ``--compile`` on the module (:mod:`hidup.codegen.compiled`): ``{"compile": bool,
        "compile_s": seconds of the compiling step or None, "trial": {...}}``; rank 0 prints what it did."""
        mode, module = self.opts.compile, self.module
        if mode == "off" or (mode == "auto" and not self.cuda):
            return {"compile": False, "compile_s": None, "trial": {}}
        batch = self.batch(0)
        if mode == "auto":
            info = choose_compile(
                module, batch, cuda_graphs=self.use_graph, autocast_dtype=self.autocast_dtype, group=module.group
            )
            if self.rank == 0:
                print(info["reason"], flush=True)
            return info
        module.set_compile(True)
        seconds = compile_step(module, batch, autocast_dtype=self.autocast_dtype, graphed=self.use_graph)
        if self.rank == 0:
            print(
                f"compiled the rank program with inductor in {seconds:.1f} s (the first forward + backward)",
                flush=True,
            )
        return {"compile": True, "compile_s": seconds, "trial": {}}

    def _resume(self) -> None:
        """With ``--resume``, the module's and optimizer's state, the step and the losses of the
        checkpoint in ``--checkpoint-dir``."""
        opts, path = self.opts, self.ckpt_path
        self.start = 0
        if not opts.resume:
            return
        earlier = [
            p for p in ((path, opts.checkpoint_dir / "checkpoint.pt") if path else ()) if checkpoint.exists(p)
        ]  # checkpoint.pt: the single file that earlier versions wrote
        if not earlier:
            raise SystemExit(f"--resume: no checkpoint at {path}; give --checkpoint-dir of an earlier run")
        state = checkpoint.load(earlier[0], self.module, self.opt)
        self.start, self.losses = state["step"], list(state["loss_history"])

    def _print_header(self) -> None:
        """Rank 0: the run's header, and what it will do first."""
        opts = self.opts
        if self.use_graph:
            steps = "CUDA graph" + (" if faster than eager (auto)" if opts.cuda_graphs == "auto" else "")
        else:
            steps = "eager"
        on_mesh = mesh_phrase(getattr(self.plan, "mesh", None))
        print(
            f"train {self.choice.model}: world {self.world}{on_mesh} ({self.ctx.backend}), plan "
            f"{opts.plan or 'searched now'}, duplication "
            f"{'on' if getattr(self.module, 'duplication', False) else 'off'} ({opts.duplication}), steps {steps}"
            f"{_recompute_text(self.plan)}{_zero_text(self.plan, opts)}"
            f"{', optimizer offloaded to the host' if self.module.offload is not None else ''}"
            f"{', gradients reduced in bf16' if self.module.program.reduce_dtype == 'bf16' else ''}",
            flush=True,
        )
        print(
            f"nothing left to run: {'the checkpoint is at' if opts.resume else 'already at'} step {self.start} of "
            f"--iterations {opts.iterations}"
            if self.start >= opts.iterations
            else f"running steps {self.start + 1}..{opts.iterations}; the first includes warm-up and can take a while",
            flush=True,
        )

    # ------------------------------------------------------------------------------------------ steps
    def _capture(self, batch) -> None:
        """Warm up and capture the step as a CUDA graph (once); rank 0 prints the step mode."""
        self.graphed = GraphedStep(
            self.module,
            batch,
            autocast_dtype=self.autocast_dtype,  # warm-up + capture, once
            choose=self.opts.cuda_graphs == "auto",
            group=self.module.group,
            optimizer=self.opt if self.opt_in_graph else None,
        )
        if self.rank == 0:
            timing = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.graphed.timings.items())
            print(f"step mode: {self.graphed.mode}" + (f" (trial: {timing})" if timing else ""), flush=True)

    def _forward_backward(self, batch):
        """The step's loss, its gradients computed (replayed, when captured)."""
        if self.graphed is not None:
            return self.graphed(*batch)
        cast = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=cast) if cast else contextlib.nullcontext():
            loss = self.module(*batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        return loss

    def _update(self) -> None:
        """Clip, step the optimizer (unless the captured step ran it) and drop the gradients."""
        if self.opts.clip is not None:
            codegen.clip_grad_norm_(self.module, self.opts.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        elif self.graphed is None or self.graphed.optimizer is None:
            self.opt.step()  # else the graphed step ran it
        self.opt.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)  # ZeRO-1's whole gradients, which the optimizer does not hold

    def train_step(self, batch) -> float:
        """One optimizer step on ``batch`` (timed; the first captures the step when steps are
        captured); the global loss, checked to be finite."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.use_graph and self.graphed is None:
            self._capture(batch)
        self.module.rng_step = self.step  # dropout draws this step's values, resumed or not (hidup.rules.random)
        with Stopwatch(self.device) as watch:
            loss = self._forward_backward(batch)
            self._update()
        self.times.append(watch.seconds)
        total = float(self.module.global_loss(loss))
        _check_finite(total, self.step + 1, self.ckpt_path, self.opts.lr)
        return total

    def save_checkpoint(self) -> None:
        """Write the rank's shards of the module and optimizer, the step and the losses."""
        checkpoint.save(
            self.ckpt_path,
            self.module,
            self.opt,
            step=self.step,
            loss_history=self.losses,
            keep=self.opts.keep_checkpoints,
        )

    def _after_step(self, signals: _Signals) -> bool:
        """Checkpoint when due (every ``--checkpoint-every`` steps, on a signal, at a stop, at the
        end); whether to stop now (SIGTERM, ``--stop-after``)."""
        opts = self.opts
        save, stop = signals.agreed(self.device)
        self.stopped_by = "SIGTERM" if stop and self.step < opts.iterations else None
        stop = stop or (opts.stop_after is not None and self.done >= opts.stop_after)
        periodic = opts.checkpoint_every and self.step % opts.checkpoint_every == 0
        if self.ckpt_path is not None and (periodic or save or stop or self.step == opts.iterations):
            self.save_checkpoint()
            signals.save = False
        return stop

    def _start_profiler(self) -> None:
        if self.opts.chrome_trace is not None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=3, repeat=1))
            self.profiler.start()

    def _stop_profiler(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.opts.chrome_trace.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.opts.chrome_trace / f"trace_rank{self.rank}.json"))

    def train(self) -> None:
        """The steps from the one resumed at to ``--iterations`` (or a stop)."""
        signals = _Signals()
        self._start_profiler()
        self.step, self.done = self.start, 0
        while self.step < self.opts.iterations:
            total = self.train_step(self.batch(self.step))
            self.losses.append(total)
            self.step += 1
            self.done += 1
            if self.profiler is not None:
                self.profiler.step()
            if self.rank == 0:
                print(f"step {self.step:5d}  loss {total:.6g}  {self.times[-1] * 1e3:8.2f} ms", flush=True)
            if self._after_step(signals):
                break
        self._stop_profiler()

    # ---------------------------------------------------------------------------------------- results
    def _timed(self) -> list[float]:
        """The step times reported: the last ``--last-k`` after ``--warmup``."""
        warmup = self.opts.warmup
        timed = self.times[warmup:] if len(self.times) > warmup else self.times
        return timed[-self.opts.last_k :]

    def result(self) -> dict:
        """The run's results (module docstring)."""
        timed, inputs = self._timed(), self.inputs
        is_lm = inputs[0].dim() >= 2 and not inputs[0].is_floating_point()  # the first input is a tensor (traced)
        tokens_per_step = math.prod(inputs[0].shape[:2]) if is_lm else inputs[0].shape[0]
        graphed, compiled = self.graphed, self.compiled
        return {
            "model": self.choice.model,
            "world": self.world,
            "rank": self.rank,
            "steps": self.step,
            "losses": self.losses,
            "iteration_s_mean": statistics.fmean(timed) if timed else None,
            "iteration_s_std": statistics.pstdev(timed) if len(timed) > 1 else 0.0,
            "iteration_s_median": statistics.median(timed) if timed else None,
            "tokens_per_s": tokens_per_step / statistics.median(timed) if timed else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.cuda else None,
            "duplication": bool(getattr(self.module, "duplication", False)),
            "zero": sorted({z.stage for z in self.module.zero.slices.values()}),  # the ZeRO stages run
            "offload": "optimizer" if self.module.offload is not None else "off",
            "precision": self.opts.precision,
            "reduce_dtype": self.module.program.reduce_dtype,
            "cuda_graph": graphed is not None and graphed.graph is not None,
            "step_mode_trial": graphed.timings if graphed is not None else {},
            "duplication_trial": self.trial.get("trial", {}),
            "compile": compiled["compile"],
            "compile_s": compiled["compile_s"],
            "compile_trial": compiled["trial"],
            "plan_predicted_s": (getattr(self.plan, "predicted", None) or {}).get("total"),
            "stopped_by": self.stopped_by,
        }

    def _report(self, result: dict) -> None:
        """Rank 0: why the run stopped early, the iteration time, and the ``--json`` file."""
        opts, timed = self.opts, self._timed()
        if self.rank != 0:
            return
        if self.stopped_by is not None:
            where = (
                f"checkpoint saved in {opts.checkpoint_dir}; continue with --resume"
                if self.ckpt_path is not None
                else "nothing saved (no --checkpoint-dir)"
            )
            print(f"stopped by {self.stopped_by} after step {self.step}: {where}", flush=True)
        if timed:
            inputs = self.inputs
            unit = "tokens" if inputs[0].dim() >= 2 and not inputs[0].is_floating_point() else "samples"
            mem = f", peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB" if self.cuda else ""
            print(
                f"iteration time {result['iteration_s_mean'] * 1e3:.2f} ± {result['iteration_s_std'] * 1e3:.2f} ms "
                f"(last {len(timed)}), {result['tokens_per_s']:.0f} {unit}/s{mem}",
                flush=True,
            )
        if opts.json is not None:
            opts.json.parent.mkdir(parents=True, exist_ok=True)
            opts.json.write_text(json.dumps(result, indent=1))

    def run(self) -> dict:
        """Set up, train and report; the run's results."""
        self.setup()
        if self.rank == 0:
            self._print_header()
        self.train()
        result = self.result()
        self._report(result)
        return result


def run_rank(ctx: Distributed, opts: TrainOptions, choice: ModelChoice) -> dict:
    """One rank's training run (a :class:`Trainer`); global rank 0 holds the checkpoint folder's lock
    while it runs."""
    lock = checkpoint.FolderLock(opts.checkpoint_dir) if ctx.rank == 0 and opts.checkpoint_dir else None
    try:
        if lock is not None:
            lock.acquire()
    except checkpoint.CheckpointBusy as e:
        raise SystemExit(str(e)) from None
    try:
        return Trainer(ctx, opts, choice).run()
    finally:
        if lock is not None:
            lock.release()


def _check_finite(loss: float, step: int, ckpt_path: Path | None, lr: float) -> None:
    """Stop every rank (each sees the same global loss) at a non-finite loss, before the step's update
    can reach a checkpoint: the last one written stays the last good one."""
    if math.isfinite(loss):
        return
    kept = f"the checkpoint in {ckpt_path.parent} is kept as it was" if ckpt_path is not None else "no checkpoint"
    raise SystemExit(
        f"step {step}: the loss is {loss}; training stops before this step's update is saved ({kept}). "
        f"Fix: a smaller --lr than {lr:g}, --clip, or bf16 instead of fp16; resume with --resume"
    )


def check_run_options(opts: TrainOptions) -> None:
    """Refuse, before any rank starts, what would fail or lose work later: a learning rate that is not a
    positive number, a --checkpoint-dir that is a file, cannot be written or is in use by another job
    (:class:`~hidup.runtime.checkpoint.FolderLock`), and a checkpoint already there that neither
    --resume (continue it) nor --overwrite (replace it) says what to do with."""
    if opts.zero not in ZERO_CHOICES:
        raise CommandError(f"--zero {opts.zero}: choose one of {', '.join(ZERO_CHOICES)}")
    if opts.offload not in OFFLOAD_CHOICES:
        raise CommandError(f"--offload {opts.offload}: choose one of {', '.join(OFFLOAD_CHOICES)}")
    if opts.reduce_dtype != "auto":
        check_reduce_dtype(opts.reduce_dtype, opts.precision)
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise CommandError(f"--lr {opts.lr}: the learning rate must be a positive number")
    if opts.resume and opts.overwrite:
        raise CommandError("--resume continues the checkpoint and --overwrite replaces it: give one")
    if opts.keep_checkpoints < 1:
        raise CommandError(f"--keep-checkpoints {opts.keep_checkpoints}: keep at least the last checkpoint (1)")
    folder = opts.checkpoint_dir
    if folder is None:
        if opts.resume:
            raise CommandError("--resume needs --checkpoint-dir, the folder of the run to continue")
        return
    if folder.exists() and not folder.is_dir():
        raise CommandError(f"--checkpoint-dir {folder} is a file, not a folder. Fix: name a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hidup-write-check-"):
            pass
    except OSError as e:
        raise CommandError(
            f"--checkpoint-dir {folder} cannot be written ({e.strerror or e}). Fix: a folder this user can write"
        ) from None
    try:
        checkpoint.FolderLock(folder).probe()
    except checkpoint.CheckpointBusy as e:
        raise CommandError(str(e)) from None
    found = [p for p in (folder / "checkpoint", folder / "checkpoint.pt") if checkpoint.exists(p)]
    if found and not (opts.resume or opts.overwrite):
        raise CommandError(
            f"--checkpoint-dir {folder} holds a checkpoint ({found[0].name}) that this run would replace. "
            "Fix: --resume to continue it, --overwrite to start afresh over it, or another --checkpoint-dir"
        )


def run(opts: TrainOptions) -> int:
    """Settle the model (the plan's record, or the flags) and the world size, then launch the ranks.
    A plan for another world size than the launch's, or for another model, and options that would fail
    or lose work later (:func:`check_run_options`), are refused here, before any rank starts."""
    check_run_options(opts)
    plan = Plan.load(opts.plan) if opts.plan is not None else None
    choice = settle_model(opts.model, plan, opts.plan)
    if plan is not None:
        check_plan_fits(choice, plan, opts.plan)
    starts = opts.launch
    launched = starts.cpn is not None or "CPN" in os.environ or "RANK" in os.environ
    if plan is not None and launched:
        layout = layout_from_env(nnodes=starts.nnodes, cpn=starts.cpn, node_rank=starts.node_rank)
        if layout.world_size != plan.world_size:
            raise PlanError(
                f"{opts.plan} was searched for {plan.world_size} ranks but this launch has "
                f"{layout.world_size} ({layout.source}: NNODES x CPN, or WORLD_SIZE). Fix: launch "
                f"{plan.world_size} ranks, or search again for {layout.world_size}"
            )
    if choice.world is not None and not launched and (plan is not None or opts.model.world is not None):
        starts = replace(starts, cpn=choice.world, nnodes=1, node_rank=0)  # one node, --world processes
    results = launch(run_rank, opts, choice, options=starts)
    # a scheduler's SIGTERM (to the launcher or the whole group): the run saved and stopped early, and
    # exits as a process ended by SIGTERM does, so that the scheduler requeues it rather than marks it done
    stopped = any(isinstance(r, dict) and r.get("stopped_by") == "SIGTERM" for r in results)
    return 128 + signal.SIGTERM if stopped else 0
