"""``hidup bench-rank``: one rank of a world-N plan, timed on one device.

Rank ``r``'s program of a saved plan (``--plan``), or of a plan searched now for ``--model/--world``,
runs on one device with torch's fake process group (``torch.testing._internal.distributed.fake_pg``,
backend ``"fake"``, rank ``r`` of ``N``) standing in for the other ranks: every collective returns a
tensor of the right shape, dtype and device without communicating, filled as if every rank held this
rank's data (a mirrored world, :mod:`hidup.codegen.collectives`; the loss is not the N-rank step's,
but the kernels, their shapes and the work that depends on values, such as how many of the
all-gathered tokens route to this rank's experts, are a real rank's).  So the
compute of any plan at any world size can be measured on a single GPU, compared with what the same
GPU does with the single-device share, and fed to a profile.

A step is what training runs: forward, backward and a fused Adam step (``fused=True``; on CUDA also
``capturable=True`` so that it joins the captured graph).  Modes:

* ``eager``: the generated fx program, op by op;
* ``cuda-graph``: forward, backward and optimizer step captured once as one CUDA graph and replayed
  (:class:`hidup.codegen.graphs.GraphedStep`);
* ``compile``: the program through ``torch.compile`` (``--backend``, inductor by default;
  :mod:`hidup.codegen.compiled`), the optimizer step eager;
* ``compile+graph``: compiled, then captured with the optimizer step.

Precisions: ``tf32`` (float32 with TF32 matmuls), ``fp32``, ``bf16`` (autocast).  Timing of a mode:
``--warmup`` steps (the first compiles, and its wall time is reported as ``compile_s``), then
``--rounds`` rounds of ``--steps`` steps each between two device synchronizations; a round's time
divided by its steps is one sample, and the median and the best sample are reported.  The
*share* (``--share-modes``, default compile+graph on CUDA and compile on the CPU) is the whole model
at ``1/N`` of the global batch (the first rows of every input), on the same device, timed the same
way: the floor that a rank doing its part of an N-way step without communication should approach.
With ``--share-experts NAME[=MODE][,...]`` the share runs once per named ``transformers`` experts implementation
(``grouped_mm``, ``eager``, or ``hidup_grouped``: hidup's grouped math, what a rank runs;
:func:`hidup.rules.experts.set_experts_implementation`), rows ``share:NAME``: the references a MoE rank
is measured against in the same run.  ``--torch-modes`` (default none) also times the rank's module
as plain ``torch.compile`` sees it: its
eager program (hidup's compilation off) handed whole to ``torch.compile``, so dynamo traces the
collectives' Python itself (graph breaks or its own functional collectives) where hidup's compiled
path makes them opaque custom ops and cuts segments at layers; rows ``torch``.  ``compile`` and
``compile+graph`` are its meaningful modes (``eager`` and ``cuda-graph`` equal the rank's own).

Memory (CUDA): each run records ``peak_memory_bytes`` (``torch.cuda.max_memory_allocated`` over the
run) and ``rank_peak_bytes``, the part of it that is the rank's program: the peak less what was
allocated before the run began (the whole model built for the share, the rank's stored tensors), plus
the rank's stored parameters and buffers.  Beside it, ``predicted_peak`` is the peak of the rank's
program run on fake tensors (:mod:`hidup.runtime.peak`; recorded for the eager and compile modes,
whose peak is one step's), and ``predicted_memory`` is the memory model's figure
for the plan at the run's precision (:mod:`hidup.search.memory`; its activations follow the plan's form
changes, :func:`hidup.frontend.saved.plan_saved_bytes`): parameters, gradients, Adam's two moments, the bytes
autograd keeps for the backward, and the inputs.

With ``--kernels`` each CUDA run also records where its device time goes: the steps run once more
without a CUDA graph under ``torch.profiler``, and the kernels' time per step is summed by kind
(matmul libraries, attention, inductor's generated kernels, the optimizer, copies, other;
:func:`hidup.runtime.kernel_profile.kernel_kind`), and the time of every kernel by name.

A model with routed experts that split over the world also records, before the runs and after them,
how many of the (token, slot) pairs its routers send this rank's experts against a balanced share
(``expert_load``, ``expert_load_after``; :mod:`hidup.runtime.expert_load`): the runs train the
routers, and the rank's expert work follows the pairs it draws while its price assumes a balanced
share.

Results: a table on stdout and, with ``--out``, a JSON file ``{"config": {...}, "runs": [...]}``
rewritten after every run (a run that fails -- capture refused, out of memory -- is recorded with its
error and the sweep goes on).  On the CPU only ``eager`` and ``compile`` run.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hidup.models
import hidup.profiler
from hidup.codegen import compile as hidup_compile
from hidup.codegen.compiled import backend_of
from hidup.codegen.graphs import GraphedStep, fused_adam
from hidup.codegen.offload import host_adam
from hidup.codegen.timing import Stopwatch
from hidup.frontend.trace import forward_inputs
from hidup.plan import Plan, model_record
from hidup.profiler.profile import DTYPES
from hidup.rules.experts import experts_layout_activation, set_experts_implementation
from hidup.runtime.expert_load import expert_loads
from hidup.runtime.kernel_profile import kernel_breakdown
from hidup.runtime.options import DEFAULT_PROFILE, ModelChoice, ModelRequest, build_graph, settle_model
from hidup.runtime.peak import PeakError, predicted_memory, rank_peak
from hidup.search import search

MODES = ("eager", "cuda-graph", "compile", "compile+graph")
PRECISIONS = tuple(p for p in DTYPES if p != "fp16")  # fp16 needs a loss scaler, which the timed step has not

__all__ = ["BenchRankOptions", "MODES", "PRECISIONS", "run", "time_mode"]


@dataclass(frozen=True)
class BenchRankOptions:
    """What ``hidup bench-rank`` times (the flags of the same names; :mod:`hidup.cli.bench_rank_flags`;
    the module docstring says what each does).  ``modes``, ``precisions``, ``share_modes``,
    ``share_experts`` and ``torch_modes`` are the flags' comma-separated texts (None: the defaults);
    ``device`` None for cuda when available."""

    model: ModelRequest = field(default_factory=ModelRequest)
    plan: Path | None = None
    profile: str = DEFAULT_PROFILE
    rank: int = 0
    duplication: str = "plan"
    modes: str | None = None
    precisions: str | None = None
    share_modes: str | None = None
    share_experts: str | None = None
    torch_modes: str = "none"
    backend: str = "inductor"
    steps: int = 20
    rounds: int = 3
    warmup: int = 3
    lr: float = 1e-4
    device: str | None = None
    kernels: bool = False
    out: Path | None = None


def _fail(message: str):
    raise SystemExit(f"hidup bench-rank: error: {message}")


def _list(text: str | None, default: tuple, valid: tuple, flag: str) -> list[str]:
    items = [t.strip() for t in (text.split(",") if text else default) if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad or not items:
        _fail(f"{flag} {text!r}: choose from {', '.join(valid)} (comma-separated)")
    return items


def _settings(opts: BenchRankOptions, device: torch.device) -> tuple[list, list, list, list]:
    cuda = device.type == "cuda"
    modes = _list(opts.modes, MODES if cuda else ("eager", "compile"), MODES, "--modes")
    precisions = _list(opts.precisions, ("tf32", "bf16") if cuda else ("fp32",), PRECISIONS, "--precisions")
    if opts.share_modes == "none":
        share = []
    else:
        share = _list(opts.share_modes, ("compile+graph",) if cuda else ("compile",), MODES, "--share-modes")
    plain = [] if opts.torch_modes == "none" else _list(opts.torch_modes, (), MODES, "--torch-modes")
    graphs = [m for m in modes + share + plain if m.endswith("graph")]
    if graphs and not cuda:
        _fail(
            f"modes {', '.join(sorted(set(graphs)))} capture CUDA graphs, and this run is on {device}; "
            "use --modes eager,compile (and --share-modes, --torch-modes compile) on the CPU"
        )
    for flag, value in (("--steps", opts.steps), ("--rounds", opts.rounds)):
        if value < 1:
            _fail(f"{flag} {value}: must be at least 1")
    if opts.warmup < 1:
        _fail(f"--warmup {opts.warmup}: must be at least 1 (the first step compiles)")
    return modes, precisions, share, plain


def _plan(opts: BenchRankOptions, device: torch.device, precision: str):
    """``(plan, source, choice)``: the plan (loaded, or searched now), where it came from, and the
    model settled (:func:`hidup.runtime.options.settle_model`)."""
    if opts.plan is not None:
        if not Path(opts.plan).is_file():
            _fail(
                f"no plan file at {opts.plan}. Fix: run `hidup search ... --out {opts.plan}` first, or give "
                "--model and --world to search one now"
            )
        plan = Plan.load(opts.plan)
        return plan, str(opts.plan), settle_model(opts.model, plan, opts.plan)
    if opts.model.world is None:
        _fail("give --plan PLAN, or --model M with --world N to search a plan now")

    choice = settle_model(opts.model)
    record = model_record(choice.record)
    _check_rank(opts.rank, choice.world)
    graph = build_graph(choice)
    search_precision = "tf32" if precision == "tf32" and device.type == "cuda" else "fp32"
    if precision == "bf16":
        search_precision = "bf16"
    t0 = time.perf_counter()
    plan = search(
        graph,
        hidup.profiler.load(opts.profile),
        world_size=choice.world,
        duplication=opts.duplication != "off",
        precision=search_precision,
        cuda_graphs=device.type == "cuda",
        progress=False,
        model_source=record,
    )
    print(
        f"searched a world-{choice.world} plan for {choice.model} with profile {opts.profile} in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return plan, "searched", choice


def _check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        _fail(f"--rank {rank} is outside the plan's world of {world} ranks; choose 0..{world - 1}")


def _precision(name: str, device: torch.device):
    """Set the matmul precision for ``name``; its autocast dtype (None: no autocast)."""
    tf32 = name == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return torch.bfloat16 if name == "bf16" else None


def time_mode(
    module, inputs, mode: str, precision: str, device: torch.device, opts: BenchRankOptions, *, compile_fn
) -> dict:
    """Time ``mode`` of ``module`` (a step: forward, backward, fused Adam) at ``precision``; see the
    module docstring.  ``compile_fn(on)`` switches the module between eager and compiled."""
    offloaded = getattr(module, "offload", None) is not None  # Adam on the host (hidup.codegen.offload)
    if offloaded and mode.endswith("graph"):
        _fail(
            f"--modes {mode}: the plan offloads the optimizer to the host, whose copies and CPU step a CUDA "
            "graph cannot hold. Fix: --modes eager or compile"
        )
    autocast_dtype = _precision(precision, device)
    compile_fn(mode.startswith("compile"))
    params = module.optimizer_parameters()
    opt = module.bind_optimizer(host_adam(params, opts.lr) if offloaded else fused_adam(params, opts.lr, device))
    cuda = device.type == "cuda"
    record = {"mode": mode, "precision": precision, "compile_s": None}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        record["allocated_before_bytes"] = torch.cuda.memory_allocated(device)
    step = None
    try:
        if mode.endswith("graph"):
            eager = GraphedStep(module, inputs, autocast_dtype=autocast_dtype, enabled=False, optimizer=opt)
            with Stopwatch(device) as first:
                eager(*inputs)  # the compiling step, timed on its own
            step = GraphedStep(module, inputs, autocast_dtype=autocast_dtype, warmup=opts.warmup, optimizer=opt)
        else:
            step = GraphedStep(module, inputs, autocast_dtype=autocast_dtype, enabled=False, optimizer=opt)
            with Stopwatch(device) as first:
                step(*inputs)
            for _ in range(opts.warmup - 1):
                step(*inputs)
        if mode.startswith("compile"):
            record["compile_s"] = first.seconds
        samples = []
        for _ in range(opts.rounds):
            with Stopwatch(device) as watch:
                for _ in range(opts.steps):
                    loss = step(*inputs)
            samples.append(watch.seconds / opts.steps)
        record.update(
            status="ok",
            step_ms_median=statistics.median(samples) * 1e3,
            step_ms_best=min(samples) * 1e3,
            rounds_ms=[s * 1e3 for s in samples],
            loss_finite=bool(torch.isfinite(loss).item()),
        )
        if opts.kernels and cuda:
            step.release()
            step = GraphedStep(module, inputs, autocast_dtype=autocast_dtype, enabled=False, optimizer=opt)
            record["kernels"] = kernel_breakdown(step, inputs, device)
    except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the sweep goes on
        record.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
    finally:
        if step is not None:
            step.release()
        for p in [*params, *module.parameters()]:
            p.grad = None
        del opt
        if cuda:
            record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            stored = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
            record["rank_peak_bytes"] = record["peak_memory_bytes"] - record["allocated_before_bytes"] + stored
            torch.cuda.empty_cache()
    return record


def _predicted_peak(choice: ModelChoice, plan, rank: int, duplication: bool | None, precision: str) -> dict | None:
    """The rank's peak by a fake-tensor run of its program (:mod:`hidup.runtime.peak`), on the fake
    process group this run made; None (with the reason printed) where the program cannot run so."""
    try:
        return rank_peak(choice, plan, rank, precision, duplication).to_dict()
    except PeakError as e:
        print(f"no predicted peak at {precision}: {e}", flush=True)
        return None


def _share_inputs(values: list, world: int, rank: int = 0) -> list:
    """Rank ``rank``'s ``1/world`` of every tensor input along dim 0 (the first: the single-device
    share's batch)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] % world == 0:
            n = v.shape[0] // world
            v = v.narrow(0, rank * n, n).contiguous()
        out.append(v)
    return out


class _PlainCompile(torch.nn.Module):
    """A module run as is or through plain ``torch.compile`` (the share's whole model; the rank's
    module with hidup's own compilation off, for ``--torch-modes``)."""

    def __init__(self, model, backend: str):
        super().__init__()
        self.model = model
        self._run = (model,)
        self._backend = backend

    def set_compile(self, on: bool) -> None:
        self._run = (torch.compile(self.model, backend=self._backend, dynamic=False) if on else self.model,)

    def optimizer_parameters(self) -> list:
        """What the optimizer steps: the rank module's own answer (ZeRO's slices), else every trainable
        parameter."""
        own = getattr(self.model, "optimizer_parameters", None)
        return own() if own is not None else [p for p in self.model.parameters() if p.requires_grad]

    def bind_optimizer(self, optimizer):
        bind = getattr(self.model, "bind_optimizer", None)
        return bind(optimizer) if bind is not None else optimizer

    def forward(self, *inputs):
        return self._run[0](*inputs)


def _share_targets(opts: BenchRankOptions, model_name: str, model, share, inputs: list, modes: list) -> dict:
    """``{row name: (module, inputs, modes, compile switch)}`` of the share: one row ``share``, or one
    ``share:NAME`` per ``--share-experts`` implementation, each switching the model's experts to it
    (and dropping compiled code, which was traced with the previous one) before it compiles."""
    entries = [n.strip() for n in (opts.share_experts or "").split(",") if n.strip()]
    if not entries:
        return {"share": (share, inputs, modes, share.set_compile)}
    if not any(experts_layout_activation(m) is not None for m in model.modules()):
        _fail(
            f"--share-experts {opts.share_experts}: {model_name} has no transformers experts module that hidup "
            "models; leave out --share-experts"
        )
    rows = {}
    for entry in entries:
        name, _, mode = entry.partition("=")
        rows[name] = _list(mode, tuple(modes), MODES, f"--share-experts {entry}") if mode else modes

    def switch_to(name):
        def switch(on: bool) -> None:
            set_experts_implementation(model, name)
            torch._dynamo.reset()
            share.set_compile(on)

        return switch

    return {f"share:{name}": (share, inputs, row_modes, switch_to(name)) for name, row_modes in rows.items()}


def _print_row(what: str, r: dict) -> None:
    if r["status"] == "ok":
        comp = f"  compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else ""
        mem = f"  peak {r['peak_memory_bytes'] / 2**30:.2f} GiB" if r.get("peak_memory_bytes") else ""
        if r.get("rank_peak_bytes") and r.get("predicted_memory"):
            mem += (
                f" (rank {r['rank_peak_bytes'] / 2**30:.3f} GiB, predicted "
                f"{r['predicted_memory']['total'] / 2**30:.3f} GiB by the memory model"
                + (
                    f" + {r['predicted_memory']['transient'] / 2**30:.3f} around its largest op"
                    if r["predicted_memory"].get("transient")
                    else ""
                )
                + (f", {r['predicted_peak']['total'] / 2**30:.3f} GiB by a fake run" if r.get("predicted_peak") else "")
                + ")"
            )
        print(
            f"{what:6s} {r['precision']:5s} {r['mode']:14s} {r['step_ms_median']:10.3f} ms median "
            f"{r['step_ms_best']:10.3f} ms best{comp}{mem}",
            flush=True,
        )
    else:
        print(f"{what:6s} {r['precision']:5s} {r['mode']:14s} FAILED {r['error']}", flush=True)


def _table(runs: list[dict]) -> str:
    cols = []
    for r in runs:
        key = (r["what"], r["mode"])
        if key not in cols:
            cols.append(key)
    precisions = list(dict.fromkeys(r["precision"] for r in runs))
    head = "precision | " + " | ".join(f"{w} {m}" for w, m in cols)
    lines = [head, "-" * len(head)]
    for prec in precisions:
        cells = []
        for w, m in cols:
            r = next((x for x in runs if (x["what"], x["mode"], x["precision"]) == (w, m, prec)), None)
            cells.append("-" if r is None else (f"{r['step_ms_median']:.2f} ms" if r["status"] == "ok" else "failed"))
        lines.append(f"{prec:9s} | " + " | ".join(cells))
    return "\n".join(lines)


class _Bench:
    """One ``hidup bench-rank`` sweep on torch's fake process group: the rank's module, the share and
    the plain ``torch.compile`` module, timed in every mode and precision; ``runs`` and ``config``
    are written to ``--out`` after every run."""

    def __init__(self, opts: BenchRankOptions, choice: ModelChoice, plan, device: torch.device, config: dict):
        self.opts, self.choice, self.plan, self.device, self.config = opts, choice, plan, device, config
        self.duplication = {"on": True, "off": False}.get(opts.duplication)
        self.runs: list[dict] = []

    def save(self) -> None:
        if self.opts.out is not None:
            self.opts.out.parent.mkdir(parents=True, exist_ok=True)
            self.opts.out.write_text(json.dumps({"config": self.config, "runs": self.runs}, indent=1))

    def _rank_module(self):
        """``(model, values, module)``: the model, its forward inputs and the rank's compiled module."""
        opts, choice, device, config = self.opts, self.choice, self.device, self.config
        # a factory's model is built on the CPU and traced there, as the search and the ranks of
        # `hidup train` trace it (a model's code may trace differently on a GPU); the rank and the
        # share then move to the device
        build_on = None if hidup.models.is_factory(choice.model) else device
        model, inputs = hidup.models.build(
            choice.model, world_size=choice.world, seed=0, device=build_on, **choice.model_args
        )
        values = forward_inputs(model, inputs)
        t0 = time.perf_counter()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = hidup_compile(
                model, self.plan, opts.rank, choice.world, values, duplication=self.duplication, device=device
            )
        config["duplication"] = bool(module.duplication)
        config["program_s"] = time.perf_counter() - t0
        stored = sum(p.numel() for p in module.parameters())
        config["rank_params"], config["model_params"] = stored, sum(p.numel() for p in model.parameters())
        print(
            f"rank {opts.rank} of {choice.world}: {stored:,} of the model's {config['model_params']:,} parameters, "
            f"duplication {'on' if module.duplication else 'off'}, on {config['device']}",
            flush=True,
        )
        return model, values, module

    def _targets(self, model, values, module, modes, torch_modes) -> tuple[dict, _PlainCompile, list]:
        """``({row: (module, inputs, modes, compile switch)}, share, share inputs)``: the rank's module
        and plain ``torch.compile`` of it, and the share, the whole model on the device (its rows:
        :func:`_share_targets`)."""
        opts, device = self.opts, self.device
        rank_inputs = [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]
        share = _PlainCompile(model.to(device), opts.backend)
        plain = _PlainCompile(module, opts.backend)

        def plain_switch(on: bool) -> None:
            module.set_compile(None)
            plain.set_compile(on)

        share_values = _share_inputs(values, self.choice.world)
        share_inputs = [v.to(device) if isinstance(v, torch.Tensor) else v for v in share_values]
        targets = {
            "rank": (module, rank_inputs, modes, lambda on: module.set_compile(opts.backend if on else None)),
            "torch": (plain, rank_inputs, torch_modes, plain_switch),
        }
        return targets, share, share_inputs

    def sweep(self, modes: list, precisions: list, share_modes: list, torch_modes: list) -> None:
        """Time every row in every mode and precision, printing each run and saving after it."""
        opts, choice, plan, cuda = self.opts, self.choice, self.plan, self.device.type == "cuda"
        model, values, module = self._rank_module()
        targets, share, share_inputs = self._targets(model, values, module, modes, torch_modes)
        predicted = {p: predicted_memory(choice, plan, p) for p in precisions} if cuda else {}
        peaks = {p: _predicted_peak(choice, plan, opts.rank, self.duplication, p) for p in precisions} if cuda else {}
        shares = _share_targets(opts, choice.model, model, share, share_inputs, share_modes)
        targets.update(shares)
        self._record_loads("expert_load", model, values, precisions[0])
        # the share right after the rank, so a cut-short sweep keeps pairs; plain torch.compile last, since
        # a CUDA graph capture that it breaks can leave the device unusable for the rest of the process
        order = [(p, w) for p in precisions for w in ("rank", *shares)] + [(p, "torch") for p in precisions]
        for precision, what in order:
            target, inputs_of, mode_list, switch = targets[what]
            for mode in mode_list:
                timed = time_mode(target, inputs_of, mode, precision, self.device, opts, compile_fn=switch)
                r = dict(what=what, **timed)
                if what == "rank" and predicted.get(precision) is not None:
                    r["predicted_memory"] = predicted[precision]
                if what == "rank" and peaks.get(precision) is not None and mode in ("eager", "compile"):
                    r["predicted_peak"] = peaks[precision]  # an eager program's peak (graphs keep their pool)
                self.runs.append(r)
                _print_row(what, r)
                self.save()
        self._record_loads("expert_load_after", model, values, precisions[0])

    def _record_loads(self, key: str, model, values, precision: str) -> None:
        """The load of this rank's experts (:mod:`hidup.runtime.expert_load`) under the model's routers as
        they stand (the share's, which its runs train), in ``config[key]``, and a line saying it."""
        world, rank = self.choice.world, self.opts.rank
        world_inputs = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in values]
        loads = expert_loads(
            model,
            world_inputs,
            _share_inputs(world_inputs, world, rank),
            world,
            rank,
            _precision(precision, self.device),
        )
        if loads is None:
            return
        self.config[key] = loads
        mean = {k: statistics.mean(v[k] for v in loads.values()) for k in ("world", "mirrored", "world_max")}
        print(
            f"{key}: rank {self.opts.rank}'s experts get {mean['mirrored']:.2f}x a balanced share of the pairs in "
            f"this run's mirrored world, {mean['world']:.2f}x in an {self.choice.world}-rank world "
            f"(largest block {mean['world_max']:.2f}x), mean over {len(loads)} layers",
            flush=True,
        )


def _device(opts: BenchRankOptions) -> torch.device:
    """``--device`` (default cuda when available), with its index."""
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        _fail(f"--device {opts.device}: no CUDA device here; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _config(opts: BenchRankOptions, choice: ModelChoice, plan, plan_source: str, device: torch.device) -> dict:
    """The ``config`` of the results file: what was timed, where and how."""
    return {
        "model": choice.model,
        "model_args": choice.model_args,
        "world": choice.world,
        "rank": opts.rank,
        "plan": plan_source,
        "plan_predicted_ms": ((getattr(plan, "predicted", None) or {}).get("total") or 0) * 1e3 or None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": opts.backend,
        "steps": opts.steps,
        "rounds": opts.rounds,
        "warmup": opts.warmup,
        "optimizer": "adam (fused)",
        "stand-ins": "torch fake process group",
    }


def run(opts: BenchRankOptions) -> int:
    """``hidup bench-rank`` (module docstring): 0 when every run succeeded."""
    device = _device(opts)
    modes, precisions, share_modes, torch_modes = _settings(opts, device)
    try:
        backend_of(opts.backend)
    except ValueError as e:
        _fail(f"--backend: {e}")
    if dist.is_available() and dist.is_initialized():
        _fail("a process group is already initialized in this process; run bench-rank in its own process")
    plan, plan_source, choice = _plan(opts, device, precisions[0])
    _check_rank(opts.rank, choice.world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bench = _Bench(opts, choice, plan, device, _config(opts, choice, plan, plan_source, device))
    dist.init_process_group("fake", store=FakeStore(), rank=opts.rank, world_size=choice.world)
    try:
        bench.sweep(modes, precisions, share_modes, torch_modes)
    finally:
        dist.destroy_process_group()
    _precision("fp32", device)
    print(_table(bench.runs), flush=True)
    if opts.out is not None:
        bench.save()
        print(f"results written to {opts.out}", flush=True)
    return 0 if all(r["status"] == "ok" for r in bench.runs) else 1
