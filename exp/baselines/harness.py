"""Baseline harness: one train loop for DDP, FSDP2, expert parallelism and the single-device floor,
each in the variants a performance engineer would try, all timed by :mod:`timing`.

Every baseline trains the same model (``hidup.models.build``, same seed, same synthetic batch,
reused every step) with fused Adam (baseline_util.make_adam).  Rank ``r`` of ``N`` runs groups
``r B/N .. (r+1) B/N - 1`` of the global batch ``B = batch_per_gpu * N``; ``single`` runs rank 0's
share alone.

Variants (:data:`VARIANTS`):

* ``eager``: the module as is, every op dispatched from Python;
* ``compile``: ``torch.compile`` of the model (where each baseline applies it: see its module);
* ``graph``: the whole step -- forward, backward, the gradient glue and the optimizer step
  (capturable fused Adam), the gradients None at the capture -- captured once as one CUDA graph and
  replayed (:class:`CapturedStep`, :data:`STEP_CONSTRUCTION`); CUDA only, skipped elsewhere
  (recorded as skipped);
* ``compile-graph``: the compiled model, its whole step captured the same way.

A variant that fails (an error at build, compile, capture or step) is recorded with its error;
a method reports its fastest variant that ran (exp/benchrun.py).

Timing (:func:`timing.time_steps`, shared with hidup's runs): ``warmup`` untimed steps, then the
best of ``best_of`` windows of ``N`` steps between two device syncs, per-step time
``(t_end - t_start) / N``, max over ranks.  Throughput:

    tokens/s  = B * tokens_per_group / t        (single: batch_per_gpu groups)
    samples/s = B / t

The loss of step ``i`` is the global loss ``L(i) = sum_r w_r L_r(i)`` (baseline_util: ``w_r = 1`` for
the zoo's summed loss), equal to the single-device loss of the whole batch.  Peak memory is the
maximum over ranks of ``torch.cuda.max_memory_allocated`` (``None`` on a CPU).

Command line (spawns the ranks on this host; or use torchrun / NODERANK+CPN)::

    python exp/baselines/harness.py --baseline ddp --model bert-sgmoe --world 2 --layers 2 --variant compile

One rank on one device (``--fake-world``, as ``hidup bench-rank`` runs hidup's ranks): rank 0 of the
world-``N`` baseline runs in this process on torch's fake process group, whose collectives return
tensors of the right shape without communicating.  What is timed is the rank's compute (its share of
the batch, its FSDP shards and expert slice, the buckets and copies around its collectives); the
losses are not the model's (the collectives' values are not real)::

    python exp/baselines/harness.py --baseline fsdp --world 4 --fake-world --precision bf16 --variant compile-graph
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hidup.models
from exp.baselines.baseline_util import Options, loss_form_of, loss_weight, make_adam, set_loss_weight
from exp.baselines.timing import time_steps
from hidup.cli.config_file import apply_config_file
from hidup.cli.launch_flags import add_launch_args, launch_kwargs
from hidup.cli.model_flags import add_model_args, model_overrides, model_request
from hidup.runtime.data import rank_share
from hidup.runtime.launch import launch, layout_from_env
from hidup.runtime.options import settle_model

BASELINES = ("ddp", "fsdp", "expert", "single")
PRECISIONS = ("fp32", "tf32", "bf16")
VARIANTS = ("eager", "compile", "graph", "compile-graph")


@dataclass
class RunSpec:
    """What to run; identical on every rank."""

    baseline: str
    model: str = "bert-sgmoe"
    world: int = 2
    overrides: dict = field(default_factory=dict)
    warmup: int = 3
    iters: int = 10
    lr: float = 1e-4
    seed: int = 0
    precision: str = "fp32"
    variant: str = "eager"
    best_of: int = 1
    compile_backend: str = "inductor"
    fake_world: bool = False  # rank 0 alone, on torch's fake process group (module docstring)

    def __post_init__(self):
        if self.baseline not in BASELINES:
            raise ValueError(f"unknown baseline {self.baseline!r}; choose one of {', '.join(BASELINES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.world < 1 or self.iters < 1 or self.warmup < 0 or self.best_of < 1:
            raise ValueError(
                f"need world >= 1, iters >= 1, warmup >= 0, best_of >= 1; got world={self.world}, "
                f"iters={self.iters}, warmup={self.warmup}, best_of={self.best_of}"
            )


# ------------------------------------------------------------------------------------ precision
def autocast(precision: str, device: torch.device, cache_enabled: bool = True):
    """bf16 autocast for ``precision == "bf16"``; fp32 and tf32 run without autocast.  A step captured
    as a CUDA graph needs ``cache_enabled=False``."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()


def autocast_dtype(precision: str):
    """The autocast dtype of ``precision`` (None: no autocast)."""
    return torch.bfloat16 if precision == "bf16" else None


@contextlib.contextmanager
def precision_mode(precision: str, device: torch.device):
    """TF32 matmuls and convolutions on for ``tf32``, off otherwise (inductor and a graph capture
    read the setting when they build their kernels, so it wraps building as well as stepping)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------------------------------------------ variants
def variant_options(variant: str, precision: str, compile_backend: str = "inductor") -> Options:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return Options(
        compile="compile" in variant, graph="graph" in variant, precision=precision, compile_backend=compile_backend
    )


def variant_skip(variant: str, device: torch.device) -> str | None:
    """Why ``variant`` cannot run on ``device`` (None when it can)."""
    if "graph" in variant and torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device; the {variant} variant is skipped on {torch.device(device).type}"
    return None


def prepare_variant(
    baseline: str,
    model,
    rank: int,
    world: int,
    device: torch.device,
    share: tuple,
    variant: str = "eager",
    precision: str = "fp32",
    compile_backend: str = "inductor",
    loss_form=None,
):
    """``baseline``'s :class:`baseline_util.Prepared` for ``variant``, its loss weight set from this
    rank's input ``share`` (``single``: one device, weight 1).  ``model`` is converted in place."""
    form = loss_form if loss_form is not None else loss_form_of(model)
    opts = variant_options(variant, precision, compile_backend)
    module = importlib.import_module(f"exp.baselines.{baseline}")
    if baseline == "single":
        prepared = module.prepare(model, 0, 1, device, opts)
        return set_loss_weight(prepared, 1.0, 1)
    weight = loss_weight(form, share, world, device)
    prepared = module.prepare(model, rank, world, device, opts)
    prepared.info["loss_form"] = form.kind
    return set_loss_weight(prepared, weight, world)


# ------------------------------------------------------------------------------------ steps
# What every method's step is, hidup's and each baseline's alike (exp/benchrun.py records it with each
# run, and tests/test_baselines.py fails if a step is built otherwise): the gradients are None when a
# step is captured, so autograd writes them fresh inside the graph (as `hidup train`'s GraphedStep
# does) rather than accumulating into buffers zeroed in place; the optimizer step is inside the
# captured graph; and the statistic is the best of ``best_of`` windows of ``iters`` steps between two
# device syncs (:func:`timing.time_steps`), the max over ranks.
STEP_CONSTRUCTION = {
    "grads_at_capture": "none",
    "optimizer": "in the captured graph",
    "statistic": "best window mean (timing.time_steps), max over ranks",
}


def step_once(
    prepared, optimizer, inputs: tuple, precision: str, device: torch.device, *, in_graph: bool = False
) -> torch.Tensor:
    """Forward under the precision's autocast, backward of ``loss * loss_scale``, the method's
    gradient glue, the optimizer step; the loss, detached.  Eagerly the gradients are set to None
    first, so autograd writes them fresh.  ``in_graph`` (the body of a CUDA graph, whose caller set
    the gradients to None before the capture): nothing is zeroed, since each replay writes the
    gradients the capture allocated, and autocast's weight-cast cache is off (a cached cast would be
    captured stale)."""
    if not in_graph:
        optimizer.zero_grad(set_to_none=True)
    with autocast(precision, device, cache_enabled=not in_graph):
        loss = prepared.module(*inputs)
    (loss * prepared.loss_scale if prepared.loss_scale != 1.0 else loss).backward()
    if prepared.after_backward is not None:
        prepared.after_backward()
    optimizer.step()
    return loss.detach()


class EagerStep:
    """One optimizer step per call: gradients set to None, forward (under the precision's autocast),
    backward of ``loss * loss_scale``, the method's gradient glue, the optimizer step.  Returns the
    loss (detached, on the device).  A prepared run with a captured step (``prepared.graphed``, a
    :class:`hidup.codegen.GraphedStep`) replays it instead; when the optimizer joined that capture
    (``graphed.optimizer``, as ``hidup train`` captures it) the replay is the whole step."""

    def __init__(self, prepared, optimizer, inputs: tuple, precision: str, device: torch.device):
        self.prepared, self.optimizer, self.inputs = prepared, optimizer, tuple(inputs)
        self.precision, self.device = precision, device
        self.setup_losses: list[torch.Tensor] = []  # no steps before the first call

    def construction(self) -> dict:
        """How this step is built (:data:`STEP_CONSTRUCTION`'s keys), read from the objects."""
        graphed = getattr(self.prepared, "graphed", None)
        if graphed is None or graphed.mode != "graph":
            return dict(STEP_CONSTRUCTION, grads_at_capture="not captured", optimizer="eager")
        optimizer = "in the captured graph" if graphed.optimizer is not None else "eager, after the replay"
        return dict(STEP_CONSTRUCTION, grads_at_capture=graphed.grads_at_capture, optimizer=optimizer)

    def __call__(self) -> torch.Tensor:
        p = self.prepared
        graphed = getattr(p, "graphed", None)
        if graphed is None:
            return step_once(p, self.optimizer, self.inputs, self.precision, self.device)
        loss = graphed(*self.inputs)
        if p.after_backward is not None:
            p.after_backward()
        if graphed.optimizer is None:
            self.optimizer.step()
        return loss.detach()


@contextlib.contextmanager
def warmup_mask_path():
    """Inside a CUDA-graph capture, ``transformers`` models build their attention masks as in the warm-up.

    ``transformers`` counts a stream capture as tracing (``utils.import_utils.is_cuda_stream_capturing``)
    and then materializes the causal mask it skips otherwise, so a model whose root module runs
    eagerly (FSDP2 compiles each block) hands its compiled blocks a mask they never saw: they compile
    again inside the capture, which fails.  The steps here pass no attention mask (every sequence
    full), where the skipped mask is exact and needs no device read, so the capture takes the
    warm-up's path.  Nothing changes for a model without ``transformers``."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    original = getattr(import_utils, "is_cuda_stream_capturing", None)
    if original is None:
        yield
        return
    import_utils.is_cuda_stream_capturing = lambda: False
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = original


class CapturedStep:
    """The whole step of :class:`EagerStep` -- forward, backward, gradient glue, capturable optimizer
    step -- captured once as one CUDA graph and replayed per call.

    Construction runs ``prepared.capture_warmup`` eager steps on a side stream (the optimizer state,
    NCCL communicators, DDP's buckets and any compilation come into being there; their losses are
    ``setup_losses``, real steps), sets the gradients to None, then captures one step without running
    it: autograd allocates the gradients inside the capture, every replay writes them, and the
    optimizer step in the same graph reads them (:data:`STEP_CONSTRUCTION`).  Each call replays the
    graph (one real step on the fixed ``inputs``) and returns its loss."""

    def __init__(self, prepared, optimizer, inputs: tuple, precision: str, device: torch.device):
        self.require_cuda(device)
        self.prepared, self.optimizer, self.inputs = prepared, optimizer, tuple(inputs)
        self.precision, self.device = precision, device
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")  # eager steps of a capturable Adam
            self.setup_losses = [self._eager() for _ in range(max(1, prepared.capture_warmup))]
        main.wait_stream(side)
        torch.cuda.synchronize(device)
        optimizer.zero_grad(set_to_none=True)
        params = [q for group in optimizer.param_groups for q in group["params"]]
        self.grads_at_capture = "none" if all(q.grad is None for q in params) else "allocated"
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), warmup_mask_path():
            self._static_loss = step_once(
                self.prepared, self.optimizer, self.inputs, self.precision, self.device, in_graph=True
            )
        torch.cuda.synchronize(device)

    @staticmethod
    def require_cuda(device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"a CUDA-graph step needs a CUDA device, not {device}")

    def _eager(self) -> torch.Tensor:
        """One eager step as the graph runs it (autocast's cache off), gradients set to None first."""
        self.optimizer.zero_grad(set_to_none=True)
        return step_once(self.prepared, self.optimizer, self.inputs, self.precision, self.device, in_graph=True)

    def construction(self) -> dict:
        """How this step is built (:data:`STEP_CONSTRUCTION`'s keys), read from the objects."""
        return dict(STEP_CONSTRUCTION, grads_at_capture=self.grads_at_capture)

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self._static_loss.clone()

    def release(self) -> None:
        """Free the graph (before any process group it uses is destroyed)."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None


def make_step(prepared, inputs: tuple, precision: str, device: torch.device, lr: float, capture: bool = False):
    """(the step callable, the optimizer's description): fused Adam over the module's parameters and
    an :class:`EagerStep`, or a :class:`CapturedStep` when ``capture``."""
    made = getattr(prepared, "optimizer", None)  # the optimizer a GraphedStep captured (exp/benchrun.py)
    optimizer, described = made if made is not None else make_adam(prepared.module.parameters(), lr, capturable=capture)
    step = (CapturedStep if capture else EagerStep)(prepared, optimizer, inputs, precision, device)
    return step, described


def train_step(prepared, optimizer, inputs: tuple, precision: str, device: torch.device) -> torch.Tensor:
    """One optimizer step of a prepared method (:class:`EagerStep`); returns the local loss, detached."""
    return EagerStep(prepared, optimizer, inputs, precision, device)()


def run_variant(
    prepared,
    inputs: tuple,
    precision: str,
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    best_of: int = 1,
    cap_s: float | None = None,
    lr: float = 1e-4,
    capture: bool = False,
    coupled: bool = True,
    phase=None,
    after=None,
) -> dict:
    """Build the step of ``prepared`` and time it (:func:`timing.time_steps`).  Returns the timing
    and ``losses``: the global loss of every step (``sum_r w_r L_r`` over the ranks when ``coupled``,
    this rank's own loss otherwise), setup steps of a capture first; and ``optimizer``.
    ``after(step)``, when given, runs after the timing (e.g. one more step, traced); its steps are
    not in ``losses``."""
    phase = phase or (lambda name: None)
    with precision_mode(precision, device):
        if capture:
            phase("capture")
        step, described = make_step(prepared, inputs, precision, device, lr, capture=capture)
        try:
            out = time_steps(step, device, warmup=warmup, iters=iters, best_of=best_of, cap_s=cap_s, phase=phase)
            if after is not None:
                after(step)
        finally:
            if isinstance(step, CapturedStep):
                step.release()
    losses = torch.stack(list(step.setup_losses) + out.pop("losses")).to(torch.float64) * prepared.loss_weight
    if coupled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = device if dist.get_backend() == "nccl" else "cpu"
        losses = losses.to(on)
        dist.all_reduce(losses)
    out["losses"] = losses.tolist()
    out["setup_steps"] = len(step.setup_losses)
    out["optimizer"] = described
    out["step_construction"] = step.construction()
    return out


# ------------------------------------------------------------------------------------ one run
def run_rank(rank: int, world: int, device: torch.device, spec: RunSpec) -> dict:
    """One rank's part of a baseline run (inside an initialized process group unless ``single``)."""
    model, inputs = hidup.models.build(spec.model, world_size=spec.world, seed=spec.seed, **spec.overrides)
    cfg = getattr(model, "config", None)
    if spec.baseline == "single":
        rank, world = 0, 1
        inputs = rank_share(inputs, 0, spec.world)
    else:
        if world != spec.world:
            raise ValueError(f"the process group has {world} ranks but the run asks for world={spec.world}")
        inputs = rank_share(inputs, rank, world)
    skip = variant_skip(spec.variant, device)
    if skip:
        raise ValueError(f"--variant {spec.variant}: {skip}")
    inputs = tuple(t.to(device) for t in inputs)
    torch.manual_seed(spec.seed + 17 + rank)  # dropout streams, if the config enables dropout
    prepared = prepare_variant(
        spec.baseline, model, rank, world, device, inputs, spec.variant, spec.precision, spec.compile_backend
    )
    distributed = spec.baseline != "single" and dist.is_initialized() and world > 1
    out = run_variant(
        prepared,
        inputs,
        spec.precision,
        device,
        warmup=spec.warmup,
        iters=spec.iters,
        best_of=spec.best_of,
        lr=spec.lr,
        capture="graph" in spec.variant,
        coupled=distributed,
    )
    t = out["iter_time_s"]
    groups = inputs[0].shape[0] * (world if spec.baseline != "single" else 1)
    tokens_per_group = cfg.tokens_per_group if cfg is not None and cfg.family != "mlp" else 1
    return {
        "baseline": spec.baseline,
        "model": spec.model,
        "world": spec.world,
        "variant": spec.variant,
        "gpus_used": 1 if spec.baseline == "single" else world,
        "config": cfg.to_dict() if cfg is not None else None,
        "precision": spec.precision,
        "lr": spec.lr,
        "seed": spec.seed,
        "device": str(device),
        "backend": dist.get_backend() if distributed else "none",
        "torch": torch.__version__,
        "warmup": spec.warmup,
        "iters": out["iters"],
        "best_of": spec.best_of,
        "iter_time_s": t,
        "window_times_s": out["window_times_s"],
        "optimizer": out["optimizer"],
        "step_construction": out["step_construction"],
        "samples_per_s": groups / t,
        "tokens_per_s": groups * tokens_per_group / t,
        "peak_memory_bytes": out["peak_memory_bytes"],
        "losses": out["losses"],
        **{f"info_{k}": v for k, v in prepared.info.items()},
    }


def _launched(ctx, spec: RunSpec) -> dict | None:
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.layout.cpn)))
    result = run_rank(ctx.rank, ctx.world_size, ctx.device, spec)
    return result if ctx.rank == 0 else None


def _fake_rank(spec: RunSpec) -> dict:
    """Rank 0 of ``spec`` in this process, on torch's fake process group of ``spec.world`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("--fake-world: a process group is already initialized in this process")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.world)
    try:
        result = run_rank(0, spec.world, device, spec)
    finally:
        dist.destroy_process_group()
    result["stand_ins"] = "torch fake process group (rank 0 alone; losses not the model's)"
    return result


def run(spec: RunSpec, **launch_kwargs) -> dict | None:
    """Start the ranks of ``spec`` and return global rank 0's result (``None`` on other hosts).

    Ranks come from :func:`hidup.runtime.launch.launch`: torchrun's environment or
    ``NODERANK``/``CPN``/``NNODES`` when set (their world must equal ``spec.world``), else
    ``spec.world`` processes on this host; ``single`` always runs in this process.
    ``launch_kwargs`` are :func:`hidup.runtime.launch.launch`'s (``cpn``, ``master_port``, ...).
    """
    if spec.baseline == "single":
        results = launch(_launched, spec, env={})
    elif spec.fake_world:
        results = [_fake_rank(spec)]
    else:
        kw = {k: v for k, v in launch_kwargs.items() if v is not None}
        layout = layout_from_env(
            **{k: kw[k] for k in ("nnodes", "cpn", "node_rank", "master_addr", "master_port") if k in kw}
        )
        if layout.source == "single":  # nothing set: all ranks on this host
            kw.setdefault("cpn", spec.world)
            kw.setdefault("master_port", 0)  # the launcher's store on a free port
            layout = layout_from_env(
                **{k: kw[k] for k in ("nnodes", "cpn", "node_rank", "master_addr", "master_port") if k in kw}
            )
        if layout.world_size != spec.world:
            raise ValueError(
                f"the launch gives {layout.world_size} ranks ({layout.source}: NNODES x CPN or "
                f"WORLD_SIZE) but --world is {spec.world}; make them agree"
            )
        results = launch(_launched, spec, **kw)
    return next((r for r in results if r is not None), None)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Run one training baseline (DDP, FSDP2, expert "
        "parallelism, or one GPU's share) and print its timing as JSON."
    )
    p.add_argument("--baseline", choices=BASELINES, required=True)
    add_model_args(p, world_default=2)
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="eager",
        help="eager, compile (torch.compile), graph (the whole step as one CUDA graph) or compile-graph",
    )
    p.add_argument(
        "--best-of",
        type=int,
        default=1,
        metavar="K",
        help="time K windows of --iters steps between two device syncs and keep the fastest (default 1)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the model's)")
    p.add_argument("--aux-weight", type=float, default=None, help="MoE balance-loss weight")
    p.add_argument("--out", type=Path, default=None, help="append the result as one JSON line to this file")
    p.add_argument(
        "--fake-world",
        action="store_true",
        help="run rank 0 alone in this process, torch's fake process group standing in for the other "
        "ranks (times one rank's compute on one device; the losses are not the model's)",
    )

    add_launch_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = apply_config_file(p, list(sys.argv[1:] if argv is None else argv))
    choice = settle_model(model_request(args))  # the default model and world when not given
    overrides = model_overrides(args)
    for key in ("dropout", "aux_weight"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    try:
        spec = RunSpec(
            args.baseline,
            choice.model,
            choice.world,
            overrides,
            args.warmup,
            args.iters,
            args.lr,
            args.seed,
            args.precision,
            args.variant,
            args.best_of,
            args.compile_backend,
            args.fake_world,
        )
    except ValueError as e:
        p.error(str(e))
    skip = variant_skip(spec.variant, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if skip:
        p.error(f"--variant {spec.variant}: {skip}; choose eager or compile")

    result = run(spec, **launch_kwargs(args))
    if result is None:
        return 0
    line = json.dumps(result)
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    brief = {
        k: result[k]
        for k in (
            "baseline",
            "variant",
            "model",
            "world",
            "iter_time_s",
            "tokens_per_s",
            "peak_memory_bytes",
            "optimizer",
        )
    }
    brief["loss_first"], brief["loss_last"] = result["losses"][0], result["losses"][-1]
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
