"""The rank side of the benchmark drivers: prepare one method, time it, agree across ranks.

One *run* trains one model (built once per rank, deep-copied per run so every method starts from the
same weights) with one *method* for a bounded number of fused-Adam steps on a fixed synthetic batch:

* ``single``: one rank's share (``batch_per_gpu`` groups, the ``N``-rank model) with no communication,
  run concurrently on every rank;
* ``ddp``, ``fsdp``, ``expert``: the baselines of ``exp/baselines`` on the rank's ``B/N`` groups;
* ``single``, ``ddp``, ``fsdp`` and ``expert`` each run in the variants of ``exp/baselines/harness.py``
  (``eager``, ``compile``, ``graph``: the whole step as one CUDA graph, ``compile-graph``), one after
  the other in the same run; a variant that fails is recorded with its error (``variants``), one
  that cannot run here (a CUDA graph on a CPU) as skipped, and the run reports its fastest variant
  that ran (``variant``);
* ``hidup`` / ``hidup-nodup``: ``hidup.codegen.compile`` of a searched plan with duplication on / off,
  fed the global batch (each rank slices its part per the plan's input forms), run as ``hidup
  train`` runs it on GPUs: the program compiled with ``torch.compile`` (the bench's compile
  backend; ``info.compiled``; not on a CPU, where inductor's build time would dominate a short
  run), forward and backward captured as one CUDA graph
  (:class:`hidup.codegen.GraphedStep`), kept when replaying beats eager steps in a short trial
  (``info.step_mode``; eager on a CPU), then the fused Adam step;
* ``hidup-auto``: the plan as ``hidup train`` runs it by default: duplication on or off by a short
  timed trial of both modes (:func:`hidup.codegen.choose_duplication`; ``info.duplication_trial``);
* ``hidup-eager`` / ``hidup-nodup-eager``: the same without the CUDA graph (every op dispatched from
  Python), to show what the capture buys; duplicated eager runs of one process all use the same
  pair of copy communicators (created at the first), graph-captured runs a fresh pair each;
* ``single-graph``: the floor's forward and backward captured the same way as hidup's;
* ``single-dup``: the share run as duplication runs it, two half-batch copies on two streams
  (:class:`hidup.profiler.measure.calibrate.TwoCopies`), captured the same way: the floor of a duplicated plan.

Timing: every method, hidup's included, is timed by ``exp/baselines/timing.py``
(:func:`timing.time_steps`): ``warmup`` untimed steps, then the best of ``best_of`` windows of ``N``
steps between two device syncs, each window's per-step time ``(t_end - t_start) / N`` taken as the
max over ranks; ``N`` is bounded by the run's time cap (``cap_s``, per variant).  Peak memory is
``max_r`` of ``torch.cuda.max_memory_allocated`` over the windows.  The loss of each step is the
global loss (``sum_r w_r L_r``, baseline_util.py; hidup's ranks return parts that sum to it).

Agreement.  Every decision that changes which collectives run (skip, which run is next, how many
steps, whether a run failed) is taken on rank 0 and broadcast, or agreed by a max over ranks, so
ranks never diverge.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import gzip
import shutil
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import hidup.models
from exp.baselines import harness
from exp.baselines.baseline_util import make_adam
from exp.baselines.timing import sync
from exp.breakdown import analyze_file
from hidup.codegen import choose_duplication
from hidup.codegen import compile as hidup_compile
from hidup.codegen.graphs import GraphedStep
from hidup.codegen.timing import max_over_ranks
from hidup.codegen.trial import compile_step
from hidup.profiler.measure.calibrate import TwoCopies
from hidup.runtime.data import rank_share

# Known, harmless-for-timing messages that would otherwise be printed by every rank for every run.
warnings.filterwarnings("ignore", message=".*AccumulateGrad node's stream does not match.*")
warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle.*")

METHODS = (
    "single",
    "single-graph",
    "single-dup",
    "ddp",
    "fsdp",
    "expert",
    "hidup",
    "hidup-nodup",
    "hidup-auto",
    "hidup-eager",
    "hidup-nodup-eager",
)
BASELINE_METHODS = ("single", "single-graph", "single-dup", "ddp", "fsdp", "expert")
VARIANT_METHODS = ("single", "ddp", "fsdp", "expert")  # run in the variants of harness.VARIANTS
HIDUP_METHODS = ("hidup", "hidup-nodup", "hidup-auto", "hidup-eager", "hidup-nodup-eager")


def mode_of(method: str) -> str:
    """The duplication mode a hidup method is priced in: ``hidup`` (on) or ``hidup-nodup`` (off)."""
    return "hidup-nodup" if method.startswith("hidup-nodup") else "hidup"


def graphed(method: str) -> bool:
    """Whether a method runs its forward and backward as one CUDA graph (on CUDA devices)."""
    return method in ("single-graph", "single-dup", "hidup", "hidup-nodup", "hidup-auto")


# ------------------------------------------------------------------------------------ agreement
def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast(obj, device: torch.device):
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not distributed():
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the job's ranks (:func:`hidup.codegen.timing.max_over_ranks`)."""
    return max_over_ranks(values, None, device)


def barrier(device: torch.device) -> None:
    reduce_max([0.0], device)


# ------------------------------------------------------------------------------------ precision
def effective_precision(precision: str, device: torch.device) -> str:
    """The precision a run uses: tf32 and bf16 become fp32 on a CPU (no TF32 units there, and CPU
    bf16 autocast would time a different kernel set than the GPU runs)."""
    return "fp32" if device.type != "cuda" else precision


precision_mode = harness.precision_mode


# ------------------------------------------------------------------------------------ methods
class Prepared:
    """What the timed loop needs of a method (the fields of exp/baselines/baseline_util.Prepared the
    step reads, and the run's own)."""

    def __init__(self, module, loss_scale=1.0, after_backward=None, info=None, cleanup=None, loss_weight=1.0):
        self.module, self.loss_scale, self.after_backward = module, loss_scale, after_backward
        self.loss_weight = loss_weight  # w_r: this rank's loss counts w_r times in the global loss
        self.info, self.cleanup = info or {}, cleanup
        self.coupled = True  # ranks communicate within a step
        self.graph = False  # capture forward + backward as one GraphedStep (see timed_loop)
        self.choose = False  # after capture, keep the faster of graph replay and eager steps
        self.graphed = None  # the GraphedStep once captured
        self.optimizer = None  # (optimizer, description) when it joined that capture
        self.capture = False  # capture the whole step, optimizer included (harness.CapturedStep)
        self.capture_warmup = 3  # eager steps before that capture


_COPY_GROUPS: list[tuple] = []  # the copy communicators shared by eager runs, once created


def _shared_copy_groups(world: int, device: torch.device, duplication: bool) -> tuple | None:
    """The pair of copy process groups every eager duplicated run of this process uses (created at
    the first such run; every rank reaches it at the same run).  Creating and destroying a pair per
    run costs seconds of NCCL setup over sockets each time, and NCCL communicator teardown next to
    new ones is a known source of hangs; eager runs issue the same collectives on the same
    communicators whatever the plan, so sharing them is safe.  None where no pair is needed."""
    if not (duplication and device.type == "cuda" and distributed() and world > 1):
        return None
    if not _COPY_GROUPS:
        ranks = list(range(dist.get_world_size()))
        _COPY_GROUPS.append((dist.new_group(ranks), dist.new_group(ranks)))
    return _COPY_GROUPS[0]


def prepare(
    method: str,
    model_cpu,
    inputs_cpu: tuple,
    rank: int,
    world: int,
    device: torch.device,
    plan=None,
    precision: str = "fp32",
    variant: str | None = None,
    compile_backend: str = "inductor",
) -> tuple[Prepared, tuple]:
    """(prepared method, this rank's inputs on ``device``) for one run; ``model_cpu`` is not modified.
    ``variant`` (methods of :data:`VARIANT_METHODS`; default ``eager``): one of ``harness.VARIANTS``."""
    model = copy.deepcopy(model_cpu)
    if method in BASELINE_METHODS:
        single = method.startswith("single")
        variant = variant or "eager"
        if method not in VARIANT_METHODS and variant != "eager":
            raise ValueError(f"method {method} has no variants (it is captured as hidup captures its steps)")
        inputs = tuple(t.to(device) for t in rank_share(inputs_cpu, rank, world))
        got = harness.prepare_variant(
            "single" if single else method, model, rank, world, device, inputs, variant, precision, compile_backend
        )
        module = got.module
        if method == "single-dup":
            module = TwoCopies(module, device)
        prep = Prepared(module, got.loss_scale, got.after_backward, dict(got.info), loss_weight=got.loss_weight)
        prep.coupled = not single
        prep.graph = graphed(method) and device.type == "cuda"
        prep.capture = "graph" in variant
        prep.capture_warmup = got.capture_warmup
        if method in VARIANT_METHODS:
            prep.info["variant"] = variant
        return prep, inputs
    if method in HIDUP_METHODS:
        if plan is None:
            raise ValueError(f"method {method} needs a plan (none was given)")
        model = model.to(device)
        inputs = tuple(t.to(device) for t in inputs_cpu)
        graph = graphed(method) and device.type == "cuda"
        compiled = compile_backend if graph else False  # the captured methods run compiled, as on a GPU
        duplication = mode_of(method) == "hidup"
        shared = None if graph else _shared_copy_groups(world, device, duplication)
        trial, compile_s = None, None
        if method == "hidup-auto":
            with precision_mode(precision, device):
                module, trial = choose_duplication(
                    model,
                    plan,
                    rank,
                    world,
                    inputs,
                    cuda_graphs=graph,
                    autocast_dtype=harness.autocast_dtype(precision),
                    compile=compiled,
                )
        else:
            module = hidup_compile(
                model, plan, rank, world, inputs, duplication=duplication, copy_groups=shared, compile=compiled
            )
            if compiled:  # compiled as hidup train --compile on compiles: one step under the capture's autocast
                with precision_mode(precision, device):
                    compile_s = compile_step(
                        module, inputs, autocast_dtype=harness.autocast_dtype(precision), graphed=graph
                    )

        # a run captured as a CUDA graph gets fresh copy communicators, destroyed after it: one pair
        # reused by runs captured as different graphs ended in illegal memory accesses after about
        # twenty runs (NCCL 2.28, sockets).  Eager runs share one pair (see _shared_copy_groups).
        owned = (
            []
            if shared is not None
            else [g for g in getattr(module, "copy_groups", None) or () if g is not None and g is not dist.group.WORLD]
        )

        def cleanup():
            for g in {id(g): g for g in owned}.values():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(g)

        if variant not in (None, "eager", "graph"):
            raise ValueError(f"method {method} runs as hidup train runs it; variant {variant!r} does not apply")
        info = {
            "duplication": bool(module.duplication),
            "plan_duplication": bool(plan.duplication),
            "cuda_graph": graph,
            "compiled": compiled,
            "compile_s": compile_s,
            "step_mode": "eager",
        }  # the capture, where it happens, says "graph"
        if trial is not None:
            info["duplication_trial"] = trial["trial"]
        prep = Prepared(module, 1.0, None, info, cleanup if owned else None)
        prep.graph = prep.choose = graph
        return prep, inputs
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def applicable(method: str, model_cpu) -> str | None:
    """Why ``method`` cannot run on this model (``None`` when it can)."""
    cfg = getattr(model_cpu, "config", None)
    if method == "expert" and not isinstance(cfg, hidup.models.ModelConfig):
        return (
            "the hand-written expert-parallel baseline converts the zoo's MoE layers only; "
            f"{type(model_cpu).__name__} is not a zoo model"
        )
    if method == "expert" and not cfg.is_moe:
        return f"expert parallelism needs MoE layers; {cfg.name} is dense"
    return None


# ------------------------------------------------------------------------------------ timing
def timed_loop(
    prep: Prepared,
    inputs: tuple,
    precision: str,
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    cap_s: float | None,
    best_of: int = 1,
    trace_path=None,
    lr: float = 1e-4,
    phase=None,
) -> dict:
    """Build the method's step, time it with the shared timer (:func:`timing.time_steps`, via
    :func:`harness.run_variant`), and trace one more step on request.  ``phase(name)`` is told each
    phase as it starts (``capture``, ``warmup``, ``timing``, ``trace``)."""
    phase = phase or (lambda name: None)
    module = prep.module
    if prep.graph and prep.graphed is None:
        phase("capture")
        # the optimizer joins the capture, as `hidup train` captures it (harness.STEP_CONSTRUCTION);
        # a method with gradient glue after its backward keeps its optimizer after the replay
        if prep.after_backward is None:
            prep.optimizer = make_adam(module.parameters(), lr, capturable=device.type == "cuda")
        with precision_mode(precision, device):  # TF32 is fixed into the kernels at capture
            prep.graphed = GraphedStep(
                module,
                inputs,
                autocast_dtype=harness.autocast_dtype(precision),
                choose=prep.choose,
                group=getattr(module, "group", None),
                optimizer=prep.optimizer[0] if prep.optimizer is not None else None,
            )
        prep.info.update(step_mode=prep.graphed.mode, mode_timings=prep.graphed.timings)
    traced = {}

    def after(step) -> None:  # one more step, traced, before a captured step is released
        if trace_path is not None:
            phase("trace")
            with precision_mode(precision, device):
                traced["breakdown"] = _profiled_step(step, device, trace_path)

    out = harness.run_variant(
        prep,
        inputs,
        precision,
        device,
        warmup=warmup,
        iters=iters,
        best_of=best_of,
        cap_s=cap_s,
        lr=lr,
        capture=prep.capture,
        coupled=prep.coupled,
        phase=phase,
        after=after,
    )
    losses = out.pop("losses")
    out.update(loss_first=losses[0], loss_last=losses[-1], losses=losses, breakdown=traced.get("breakdown"))
    return out


def _profiled_step(step, device: torch.device, trace_path) -> dict | None:
    """One more step; rank 0 records it with torch.profiler, writes the chrome trace, and analyzes it."""
    rank0 = not distributed() or dist.get_rank() == 0
    if not rank0:
        step()
        sync(device)
        return None

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    path = Path(trace_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    try:
        out = analyze_file(path)
    except ValueError as e:
        out = {"error": str(e), "trace": str(path)}

    with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)  # traces compress about tenfold
    path.unlink()
    out["trace"] = str(path) + ".gz"
    return out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def execute(
    method: str,
    model_cpu,
    inputs_cpu,
    rank: int,
    world: int,
    device: torch.device,
    precision: str,
    *,
    warmup: int,
    iters: int,
    cap_s: float | None,
    plan=None,
    trace_path=None,
    phase=None,
    variants: tuple | list | None = None,
    best_of: int = 1,
    compile_backend: str = "inductor",
    on_variant=None,
) -> dict:
    """One run on every rank, failures caught and agreed: returns rank 0's view of the outcome.

        A method of :data:`VARIANT_METHODS` runs each of ``variants`` (default all of
        ``harness.VARIANTS``) in turn, each timed within ``cap_s``; the run reports the fastest variant
        that ran (``variant``; its timing, losses and info are the run's) and ``variants``: each
        variant's status, time and error.  The run fails only when no variant ran.  Other methods run once.
    ``on_variant(variant, summary)`` is told each variant's outcome as soon as it is known (so that a
    driver can keep the variants that ran when a later one brings the process group down).

        A failure on any rank (an exception, e.g. CUDA out of memory) makes the run (or variant)
        ``failed`` with the first failing rank's error; the process group stays usable when the ranks
        fail symmetrically (an asymmetric failure inside a collective ends in the process-group timeout
        instead).  ``phase(name)`` is told each phase as it starts (``prepare``, those of
        :func:`timed_loop`, ``cleanup``; prefixed ``<variant>:`` for a variant), so that a watchdog can say
        where a hung run stopped."""
    phase = phase or (lambda name: None)
    if method not in VARIANT_METHODS:
        return _execute_once(
            method,
            None,
            model_cpu,
            inputs_cpu,
            rank,
            world,
            device,
            precision,
            warmup=warmup,
            iters=iters,
            cap_s=cap_s,
            plan=plan,
            trace_path=trace_path,
            phase=phase,
            best_of=best_of,
            compile_backend=compile_backend,
        )
    variants = tuple(variants or harness.VARIANTS)
    unknown = [v for v in variants if v not in harness.VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(harness.VARIANTS)}")
    results: dict[str, dict] = {}
    for v in variants:
        skip = harness.variant_skip(v, device)
        if skip:
            results[v] = {"status": "skipped", "error": skip}
        else:
            trace = None if trace_path is None else _variant_path(trace_path, v)
            results[v] = _execute_once(
                method,
                v,
                model_cpu,
                inputs_cpu,
                rank,
                world,
                device,
                precision,
                warmup=warmup,
                iters=iters,
                cap_s=cap_s,
                plan=plan,
                trace_path=trace,
                phase=lambda name, v=v: phase(f"{v}:{name}"),
                best_of=best_of,
                compile_backend=compile_backend,
            )
        if on_variant is not None:
            on_variant(v, variant_summary(results[v]))
    ran = {v: r for v, r in results.items() if r["status"] == "ok"}
    summary = {v: variant_summary(r) for v, r in results.items()}
    if not ran:
        errors = "; ".join(f"{v}: {str(r.get('error')).splitlines()[0][:300]}" for v, r in results.items())
        return {"status": "failed", "error": f"no variant ran ({errors})", "variants": summary}
    best = min(ran, key=lambda v: ran[v]["iter_time_s"])
    out = dict(ran[best], variant=best, variants=summary)
    return out


VARIANT_FIELDS = (
    "status",
    "iter_time_s",
    "window_times_s",
    "iters",
    "best_of",
    "warmup",
    "capped",
    "warmup_s",
    "loss_first",
    "loss_last",
    "peak_memory_bytes",
    "optimizer",
    "step_construction",
    "error",
)


def variant_summary(result: dict) -> dict:
    """What a run keeps of a variant that was not its fastest (:data:`VARIANT_FIELDS`)."""
    return {k: result.get(k) for k in VARIANT_FIELDS if result.get(k) is not None}


def _variant_path(path, variant: str):
    path = Path(path)
    return path.with_name(f"{path.stem}-{variant}{path.suffix}")


def _execute_once(
    method: str,
    variant: str | None,
    model_cpu,
    inputs_cpu,
    rank: int,
    world: int,
    device: torch.device,
    precision: str,
    *,
    warmup: int,
    iters: int,
    cap_s: float | None,
    plan,
    trace_path,
    phase,
    best_of: int,
    compile_backend: str,
) -> dict:
    """One method (in one variant) on every rank; see :func:`execute`."""
    prep = None
    out: dict = {}
    error = ""
    try:
        phase("prepare")
        prep, inputs = prepare(
            method, model_cpu, inputs_cpu, rank, world, device, plan, precision, variant, compile_backend
        )
        out = timed_loop(
            prep,
            inputs,
            precision,
            device,
            warmup=warmup,
            iters=iters,
            cap_s=cap_s,
            best_of=best_of,
            trace_path=trace_path,
            phase=phase,
        )
        out["info"] = prep.info
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        error = f"rank {rank}: {type(e).__name__}: {e}"
        if "out of memory" not in str(e).lower():
            error += "\n" + traceback.format_exc(limit=6)
    finally:
        phase("cleanup")
        if prep is not None and prep.graphed is not None:
            with contextlib.suppress(Exception):
                prep.graphed.release()  # before the copy groups' communicators are destroyed
            prep.graphed = None
        if prep is not None and prep.cleanup is not None:
            # every rank is done with the run's communicators before any destroys them, and all have
            # destroyed them before the next run creates new ones (NCCL teardown beside communicators
            # in use or being created is a known source of hangs)
            for step in (lambda: reduce_max([0.0], device), prep.cleanup, lambda: reduce_max([0.0], device)):
                with contextlib.suppress(Exception):
                    step()
        compiled = (variant is not None and "compile" in variant) or bool(prep and prep.info.get("compiled"))
        prep = None
        if compiled:
            # compiled code is cached per code object, and after a few recompilations (a new module
            # each run) dynamo would silently fall back to eager: every compiled run starts afresh
            torch._dynamo.reset()
        free_memory(device)
    failed = reduce_max([1.0 if error else 0.0], device)[0] > 0
    if failed:
        errors = [error]
        if distributed():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e), "a rank failed")
        return {"status": "failed", "error": first[:4000]}
    out["status"] = "ok"
    return out
