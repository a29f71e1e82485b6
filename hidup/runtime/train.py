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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

import hidup.models
import hidup.profiler
from hidup import codegen
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.codegen.timing import Stopwatch, max_over_ranks
from hidup.codegen.trial import choose_compile, compile_step
from hidup.frontend.trace import trace
from hidup.plan import Plan, PlanError
from hidup.profiler.profile import DTYPES
from hidup.rules.dispatch import host_synchronizes
from hidup.runtime import checkpoint
from hidup.runtime.data import StdlibCorpus
from hidup.runtime.launch import Distributed, add_launch_args, launch, launch_kwargs, layout_from_env
from hidup.runtime.options import DEFAULT_PROFILE, CommandError, add_model_args, mesh_phrase, settle_model
from hidup.search import search


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, world_default=None)
    g = p.add_argument_group("training")
    g.add_argument("--plan", type=Path, default=None, help="plan JSON from `hidup search` (default: search now)")
    g.add_argument("--profile", default=DEFAULT_PROFILE, help="profile used when searching on the spot")
    g.add_argument(
        "--duplication",
        choices=("auto", "plan", "on", "off"),
        default="auto",
        help="two half-batch copies per rank overlapping communication and compute: as the plan says, "
        "on, off, or auto (default): on GPUs with more than one rank, time a few steps of the plan "
        "with and without and keep the faster (the plan's choice unless the other wins by 2%%); "
        "elsewhere as the plan says",
    )
    g.add_argument("--no-duplication", action="store_true", help="the same as --duplication off")
    g.add_argument("--iterations", type=int, default=20, help="optimizer steps (default 20)")
    g.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (default 3)")
    g.add_argument("--last-k", type=int, default=10, help="report time over the last K steps (default 10)")
    g.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this value")
    g.add_argument(
        "--precision", choices=DTYPES, default="fp32", help="fp32, tf32 matmuls, or bf16/fp16 autocast (default fp32)"
    )
    g.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="capture each step's forward and backward as one CUDA graph (auto: on GPUs unless "
        "--precision fp16, whose loss scaler checks gradients on the host, and kept only "
        "when replaying beats eager steps in a short trial)",
    )
    g.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the rank program through torch.compile (inductor; collectives stay eager as opaque "
        "custom ops, duplication's stages are compiled one by one): on, off, or auto (default): on "
        "GPUs time a few steps both ways and keep the faster, on the CPU off. The compilation time "
        "is printed; torch's compile caches are used",
    )
    g.add_argument(
        "--data",
        choices=("synthetic", "stdlib"),
        default="synthetic",
        help="synthetic batches, or byte-level tokens of the Python standard library's source "
        "(language models; needs --vocab >= 256)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the weights, the data and dropout")
    g.add_argument(
        "--chrome-trace", type=Path, default=None, help="write a chrome trace of 3 steps per rank to this directory"
    )
    g.add_argument("--checkpoint-dir", type=Path, default=None, help="where checkpoints are written")
    g.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: only on signal)")
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=1,
        help="keep the last K checkpoints: the newest in <dir>/checkpoint, the older ones beside it as "
        "checkpoint.step-<N> (move one to checkpoint to resume from it); default 1",
    )
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh over the checkpoint already in --checkpoint-dir (without it, or --resume, a run "
        "that finds one there refuses to start)",
    )
    g.add_argument(
        "--stop-after", type=int, default=None, help="stop (as if interrupted) after this many steps of this invocation"
    )
    g.add_argument("--json", type=Path, default=None, help="write the run's results as JSON (rank 0)")
    add_launch_args(p)


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
    params = getattr(plan, "reshard", None) or []
    return (f", {len(layers)} layers recomputed in the backward" if layers else "") + (
        f", {len(params)} parameters resharded after forward" if params else ""
    )


def _plan_for(args, model, inputs, world: int):
    if args.plan is not None:
        return Plan.load(args.plan)

    graph = trace(model, inputs, world_size=world, half_batch=True, mesh=getattr(args, "mesh", None))
    return search(
        graph,
        hidup.profiler.load(args.profile),
        world_size=world,
        duplication=_duplication_mode(args) != "off",
        precision=args.precision,
        cuda_graphs=_captures(args, torch.cuda.is_available()),
    )


def _duplication_mode(args) -> str:
    """``--duplication``, with ``--no-duplication`` meaning off."""
    return "off" if args.no_duplication else args.duplication


def _captures(args, cuda: bool) -> bool:
    """Whether steps are captured as CUDA graphs (``--cuda-graphs``; fp16's loss scaler reads the
    gradients on the host every step, so auto leaves it eager)."""
    if args.cuda_graphs == "auto":
        return cuda and args.precision != "fp16"
    return args.cuda_graphs == "on"


def _capturable(args, plan: Plan) -> bool:
    """Whether the plan's step can be captured as one CUDA graph: not when a node reads split sizes on
    the host (the routed experts' all-to-all dispatcher); ``--cuda-graphs on`` then stops with the fix."""
    syncing = sorted(name for name, sig in plan.choices.items() if host_synchronizes(sig))
    if not syncing:
        return True
    if args.cuda_graphs == "on":
        raise SystemExit(
            f"--cuda-graphs on: the plan's routed experts {', '.join(syncing[:3])}"
            f"{' ...' if len(syncing) > 3 else ''} dispatch tokens by all-to-all, which reads split sizes on the "
            "host, so the step cannot be captured. Fix: --cuda-graphs auto or off (the search priced this "
            "plan uncaptured), or a plan searched for experts dispatched by all-gather"
        )
    return False


def _compile_rank(args, module, batch, device, autocast_dtype, use_graph: bool, rank: int) -> dict:
    """Settle ``--compile`` on ``module`` (:mod:`hidup.codegen.compiled`): ``{"compile": bool,
    "compile_s": seconds of the compiling step or None, "trial": {...}}``; rank 0 prints what it did."""
    mode = getattr(args, "compile", "off")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return {"compile": False, "compile_s": None, "trial": {}}
    if mode == "auto":
        info = choose_compile(module, batch, cuda_graphs=use_graph, autocast_dtype=autocast_dtype, group=module.group)
        if rank == 0:
            print(info["reason"], flush=True)
        return info
    module.set_compile(True)
    seconds = compile_step(module, batch, autocast_dtype=autocast_dtype, graphed=use_graph)
    if rank == 0:
        print(f"compiled the rank program with inductor in {seconds:.1f} s (the first forward + backward)", flush=True)
    return {"compile": True, "compile_s": seconds, "trial": {}}


def run_rank(ctx: Distributed, args: argparse.Namespace) -> dict:
    """One rank's training run; global rank 0 holds the checkpoint folder's lock while it runs."""
    lock = checkpoint.FolderLock(args.checkpoint_dir) if ctx.rank == 0 and args.checkpoint_dir else None
    try:
        if lock is not None:
            lock.acquire()
    except checkpoint.CheckpointBusy as e:
        raise SystemExit(str(e)) from None
    try:
        return _train_rank(ctx, args)
    finally:
        if lock is not None:
            lock.release()


def _train_rank(ctx: Distributed, args: argparse.Namespace) -> dict:
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    if args.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    zoo = not hidup.models.is_factory(args.model)
    cfg = hidup.models.config(args.model, world_size=world, **args.model_args) if zoo else None
    model, inputs = hidup.models.build(args.model, world_size=world, seed=args.seed, **args.model_args)
    data = None
    if args.data == "stdlib":
        if not zoo:
            raise SystemExit(
                f"--data stdlib feeds the zoo's language models; {args.model} gets synthetic batches "
                "shaped like its example inputs (leave out --data)"
            )
        if getattr(cfg, "vocab", 0) < 256 or inputs[0].dtype.is_floating_point:
            raise SystemExit("--data stdlib needs a language model with --vocab >= 256")
        data = StdlibCorpus(inputs[0].shape[0], inputs[0].shape[1])
    plan = _plan_for(args, model, inputs, world)
    mode, trial = _duplication_mode(args), {}
    model = model.to(device)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    use_graph = _captures(args, device.type == "cuda") and _capturable(args, plan)
    if mode == "auto" and device.type == "cuda" and world > 1:
        trial_batch = _to(batch_at(inputs, 0, args.seed, cfg, data), device)
        module, trial = codegen.choose_duplication(
            model, plan, rank, world, trial_batch, cuda_graphs=use_graph, autocast_dtype=autocast_dtype, seed=args.seed
        )
        if rank == 0:
            print(trial["reason"], flush=True)
    else:
        duplication = {"on": True, "off": False}.get(mode)  # plan / auto off the GPU: as the plan says
        module = codegen.compile(model, plan, rank, world, _to(inputs, device), duplication=duplication, seed=args.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    if args.optimizer == "adam" and device.type == "cuda":
        opt = fused_adam(params, args.lr, device)
    elif args.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=args.lr)
    else:
        opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    if use_graph and device.type != "cuda":
        raise SystemExit("--cuda-graphs on needs GPUs (this run is on the CPU); use --cuda-graphs auto or off")
    if use_graph and scaler is not None:
        raise SystemExit(
            "--cuda-graphs on does not combine with --precision fp16 (the loss scaler inspects the "
            "gradients on the host every step); use bf16, or --cuda-graphs off"
        )
    # the update joins the captured step when nothing must see the gradients in between
    opt_in_graph = use_graph and args.optimizer == "adam" and args.clip is None and scaler is None
    compiled = _compile_rank(
        args, module, _to(batch_at(inputs, 0, args.seed, cfg, data), device), device, autocast_dtype, use_graph, rank
    )
    graphed = None

    start, losses = 0, []
    ckpt_path = args.checkpoint_dir / "checkpoint" if args.checkpoint_dir else None
    if args.resume:
        earlier = [
            p for p in ((ckpt_path, args.checkpoint_dir / "checkpoint.pt") if ckpt_path else ()) if checkpoint.exists(p)
        ]  # checkpoint.pt: the single file that earlier versions wrote
        if not earlier:
            raise SystemExit(f"--resume: no checkpoint at {ckpt_path}; give --checkpoint-dir of an earlier run")
        state = checkpoint.load(earlier[0], module, opt)
        start, losses = state["step"], list(state["loss_history"])
    if rank == 0:  # the run's header, and what it will do first
        steps = (
            "CUDA graph" + (" if faster than eager (auto)" if args.cuda_graphs == "auto" else "")
            if use_graph
            else "eager"
        )
        on_mesh = mesh_phrase(getattr(plan, "mesh", None))
        print(
            f"train {args.model}: world {world}{on_mesh} ({ctx.backend}), plan {args.plan or 'searched now'}, "
            "duplication "
            f"{'on' if getattr(module, 'duplication', False) else 'off'} ({mode}), steps {steps}"
            f"{_recompute_text(plan)}",
            flush=True,
        )
        print(
            f"nothing left to run: {'the checkpoint is at' if args.resume else 'already at'} step {start} of "
            f"--iterations {args.iterations}"
            if start >= args.iterations
            else f"running steps {start + 1}..{args.iterations}; the first includes warm-up and can take a while",
            flush=True,
        )

    signals = _Signals()
    times, cuda = [], device.type == "cuda"
    is_lm = inputs[0].dim() >= 2 and not inputs[0].is_floating_point()  # the first input is a tensor (traced)
    tokens_per_step = math.prod(inputs[0].shape[:2]) if is_lm else inputs[0].shape[0]
    unit = "tokens" if is_lm else "samples"
    prof = None
    if args.chrome_trace is not None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=3, repeat=1))
        prof.start()
    step, done, stopped_by = start, 0, None
    while step < args.iterations:
        batch = _to(batch_at(inputs, step, args.seed, cfg, data), device)
        if cuda:
            torch.cuda.synchronize(device)
        if use_graph and graphed is None:
            graphed = GraphedStep(
                module,
                batch,
                autocast_dtype=autocast_dtype,  # warm-up + capture, once
                choose=args.cuda_graphs == "auto",
                group=module.group,
                optimizer=opt if opt_in_graph else None,
            )
            if rank == 0:
                timing = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in graphed.timings.items())
                print(f"step mode: {graphed.mode}" + (f" (trial: {timing})" if timing else ""), flush=True)
        module.rng_step = step  # dropout draws step `step`'s values, resumed or not (hidup.rules.random)
        with Stopwatch(device) as watch:
            if graphed is not None:
                loss = graphed(*batch)
            else:
                with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
                    loss = module(*batch)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                else:
                    loss.backward()
            if args.clip is not None:
                codegen.clip_grad_norm_(module, args.clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif graphed is None or graphed.optimizer is None:
                opt.step()  # else the graphed step ran it
            opt.zero_grad(set_to_none=True)
        times.append(watch.seconds)
        total = float(module.global_loss(loss))
        _check_finite(total, step + 1, ckpt_path, args.lr)
        losses.append(total)
        step += 1
        done += 1
        if prof is not None:
            prof.step()
        if rank == 0:
            print(f"step {step:5d}  loss {total:.6g}  {times[-1] * 1e3:8.2f} ms", flush=True)
        save, stop = signals.agreed(device)
        stopped_by = "SIGTERM" if stop and step < args.iterations else None
        stop = stop or (args.stop_after is not None and done >= args.stop_after)
        periodic = args.checkpoint_every and step % args.checkpoint_every == 0
        if ckpt_path is not None and (periodic or save or stop or step == args.iterations):
            checkpoint.save(ckpt_path, module, opt, step=step, loss_history=losses, keep=args.keep_checkpoints)
            signals.save = False
        if stop:
            break
    if prof is not None:
        prof.stop()
        args.chrome_trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.chrome_trace / f"trace_rank{rank}.json"))
    timed = times[args.warmup :] if len(times) > args.warmup else times
    timed = timed[-args.last_k :]
    result = {
        "model": args.model,
        "world": world,
        "rank": rank,
        "steps": step,
        "losses": losses,
        "iteration_s_mean": statistics.fmean(timed) if timed else None,
        "iteration_s_std": statistics.pstdev(timed) if len(timed) > 1 else 0.0,
        "iteration_s_median": statistics.median(timed) if timed else None,
        "tokens_per_s": tokens_per_step / statistics.median(timed) if timed else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "duplication": bool(getattr(module, "duplication", False)),
        "precision": args.precision,
        "cuda_graph": graphed is not None and graphed.graph is not None,
        "step_mode_trial": graphed.timings if graphed is not None else {},
        "duplication_trial": trial.get("trial", {}),
        "compile": compiled["compile"],
        "compile_s": compiled["compile_s"],
        "compile_trial": compiled["trial"],
        "plan_predicted_s": (getattr(plan, "predicted", None) or {}).get("total"),
        "stopped_by": stopped_by,
    }
    if rank == 0 and stopped_by is not None:
        where = (
            f"checkpoint saved in {args.checkpoint_dir}; continue with --resume"
            if ckpt_path is not None
            else "nothing saved (no --checkpoint-dir)"
        )
        print(f"stopped by {stopped_by} after step {step}: {where}", flush=True)
    if rank == 0 and timed:
        mem = f", peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB" if cuda else ""
        print(
            f"iteration time {result['iteration_s_mean'] * 1e3:.2f} ± {result['iteration_s_std'] * 1e3:.2f} ms "
            f"(last {len(timed)}), {result['tokens_per_s']:.0f} {unit}/s{mem}",
            flush=True,
        )
    if rank == 0 and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


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


def check_run_options(args: argparse.Namespace) -> None:
    """Refuse, before any rank starts, what would fail or lose work later: a learning rate that is not a
    positive number, a --checkpoint-dir that is a file, cannot be written or is in use by another job
    (:class:`~hidup.runtime.checkpoint.FolderLock`), and a checkpoint already there that neither
    --resume (continue it) nor --overwrite (replace it) says what to do with."""
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise CommandError(f"--lr {args.lr}: the learning rate must be a positive number")
    if args.resume and args.overwrite:
        raise CommandError("--resume continues the checkpoint and --overwrite replaces it: give one")
    if args.keep_checkpoints < 1:
        raise CommandError(f"--keep-checkpoints {args.keep_checkpoints}: keep at least the last checkpoint (1)")
    folder = args.checkpoint_dir
    if folder is None:
        if args.resume:
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
    if found and not (args.resume or args.overwrite):
        raise CommandError(
            f"--checkpoint-dir {folder} holds a checkpoint ({found[0].name}) that this run would replace. "
            "Fix: --resume to continue it, --overwrite to start afresh over it, or another --checkpoint-dir"
        )


def run(args: argparse.Namespace) -> int:
    """Settle the model (the plan's record, or the flags) and the world size, then launch the ranks.
    A plan for another world size than the launch's, and options that would fail or lose work later
    (:func:`check_run_options`), are refused here, before any rank starts."""
    check_run_options(args)
    plan = Plan.load(args.plan) if args.plan is not None else None
    explicit_world = args.world
    settle_model(args, plan, args.plan)
    launched = args.cpn is not None or "CPN" in os.environ or "RANK" in os.environ
    if plan is not None and launched:
        layout = layout_from_env(nnodes=args.nnodes, cpn=args.cpn, node_rank=args.node_rank)
        if layout.world_size != plan.world_size:
            raise PlanError(
                f"{args.plan} was searched for {plan.world_size} ranks but this launch has "
                f"{layout.world_size} ({layout.source}: NNODES x CPN, or WORLD_SIZE). Fix: launch "
                f"{plan.world_size} ranks, or search again for {layout.world_size}"
            )
    if args.world is not None and not launched and (plan is not None or explicit_world is not None):
        args.cpn, args.nnodes, args.node_rank = args.world, 1, 0  # one node, --world processes
    results = launch(run_rank, args, **launch_kwargs(args))
    # a scheduler's SIGTERM (to the launcher or the whole group): the run saved and stopped early, and
    # exits as a process ended by SIGTERM does, so that the scheduler requeues it rather than marks it done
    stopped = any(isinstance(r, dict) and r.get("stopped_by") == "SIGTERM" for r in results)
    return 128 + signal.SIGTERM if stopped else 0
