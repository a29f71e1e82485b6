"""Do the prefetched weight gathers of an FSDP-style plan overlap compute, eagerly and compiled?

On ``world`` ranks (torchrun; NCCL on GPUs, gloo with ``--device cpu``) a small ``transformers`` Llama
(:func:`exp.rank_models.llama`) gets an FSDP-style plan (every weight stored split and all-gathered for
its use, :func:`hidup.search.api.forced` ``"fsdp"``, duplication off).  Each rank program then runs
forward and backward (no optimizer) in every combination of ``--modes`` (``eager``; ``compile``:
inductor, or ``--backend``; ``compile+graph``: compiled and captured as one CUDA graph,
:func:`hidup.graphed_step`, which checks that torch's functional collectives capture) and prefetch
off/on, and for each

* ``step_ms``: the median of ``--steps`` timed steps after ``--warmup`` (device-synchronized);
* from a ``torch.profiler`` trace of ``--trace-steps`` steps (CUDA only): the all-gather kernels' time
  (``allgather_ms``, kernels whose name has ``AllGather``), the part of it during which a compute kernel
  (any kernel that is not NCCL's) runs on the device (``overlapped_ms``), and their ratio (``overlap``);
  with prefetch on, compiled, the gathers should overlap about as much as eagerly (the side stream),
  and with prefetch off hardly at all;
* ``predicted``: hidup's price of the plan in that mode (``compiled`` for the compiled modes) with prefetch
  off/on, with ``--profile`` (the step's forward, backward and total, ms).

Rank 0 writes everything to ``--out`` (JSON).

``--judge``: hidup against FSDP2, compiled and captured alike
-----------------------------------------------------------------
Instead of the study above, ``--judge`` runs two *arms* on the same model and batch (the ~1B Llama of
docs/benchmarks.md with ``--layers 20``), each in every mode of ``--judge-modes`` (default ``compile``:
``torch.compile`` with ``--backend``; and ``compile+graph``: compiled and the whole step captured as one
CUDA graph, CUDA only, recorded as skipped on a CPU; ``eager`` too on request):

* ``fsdp2``: :mod:`exp.baselines.fsdp` (``fully_shard`` per block and the root, each block compiled before
  it is sharded; bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, FSDP2's default
  prefetch), on the rank's share of the batch (:func:`hidup.runtime.data.rank_share`), its step built as
  :mod:`exp.baselines.harness` builds every baseline's (:class:`~exp.baselines.harness.EagerStep`,
  :class:`~exp.baselines.harness.CapturedStep`);
* ``hidup``: the FSDP-style plan above (forced ``"fsdp"``, duplication off) compiled with prefetch on;
  bf16 is hidup's wire policy (:func:`hidup.codegen.collectives.convert_cast`, :mod:`hidup.precision`): the
  stored fp32 shards of the weights that only bf16 autocast ops read (the linear layers, the head) are
  all-gathered in bf16, the others (the embedding, the norms) in fp32, where FSDP2 casts every parameter
  to bf16; gradients are reduce-scattered in fp32 (``plan.reduce_dtype == "fp32"``).  Its
  ``compile+graph`` step is forward, backward and optimizer captured as one
  :class:`hidup.codegen.graphs.GraphedStep` (as ``hidup train`` captures it).  One compiled program serves
  both modes (compile first, then the capture).  The plan is the search's: whether it gathers a weight
  again in the backward (FSDP2 does, ``reshard_after_forward``) or keeps the forward's copy is its choice
  (``info.resharded_params``).

The step is the same for both arms (:data:`exp.baselines.harness.STEP_CONSTRUCTION`): forward under the
bf16 autocast, backward, **the fused Adam step inside the step** (inside the captured graph in
``compile+graph``; capturable Adam there), the gradients set to None before every eager step and before
the capture.  Timing (:func:`exp.baselines.timing.time_steps`): ``--warmup`` untimed steps, then
``--windows`` windows of ``--steps`` steps between two device syncs, each window's per-step time the
max over ranks; ``step_ms`` is the **median of the windows** (``window_ms`` lists them).  Dynamo's
recompile limit is raised to ``2 layers + 8`` (:func:`recompile_limit`: FSDP2's per-block compile
compiles once per layer), and each run records the graphs and frames ``torch.compile`` compiled
(``dynamo``: ``frames.total > frames.ok`` means some ran eagerly).  A run that fails is recorded with its
error and the launch goes on; rank 0 rewrites ``--out`` after every run and prints the table at the end
(``--table FILE`` prints it again from the JSON).

Exposure.  After the timing each rank records ``--trace-steps`` more steps with ``torch.profiler`` and
reads its chrome trace with :func:`exp.breakdown.analyze` (``dtod_as_comm=False``).  With ``M`` the
device intervals of NCCL kernels (name contains ``nccl``: all-gathers, reduce-scatters, all-reduces) and
``C`` those of every other kernel, memcpy and memset of the rank's GPU, ``U`` the union of intervals,
``|.|`` its length and ``S`` the traced steps::

    comm_ms    = |U(M)| / S                         communication kernel time per step
    hidden_ms  = |U(M) ∩ U(C)| / S                  of it, time some compute kernel runs on the GPU too
    exposed_ms = comm_ms - hidden_ms                communication no compute kernel overlaps

(an NCCL kernel's time includes waiting for its peer).  Reported per rank and as the max over ranks
(``exposed_ms_max``).  On a CPU there are no device kernels: the same figures come from the trace's
``cpu_op`` events (``source: "cpu"``), a plumbing check only.

Prediction (``hidup`` arm): :func:`hidup.search.api.price` of the plan in the mode (``compiled``, with
``cuda_graphs`` for ``compile+graph``, prefetch on, duplication off): ``predicted.total`` (forward +
backward + optimizer, the measured step's counterpart) and ``predicted.exposed_comm = max(0, forward +
backward - compute)`` (:class:`hidup.search.schedule.Evaluation`: the time the two passes take beyond
their compute, i.e. communication the schedule leaves unhidden), compared with ``step_ms`` and
``exposed_ms``.  The question the judge answers: hidup's step no slower than FSDP2's in the same mode
(``hidup / fsdp2 <= 1``), and ``exposed_ms`` within 20% of ``predicted.exposed_comm``.

Usage (two GPUs, repository root):

    torchrun --nproc_per_node 2 exp/overlap.py --out overlap.json
    torchrun --nproc_per_node 2 exp/overlap.py --device cpu --backend aot_eager --layers 2 --hidden 64 \\
        --heads 4 --kv-heads 2 --ffn 128 --vocab 256 --seq 32 --batch 2 --precision fp32 --out o.json
    torchrun --nproc_per_node 2 exp/overlap.py --judge --layers 20 --out judge.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hidup
import hidup.profiler
from exp.baselines import harness
from exp.baselines.baseline_util import Prepared, make_adam
from exp.benchrun import free_memory
from exp.breakdown import analyze
from exp.rank_models import llama
from exp.report import command_line, hardware
from hidup.codegen import GraphedStep
from hidup.codegen.timing import sync
from hidup.runtime.data import rank_share
from hidup.search.api import forced, price

JUDGE_MODES = ("eager", "compile", "compile+graph")  # in the order they run (one compiled program serves two)
JUDGE_ARMS = ("hidup", "fsdp2")  # hidup first: FSDP2's capture is the least tried step of the launch


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the JSON written (required unless --table)")
    ap.add_argument("--table", metavar="JSON", help="print the table of a --judge result file and exit")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--modes", default="eager,compile,compile+graph", help="comma-separated: eager, compile, compile+graph"
    )
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compile mode")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--profile", default="h200x4-nvlink", help="the profile the plan is searched and priced with")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--trace-dir", help="also write each run's trace there (Chrome trace JSON, rank 0)")
    ap.add_argument("--judge", action="store_true", help="hidup's FSDP-style plan against FSDP2 (module docstring)")
    ap.add_argument(
        "--judge-modes",
        default="compile,compile+graph",
        help="--judge: comma-separated: eager, compile, compile+graph (default compile,compile+graph)",
    )
    ap.add_argument("--windows", type=int, default=5, help="--judge: timed windows of --steps steps (median kept)")
    ap.add_argument("--lr", type=float, default=1e-4, help="--judge: the fused Adam step's learning rate")
    ap.add_argument("--commit", default=os.environ.get("COMMIT"), help="--judge: the commit to record (default: git)")
    a = ap.parse_args(argv)
    if not a.out and not a.table:
        ap.error("--out is required: give the JSON file to write (or --table FILE to print one)")
    unknown = sorted({m.strip() for m in a.judge_modes.split(",")} - set(JUDGE_MODES) - {""})
    if a.judge and (unknown or not a.judge_modes.strip(",")):
        ap.error(f"--judge-modes {a.judge_modes!r}: give a comma-separated subset of {', '.join(JUDGE_MODES)}")
    if a.table and not Path(a.table).is_file():
        ap.error(f"--table {a.table}: no such file; give the JSON an --judge run wrote")
    return a


def _sizes(a: argparse.Namespace) -> dict:
    return dict(
        layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn, vocab=a.vocab,
        seq=a.seq, batch=a.batch,
    )  # fmt: skip


def _autocast(a: argparse.Namespace):
    on = a.precision == "bf16"
    return torch.autocast(a.device, dtype=torch.bfloat16, enabled=on)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _step(module, inputs, a) -> None:
    if isinstance(module, GraphedStep):  # forward and backward replayed as one CUDA graph
        module(*inputs)
        return
    with _autocast(a):
        loss = module(*inputs)
    loss.backward()
    module.zero_grad(set_to_none=True)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_of(kernels: list[tuple[str, float, float]]) -> dict:
    """From device kernels ``(name, start us, end us)``: the all-gather kernels' time, the part of it
    during which some compute (non-NCCL) kernel runs, and their ratio."""
    gathers = [(s, e) for n, s, e in kernels if "AllGather" in n]
    compute = _union([(s, e) for n, s, e in kernels if "nccl" not in n.lower()])
    total = sum(e - s for s, e in gathers)
    covered = 0.0
    for s, e in gathers:
        covered += sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in compute if cs < e and ce > s)
    return {
        "allgather_kernels": len(gathers),
        "allgather_ms": total / 1e3,
        "overlapped_ms": covered / 1e3,
        "overlap": covered / total if total else None,
    }


def _trace(module, inputs, a, device, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.trace_steps):
            _step(module, inputs, a)
        _sync(device)
    if a.trace_dir and dist.get_rank() == 0:
        os.makedirs(a.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(a.trace_dir, f"{name}.json"))
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return overlap_of(kernels)


def _run(mode: str, prefetch: bool, plan, rank: int, world: int, device: torch.device, a) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    model, inputs = llama(world_size=world, device=device, **_sizes(a))
    compiled = a.backend if mode.startswith("compile") else False
    module = hidup.compile(model, plan, rank, world, inputs, compile=compiled, prefetch=prefetch, duplication=False)
    if mode.endswith("+graph"):
        dtype = torch.bfloat16 if a.precision == "bf16" else None
        module = hidup.graphed_step(module, inputs, autocast_dtype=dtype, enabled=device.type == "cuda")
    for _ in range(a.warmup):
        _step(module, inputs, a)
    times = []
    for _ in range(a.steps):
        _sync(device)
        start = time.perf_counter()
        _step(module, inputs, a)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    out = {"mode": mode, "prefetch": prefetch, "step_ms": statistics.median(times), "steps_ms": times}
    if device.type == "cuda" and a.trace_steps > 0:
        out.update(_trace(module, inputs, a, device, f"{mode}-prefetch-{'on' if prefetch else 'off'}"))
    del module, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ --judge
@dataclass(frozen=True)
class Judge:
    """How the judge runs (module docstring, ``--judge``); identical on every rank."""

    modes: tuple[str, ...]
    precision: str
    backend: str
    warmup: int
    steps: int
    windows: int
    trace_steps: int
    trace_dir: str | None
    lr: float

    @classmethod
    def of(cls, a: argparse.Namespace) -> Judge:
        asked = [m.strip() for m in a.judge_modes.split(",") if m.strip()]
        return cls(
            tuple(m for m in JUDGE_MODES if m in asked), a.precision, a.backend, a.warmup, a.steps, a.windows,
            a.trace_steps, a.trace_dir, a.lr,
        )  # fmt: skip


def exposure(trace, steps: int) -> dict:
    """Per step of a chrome trace of ``steps`` training steps (a path, dict or event list): the
    communication kernel time, the part some compute kernel overlaps, and the rest, exposed (module
    docstring, "Exposure"); from :func:`exp.breakdown.analyze` with device-to-device copies as compute."""
    b = analyze(trace, dtod_as_comm=False)
    per_step = b["steps"] / max(1, steps) * 1e3  # analyze divides by the ProfilerStep# marks it finds
    return {
        "source": b["source"],
        "comm_ms": b["comm_s"] * per_step,
        "hidden_ms": b["hidden_s"] * per_step,
        "exposed_ms": b["exposed_s"] * per_step,
        "compute_ms": b["compute_s"] * per_step,
        "comm_streams": b["streams"]["comm"],
    }


def _traced(step, device: torch.device, j: Judge, name: str) -> dict:
    """``j.trace_steps`` more steps under torch.profiler on every rank; each rank's :func:`exposure`, rank 0's
    trace kept (gzipped) in ``j.trace_dir``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for i in range(j.trace_steps):
            with record_function(f"ProfilerStep#{i}"):
                step()
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        prof.export_chrome_trace(path)
        mine = exposure(path, j.trace_steps)
        if j.trace_dir and dist.get_rank() == 0:
            os.makedirs(j.trace_dir, exist_ok=True)
            with open(path, "rb") as src, gzip.open(os.path.join(j.trace_dir, f"{name}.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    out = {k: v for k, v in ranks[0].items()}
    out["exposed_ms_max"] = max(r["exposed_ms"] for r in ranks)
    out["per_rank"] = ranks
    return out


def _timed(prepared, inputs: tuple, device: torch.device, j: Judge, name: str, capture: bool) -> dict:
    """Time ``prepared``'s step as every baseline's is timed (:func:`harness.run_variant`), then trace it."""
    traced: dict = {}

    def after(step) -> None:
        if j.trace_steps > 0:
            traced.update(_traced(step, device, j, name))

    out = harness.run_variant(
        prepared, inputs, j.precision, device, warmup=j.warmup, iters=j.steps, best_of=j.windows, lr=j.lr,
        capture=capture, coupled=True, after=after,
    )  # fmt: skip
    windows = [t * 1e3 for t in out["window_times_s"]]
    peak = out["peak_memory_bytes"]
    return {
        "step_ms": statistics.median(windows),
        "window_ms": windows,
        "steps_per_window": out["iters"],
        "optimizer": out["optimizer"],
        "step_construction": dict(out["step_construction"], statistic="median window, max over ranks"),
        "peak_memory_gib": peak / 2**30 if peak is not None else None,
        "loss_first": out["losses"][0],
        "loss_last": out["losses"][-1],
        **traced,
    }


def judge_model(sizes: dict, world: int, device) -> tuple:
    """The judge's Llama (seed 0) and global batch, as docs/benchmarks.md builds it."""
    torch.manual_seed(0)
    return llama(world_size=world, device=device, **sizes)


def recompile_limit(layers: int) -> int:
    """Dynamo's recompile limit for the judge: ``2 layers + 8``.  In training ``transformers`` passes a
    key/value cache through every block with the block's layer index, so ``torch.compile`` of one block per
    layer (FSDP2's) compiles once per layer (inductor's cache makes the repeats short), and perhaps once
    more per layer for the captured step's autocast (its weight-cast cache off); under torch's default
    limit (8) the blocks past it would run eagerly."""
    return 2 * layers + 8


def allow_recompiles(layers: int) -> dict:
    """Raise dynamo's recompile limits to :func:`recompile_limit`; returns the old values."""
    import torch._dynamo.config as config

    old = {}
    names = [n for n in ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, n)]
    for name in names or ["cache_size_limit"]:  # older torch: cache_size_limit
        old[name] = getattr(config, name)
        setattr(config, name, max(old[name], recompile_limit(layers)))
    return old


def _dynamo_counts() -> dict:
    """What torch.compile did since the last :func:`torch._dynamo.utils.counters` clear: graphs compiled and
    frames (``total`` converted, ``ok`` compiled: a frame over the recompile limit runs eagerly)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"].get("unique_graphs", 0), "frames": dict(counters["frames"])}


def _fsdp2_runs(sizes: dict, rank: int, world: int, device: torch.device, j: Judge):
    """(mode, run) for each mode: ``run()`` builds FSDP2 on a fresh model (same seed) and times it."""

    def run(mode: str) -> dict:
        model, inputs = judge_model(sizes, world, device)
        inputs = rank_share(inputs, rank, world)
        variant = mode.replace("+", "-")  # harness.VARIANTS: eager, compile, compile-graph
        prepared = harness.prepare_variant("fsdp", model, rank, world, device, inputs, variant, j.precision, j.backend)
        capture = mode == "compile+graph"
        return dict(_timed(prepared, inputs, device, j, f"judge-fsdp2-{mode}", capture), info=prepared.info)

    for mode in j.modes:
        yield mode, lambda m=mode: run(m)


def _hidup_runs(sizes: dict, plan, rank: int, world: int, device: torch.device, j: Judge):
    """(mode, run) for each mode: ``run()`` times hidup's program with prefetch on (duplication off),
    compiled for the compiled modes -- one compiled program timed with eager launches of its graphs, then
    captured with its optimizer as one CUDA graph."""
    built: dict = {}

    def run(mode: str) -> dict:
        compiled = j.backend if mode.startswith("compile") else False
        if compiled not in built:
            built.clear()
            model, inputs = judge_model(sizes, world, device)
            module = hidup.compile(model, plan, rank, world, inputs, compile=compiled, prefetch=True, duplication=False)
            built[compiled] = module, inputs
        module, inputs = built[compiled]
        info = {"prefetch": True, "duplication": False, "compiled": compiled, "reduce_dtype": plan.reduce_dtype}
        info["resharded_params"] = len(getattr(plan, "reshard", None) or ())
        prepared = Prepared(module, info=info)
        if mode == "compile+graph":
            prepared.optimizer = make_adam(module.parameters(), j.lr, capturable=True)
            with harness.precision_mode(j.precision, device):
                prepared.graphed = GraphedStep(
                    module, inputs, autocast_dtype=harness.autocast_dtype(j.precision),
                    group=getattr(module, "group", None), optimizer=prepared.optimizer[0],
                )  # fmt: skip
        return dict(_timed(prepared, inputs, device, j, f"judge-hidup-{mode}", capture=False), info=info)

    for mode in j.modes:
        yield mode, lambda m=mode: run(m)


def predicted(graph, profile, plan, precision: str, mode: str) -> dict:
    """hidup's price of ``plan`` in ``mode`` (prefetch on, duplication off), in ms."""
    times = price(graph, profile, plan, precision, mode == "compile+graph", mode != "eager", True)[False].times()
    return {k: v * 1e3 for k, v in times.items()}


def _one_run(run) -> dict:
    """``run()``'s record, or its error (one failing run is a result; the others still run), with what
    ``torch.compile`` did during it."""
    from torch._dynamo.utils import counters

    counters.clear()
    try:
        record = run()
    except Exception as e:  # noqa: BLE001 - recorded, and the launch goes on
        record = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    record["dynamo"] = _dynamo_counts()
    return record


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        here = Path(__file__).resolve().parent
        got = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        return got.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def judge(a: argparse.Namespace, rank: int, world: int, device: torch.device, argv=None) -> dict:
    """The judge on this rank (module docstring); rank 0 writes ``a.out`` after every run and prints the table."""
    j = Judge.of(a)
    sizes = _sizes(a)
    profile = hidup.profiler.load(a.profile)
    meta, meta_inputs = judge_model(sizes, world, "meta")
    params = sum(p.numel() for p in meta.parameters())
    graph = hidup.trace(meta, meta_inputs, world_size=world)
    plan = forced(graph, profile, "fsdp", duplication=False, precision=a.precision)
    limits = allow_recompiles(a.layers)
    results = {
        "what": "hidup FSDP-style plan (prefetch, bf16 gathers, fp32 reduce) against FSDP2, compiled and captured",
        "config": {**sizes, "params": params, "world": world, "precision": a.precision, "backend": a.backend},
        "timing": {"warmup": j.warmup, "steps_per_window": j.steps, "windows": j.windows, "statistic": "median"},
        "trace_steps": j.trace_steps,
        "profile": a.profile,
        "hardware": hardware(device.type),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "commit": _commit(a.commit),
        "command": command_line("exp/overlap.py", argv),
        "recompile_limits": {"was": limits, "now": recompile_limit(a.layers)},
        "runs": [],
    }
    skipped = [m for m in j.modes if "graph" in m and device.type != "cuda"]
    for m in skipped:
        results["runs"] += [{"arm": arm, "mode": m, "skipped": "CUDA graphs need a CUDA device"} for arm in JUDGE_ARMS]
    j = replace(j, modes=tuple(m for m in j.modes if m not in skipped))
    for arm in JUDGE_ARMS:
        torch._dynamo.reset()
        runs = (
            _hidup_runs(sizes, plan, rank, world, device, j)
            if arm == "hidup"
            else _fsdp2_runs(sizes, rank, world, device, j)
        )
        run = None
        for mode, run in runs:
            record = {"arm": arm, "mode": mode}
            if arm == "hidup":
                record["predicted"] = predicted(graph, profile, plan, a.precision, mode)
            record.update(_one_run(run))
            results["runs"].append(record)
            if rank == 0:
                brief = {k: v for k, v in record.items() if k in ("arm", "mode", "step_ms", "exposed_ms", "error")}
                print(json.dumps(brief), flush=True)
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1, default=str)
        del runs, run  # the last arm's modules, before the next arm builds its own
        free_memory(device)
    if rank == 0:
        print(judge_table(results), flush=True)
    return results


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def judge_table(results: dict) -> str:
    """The judge's runs as a text table, with hidup / FSDP2 per mode and measured / predicted exposure."""

    def f(x, spec="7.2f"):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    lines = [
        f"{'arm':6s} {'mode':14s} {'step ms':>8s} {'pred ms':>8s} {'comm ms':>8s} {'exposed':>8s} "
        f"{'pred exp':>8s} {'exp/pred':>8s}  note"
    ]
    step = {}
    order = {(arm, mode): i for i, (arm, mode) in enumerate((a, m) for a in JUDGE_ARMS for m in JUDGE_MODES)}
    for r in sorted(results["runs"], key=lambda r: order.get((r["arm"], r["mode"]), len(order))):
        pred = r.get("predicted") or {}
        exp_ratio = (
            r["exposed_ms"] / pred["exposed_comm"]
            if pred.get("exposed_comm") and r.get("exposed_ms") is not None
            else None
        )
        step[(r["arm"], r["mode"])] = r.get("step_ms")
        note = r.get("skipped") or r.get("error", "")[:60]
        lines.append(
            f"{r['arm']:6s} {r['mode']:14s} {f(r.get('step_ms'), '8.2f')} {f(pred.get('total'), '8.2f')} "
            f"{f(r.get('comm_ms'), '8.2f')} {f(r.get('exposed_ms'), '8.2f')} {f(pred.get('exposed_comm'), '8.2f')} "
            f"{f(exp_ratio, '8.2f')}  {note}"
        )
    for mode in JUDGE_MODES:
        h, d = step.get(("hidup", mode)), step.get(("fsdp2", mode))
        if h and d:
            lines.append(f"{mode}: hidup / FSDP2 step = {h / d:.3f} ({'no slower' if h <= d else 'slower'})")
    return "\n".join(lines)


def study(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """The prefetch study on this rank (module docstring, before ``--judge``); rank 0 writes ``a.out``."""
    profile = hidup.profiler.load(a.profile)
    meta, meta_inputs = llama(world_size=world, device="meta", **_sizes(a))
    graph = hidup.trace(meta, meta_inputs, world_size=world)
    plan = forced(graph, profile, "fsdp", duplication=False, precision=a.precision)
    results = {"config": {**_sizes(a), "world": world, "precision": a.precision, "backend": a.backend}, "runs": []}
    results["torch"] = torch.__version__
    results["predicted"] = {}
    for mode in a.modes.split(","):
        for prefetch in (False, True):
            compiled = mode.startswith("compile")
            priced = price(graph, profile, plan, a.precision, False, compiled, prefetch)[False]
            times = priced.times()
            results["predicted"][f"{mode}-prefetch-{'on' if prefetch else 'off'}"] = {
                k: times[k] * 1e3 for k in ("forward", "backward", "total")
            }
            results["runs"].append(_run(mode, prefetch, plan, rank, world, device, a))
            if rank == 0:
                print(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "steps_ms"}), flush=True)
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
    return results


def main(argv=None) -> int:
    a = _args(argv)
    if a.table:
        print(judge_table(json.loads(Path(a.table).read_text())))
        return 0
    warnings.simplefilter("ignore")
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if a.judge:
        judge(a, rank, world, device, argv)
    else:
        study(a, rank, world, device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
