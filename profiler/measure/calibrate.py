"""A model's per-op times, gathered over the ranks and checked against whole steps; the cost
model's corrections, fitted on calibration models and checked on held-out ones.

:func:`measure_model_ops` times every op of zoo models at their sharded and half-batch shapes
(:mod:`hidup.profiler.measure.ops`, the ranks splitting the shapes), then checks the sum on whole
single-device steps of one rank's share, and writes the checks in the profile's notes (none of them
becomes a factor: both measured about 1, :mod:`hidup.profiler.profile`):

* :func:`in_context_scale`: the share as one CUDA graph against :func:`predicted_step`, the ops'
  sum, and the Adam step after it (``optimizer_s_per_byte``, a physical rate the profile keeps);
* :func:`dup_context_scale`: the share split into duplication's two half-batch copies on two
  streams (:class:`TwoCopies`) against :func:`predicted_copies`, the cost model's per-copy compute
  of both copies one after the other.

:func:`program_scales` then calibrates on the ranks themselves: searched plans of the calibration
models, compiled without and with duplication and timed as training runs them, against the cost
model's physical prediction of the same plans.  Each correction (``dist_scale``, ``dist_dup_scale``;
:mod:`hidup.profiler.corrections`) is the geometric mean over the calibration plans of the factor
that makes prediction and measurement agree; the plans of the held-out models are timed the same
way and priced *with* the fitted factor, and both lists are the correction's provenance: a
prediction on a calibration model is in-sample, one on a held-out model is not.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import replace

import torch
import torch.distributed as dist

import hidup.models
from hidup.codegen.duplicate import half
from hidup.codegen.graphs import GraphedStep
from hidup.codegen.timing import time_call
from hidup.codegen.trial import time_modes
from hidup.frontend.trace import trace
from hidup.plan.record import Plan
from hidup.profiler.corrections import Correction, Corrections, Point, Provenance
from hidup.profiler.measure.device import tf32
from hidup.profiler.measure.ops import model_op_times
from hidup.runtime.data import rank_share
from hidup.search import price, search
from hidup.search.cost import CostModel
from hidup.search.problem import SearchError

__all__ = [
    "measure_model_ops",
    "in_context_scale",
    "dup_context_scale",
    "predicted_step",
    "predicted_copies",
    "TwoCopies",
    "program_scales",
    "program_checks",
    "apply_program_checks",
    "fit_program_scale",
    "held_out_points",
]


def measure_model_ops(
    prof,
    models: list[tuple[str, dict]],
    world: int | list[int],
    device: torch.device,
    precisions: tuple[str, ...] = ("fp32",),
    seconds: float = 120.0,
    half_batch: bool = True,
):
    """``prof`` plus the per-op times of zoo models traced for ``world`` ranks (a world size, or a
    list of them), at every signature's local shapes, at the batch and at half of it (ops.py), in
    each of ``precisions``.

    Every rank of an initialized process group calls this: each measures its share of the distinct
    op shapes on its own device (``shard=(rank, world)``) and the parts are gathered, so the whole
    group returns the same profile.  ``models`` holds (zoo name, overrides) pairs; ``seconds`` bounds
    each (model, precision, world) on every rank.  Then the ranks time each (model, precision, world)'s
    single-device step (:func:`in_context_scale`): the profile's notes get measured / predicted per
    pair and their geometric mean over the pairs whose prediction is at least 80% measured ops (a
    check of the per-op times; nothing multiplies them), and ``optimizer_s_per_byte`` becomes the
    Adam step's time per parameter byte over all pairs.  Last (``half_batch``), the ranks time the
    same pairs run as duplication's two copies on two streams (:func:`dup_context_scale`), reported
    the same way.  The new op times change the physical prediction that the profile's corrections
    were fitted over, so the result has none (fit them again: :func:`program_scales`)."""

    run = _ModelOps(models, [world] if isinstance(world, int) else list(world), device, precisions, seconds)
    ops = run.op_times(prof, half_batch)
    out = prof.with_ops(ops)
    out.ops_timing = "graph" if run.graphed else "eager"
    out = out.without_corrections()  # fitted over the physical times these ops change: fit them again
    # in-context factor: each rank times the single-device step of some (model, precision, world)
    checks = run.checks(in_context_scale, out)
    opt = [(c["optimizer_s"], c["optimizer_bytes"]) for c in checks if c.get("optimizer_bytes")]
    if opt:
        out.optimizer_s_per_byte = sum(t for t, _ in opt) / sum(b for _, b in opt)
    # two-copy factor: the same pairs run as duplication's two copies, against the calibrated ops
    dup_checks = run.checks(dup_context_scale, out) if half_batch else []
    out.notes += _ops_notes(ops, models, run.graphed, precisions, checks, dup_checks)
    return out


class _ModelOps:
    """One :func:`measure_model_ops` call on this rank: the models, worlds and precisions, this rank's
    share of the work and the gathering of the shares over the process group (if any)."""

    def __init__(self, models, worlds: list[int], device: torch.device, precisions: tuple[str, ...], seconds: float):
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank, self.ranks = (dist.get_rank(), dist.get_world_size()) if self.initialized else (0, 1)
        self.models, self.worlds, self.device = models, worlds, device
        self.precisions, self.seconds = precisions, seconds
        self.graphed = device.type == "cuda"
        self.pairs = [(name, overrides, p, w) for w in worlds for name, overrides in models for p in precisions]

    def gathered(self, part) -> list:
        """Every rank's ``part``, in rank order."""
        parts = [part]
        if self.initialized and self.ranks > 1:
            parts = [None] * self.ranks
            dist.all_gather_object(parts, part)
        return parts

    def op_times(self, prof, half_batch: bool) -> dict:
        """The op times of the models not in ``prof`` yet, each rank timing its share, gathered."""
        mine: dict = dict(prof.ops)  # the same on every rank: keys measured before (another world) are not re-timed
        for w in self.worlds:
            for name, overrides in self.models:
                model, inputs = hidup.models.build(name, world_size=w, device="meta", **overrides)
                for precision in self.precisions:
                    mine = model_op_times(
                        model,
                        inputs,
                        w,
                        device=self.device,
                        precision=precision,
                        half_batch=half_batch,
                        graphed=self.graphed,
                        cache=mine,
                        total_s=self.seconds,
                        shard=(self.rank, self.ranks),
                    )
        ops = {}
        for part in self.gathered({k: v for k, v in mine.items() if k not in prof.ops}):
            ops.update(part or {})
        return ops

    def checks(self, fn, prof) -> list[dict]:
        """``fn`` (:func:`in_context_scale` or :func:`dup_context_scale`) of every (model, precision,
        world), each rank checking its share under ``prof``, gathered; a failure is reported, not raised."""
        mine = [self._check(fn, prof, *pair) for pair in self.pairs[self.rank :: self.ranks]]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the calibration models' memory goes back before the runs
        return [c for part in self.gathered(mine) for c in (part or [])]

    def _check(self, fn, prof, name, overrides, precision, w) -> dict:
        try:
            return dict(fn(prof, name, overrides, w, self.device, precision), world=w)
        except Exception as e:  # noqa: BLE001 - the checks are optional: a failure is reported
            return {"model": name, "precision": precision, "world": w, "error": f"{type(e).__name__}: {e}"}


def _ops_notes(ops: dict, models, graphed: bool, precisions, checks: list[dict], dup_checks: list[dict]) -> str:
    """What :func:`measure_model_ops` adds to the profile's notes: the op shapes timed and both checks."""
    in_context, two_copies = _geomean_scale(checks, None), _geomean_scale(dup_checks, None)
    detail = "; ".join(
        f"{c['model']} {c['precision']} x{c['world']}: "
        + (
            f"step {c['measured_s'] * 1e3:.2f} ms measured / {c['predicted_s'] * 1e3:.2f} ms from ops "
            f"({c['coverage']:.0%} measured) = {c['scale']:.3f}, Adam step {c['optimizer_s'] * 1e3:.2f} ms for "
            f"{c['optimizer_bytes'] / 2**20:.0f} MiB"
            if "scale" in c
            else c["error"]
        )
        for c in checks
    )
    dup_detail = "; ".join(
        f"{c['model']} {c['precision']} x{c['world']}: "
        + (
            f"{c['measured_s'] * 1e3:.2f} ms measured / {c['predicted_s'] * 1e3:.2f} ms one copy after the other "
            f"= {c['scale']:.3f}"
            if "scale" in c
            else c["error"]
        )
        for c in dup_checks
    )
    return (
        f"; {len(ops)} op shapes of {', '.join(n for n, _ in models)} timed "
        f"({'in CUDA graphs' if graphed else 'eagerly'}; {', '.join(precisions)}); "
        f"in-context check {_mean_text(in_context)} ({detail or 'not measured'}); "
        f"two-copy check {_mean_text(two_copies)} ({dup_detail or 'not measured'}); "
        "checks, not applied"
    )


def _mean_text(mean: float | None) -> str:
    return f"{mean:.3f}" if mean is not None else "none usable"


def _geomean_scale(checks: list[dict], default: float | None, min_coverage: float = 0.8) -> float | None:
    """Geometric mean of the checks' ``scale`` over those whose ``coverage`` is at least
    ``min_coverage`` (the share of the prediction from measured ops, or for :func:`program_scales`
    the share that moves with compute) and whose factor lies in [0.5, 2] (others are reported, not
    used); ``default`` if none."""

    usable = [c["scale"] for c in _usable(checks, min_coverage)]
    return math.exp(sum(math.log(x) for x in usable) / len(usable)) if usable else default


def _usable(checks: list[dict], min_coverage: float) -> list[dict]:
    """The checks :func:`_geomean_scale` averages."""
    return [c for c in checks if "scale" in c and c["coverage"] >= min_coverage and 0.5 <= c["scale"] <= 2.0]


def predicted_step(
    profile, model: torch.nn.Module, example_inputs, world_size: int, precision: str = "fp32"
) -> tuple[float, float]:
    """(predicted forward + backward compute seconds, share of it from measured ops) of one rank's
    share of the ``world_size``-rank model run on one device, priced by the cost model from
    ``profile`` as a CUDA-graph step (its physical time: no correction applied)."""
    return _predicted(profile, model, example_inputs, world_size, precision, copies=False)


class TwoCopies(torch.nn.Module):
    """``model`` run as duplication runs it, on one device: the inputs split along dim 0 into two
    halves (:func:`hidup.codegen.duplicate.half`), each half run on its own CUDA stream, the two
    losses added.  Autograd runs each copy's backward on its copy's stream, so the copies' kernels
    can overlap in both passes; on a CPU the copies run one after the other."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str):
        super().__init__()
        self.model = model
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(2)] if cuda else None
        if cuda:  # both copies accumulate into the same gradients from their own streams, by design
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)

    def forward(self, *inputs):

        def copy(c):
            return self.model(*(half(x, 0, c, 1) if isinstance(x, torch.Tensor) else x for x in inputs))

        if self.streams is None:
            return copy(0) + copy(1)
        main = torch.cuda.current_stream(self.device)
        losses = []
        for c, stream in enumerate(self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                losses.append(copy(c))
        for stream, loss in zip(self.streams, losses):
            main.wait_stream(stream)
            loss.record_stream(main)
        return losses[0] + losses[1]


def predicted_copies(
    profile, model: torch.nn.Module, example_inputs, world_size: int, precision: str = "fp32"
) -> tuple[float, float]:
    """(predicted forward + backward compute seconds, share of it from measured ops) of one rank's
    share of the ``world_size``-rank model run on one device as two duplicated copies one after the
    other: :meth:`hidup.search.cost.CostModel.copy_device_compute` of every op, twice, from
    ``profile`` as a CUDA-graph step (its physical time: no correction applied)."""
    return _predicted(profile, model, example_inputs, world_size, precision, copies=True)


def _predicted(profile, model, example_inputs, world_size: int, precision: str, copies: bool):

    graph = trace(model, rank_share(tuple(example_inputs), 0, world_size), 1, half_batch=copies)
    cost = CostModel(graph, profile.launched(True), precision)  # one device: nothing of the ranks' program
    price = cost.copy_device_compute if copies else cost.device_compute
    total = measured = 0.0
    for node in graph.nodes:
        if node.op != "call":
            continue
        sig = node.signatures[0]  # one rank: every signature has the same local shapes
        t = sum(price(node, sig))  # per copy with duplication: both copies take the same
        total += t
        if cost.measured(graph, node, sig) is not None:
            measured += t
    n = 2 if copies else 1
    return n * total, (measured / total if total else 0.0)


def _time_step(
    name: str, overrides: dict, world_size: int, device: torch.device, precision: str, budget_s: float, copies: bool
) -> tuple[float, float, int]:
    """(seconds of one step, seconds of its Adam step, trainable bytes) of one rank's share of zoo
    model ``name`` on ``device``, forward and backward as one CUDA graph; ``copies`` runs it as
    :class:`TwoCopies` (the Adam step is then not timed: 0.0)."""

    model, inputs = hidup.models.build(name, world_size=world_size, seed=0, **overrides)
    model = model.to(device)
    local = tuple(t.to(device) for t in rank_share(inputs, 0, world_size))
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    opt_s = 0.0
    with tf32(precision == "tf32"):
        step = GraphedStep(TwoCopies(model, device) if copies else model, local, autocast_dtype=autocast)
        try:
            measured = time_call(lambda: step(*local), device, warmup=2, budget_s=budget_s, sample_s=budget_s / 5)
            params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            if not copies:
                optimizer = torch.optim.Adam(params, lr=1e-6)  # as the benchmarks and `hidup train` step
                opt_s = time_call(optimizer.step, device, warmup=2, budget_s=budget_s / 2, sample_s=budget_s / 10)
        finally:
            step.release()
    return measured, opt_s, sum(p.numel() * p.element_size() for p in params)


def in_context_scale(
    profile,
    name: str,
    overrides: dict,
    world_size: int,
    device: torch.device | str,
    precision: str = "fp32",
    budget_s: float = 1.0,
) -> dict:
    """Measured over predicted time of one rank's share of zoo model ``name`` (built for
    ``world_size`` ranks) on ``device``: forward and backward captured as one CUDA graph
    (:class:`hidup.codegen.graphs.GraphedStep`) against :func:`predicted_step` from ``profile``'s
    measured ops, and the Adam step on its parameters after it.  Returns ``{"model", "precision",
    "measured_s", "predicted_s", "coverage", "scale", "optimizer_s", "optimizer_bytes"}``; the caller
    decides what to keep (see :func:`measure_model_ops`)."""

    device = torch.device(device)
    meta_model, meta_inputs = hidup.models.build(name, world_size=world_size, device="meta", **overrides)
    predicted, coverage = predicted_step(profile, meta_model, meta_inputs, world_size, precision)
    measured, opt_s, nbytes = _time_step(name, overrides, world_size, device, precision, budget_s, copies=False)
    return {
        "model": name,
        "precision": precision,
        "measured_s": measured,
        "predicted_s": predicted,
        "coverage": coverage,
        "scale": measured / predicted if predicted > 0 else 1.0,
        "optimizer_s": opt_s,
        "optimizer_bytes": nbytes,
    }


def dup_context_scale(
    profile,
    name: str,
    overrides: dict,
    world_size: int,
    device: torch.device | str,
    precision: str = "fp32",
    budget_s: float = 1.0,
) -> dict:
    """Measured over predicted time of one rank's share of zoo model ``name`` run as two duplicated
    copies on two streams (:class:`TwoCopies`, forward and backward as one CUDA graph) against
    :func:`predicted_copies` from ``profile``.  Returns ``{"model", "precision", "measured_s",
    "predicted_s", "coverage", "scale"}``: a check of the per-copy pricing (see
    :func:`measure_model_ops`)."""

    device = torch.device(device)
    meta_model, meta_inputs = hidup.models.build(name, world_size=world_size, device="meta", **overrides)
    predicted, coverage = predicted_copies(profile, meta_model, meta_inputs, world_size, precision)
    measured, _, _ = _time_step(name, overrides, world_size, device, precision, budget_s, copies=True)
    return {
        "model": name,
        "precision": precision,
        "measured_s": measured,
        "predicted_s": predicted,
        "coverage": coverage,
        "scale": measured / predicted if predicted > 0 else 1.0,
    }


def fit_program_scale(predict, measured: float, lo: float = 0.25, hi: float = 4.0) -> tuple[float | None, float]:
    """``(k, coverage)``: the compute factor ``k`` in [lo, hi] at which ``predict(k)`` (predicted
    seconds with every compute item times ``k``, non-decreasing in ``k``) equals ``measured``, by
    bisection on log k (None when even ``lo`` or ``hi`` cannot reach it); ``coverage`` is the share
    of the prediction at ``k = 1`` that moves with compute (a step bound by communication has little,
    and its factor says nothing about compute)."""

    at1 = predict(1.0)
    coverage = (predict(1.1) - at1) / (0.1 * at1) if at1 > 0 else 0.0
    if not measured > 0 or predict(lo) > measured or predict(hi) < measured:
        return None, coverage
    a, b = math.log(lo), math.log(hi)
    for _ in range(40):
        mid = (a + b) / 2
        a, b = (mid, b) if predict(math.exp(mid)) < measured else (a, mid)
    return math.exp((a + b) / 2), coverage


def program_scales(
    prof,
    models: list[tuple[str, dict]],
    precisions: tuple[str, ...],
    device: torch.device,
    held_out: list[tuple[str, dict]] = (),
    **kwargs,
):
    """``prof`` with ``dist_scale`` and ``dist_dup_scale`` fitted on the ranks of the initialized
    process group (every rank calls this; world size >= 2) on the plans of the calibration
    ``models`` and checked on those of the ``held_out`` models: :func:`program_checks` of both
    (``kwargs`` go there), then :func:`apply_program_checks`."""
    fit_names = {name for name, _ in models}
    overlap = sorted(fit_names & {name for name, _ in held_out})
    if overlap:
        raise ValueError(
            f"program_scales: {', '.join(overlap)} both calibrates and is held out; a held-out "
            "model must be one the corrections are not fitted on"
        )
    checks = program_checks(prof, list(models) + list(held_out), precisions, device, **kwargs)
    return apply_program_checks(prof, checks, held_out=[name for name, _ in held_out])


def apply_program_checks(prof, checks: list[dict], held_out: list[str] = ()):
    """A copy of ``prof`` whose ``dist_scale`` and ``dist_dup_scale`` are each the geometric mean of
    the :func:`program_checks` for it on models not in ``held_out`` whose prediction moves with
    compute for at least half of it and whose factor lies in [0.5, 2] (others are reported in the
    notes, not used: 1 when none is).  Each correction's provenance records the checks it was
    fitted on and the checks of the ``held_out`` models, priced with the fitted value
    (:func:`held_out_points`; a check without its plan is left out there)."""

    held = set(held_out)
    fit = [c for c in checks if c.get("model") not in held]
    world = next((c["world"] for c in checks if "world" in c), 0)
    graphs = any(c.get("cuda_graphs") for c in checks)
    fitted = {}
    for name in Corrections.names():
        mine = [c for c in fit if c.get("factor") == name]
        points = tuple(
            Point(c["model"], c["precision"], c["measured_s"], c["predicted_s"], c["coverage"], c["scale"])
            for c in _usable(mine, 0.5)
        )
        fitted[name] = Correction(
            _geomean_scale(mine, 1.0, 0.5),
            None
            if not points
            else Provenance(
                fitted_on=points,
                device=prof.gpu,
                world=world,
                cuda_graphs=graphs,
                date=datetime.date.today().isoformat(),
            ),
        )
    out = prof.with_corrections(Corrections(**fitted))
    held_points = held_out_points(out, [c for c in checks if c.get("model") in held])
    out = out.with_corrections(_with_held_out(out.corrections, held_points))
    detail = "; ".join(
        f"{c['model']} {c['precision']}"
        f"{dict(dist_scale=' one copy', dist_dup_scale=' duplicated').get(c.get('factor'), '')}"
        f"{' (held out)' if c.get('model') in held else ''}: "
        + (
            f"{c['measured_s'] * 1e3:.2f} ms measured / {c['predicted_s'] * 1e3:.2f} ms predicted, "
            f"{c['coverage']:.0%} of it compute -> {c['scale']:.3f}"
            if "scale" in c
            else c["error"]
        )
        for c in checks
    )
    out.notes += (
        f"; inside the distributed program (x{world or '?'}, {'CUDA graphs' if graphs else 'eager'}): "
        f"dist_scale {out.corrections.dist_scale.value:.3f}, "
        f"dist_dup_scale {out.corrections.dist_dup_scale.value:.3f} ({detail or 'no plan'})"
    )
    return out


def _with_held_out(corrections, points: dict[str, tuple]):
    """``corrections`` with each fitted correction's held-out points (``points[name]``) recorded."""

    changed = {}
    for name, held in points.items():
        c = getattr(corrections, name)
        if c.provenance is not None and held:
            changed[name] = replace(c, provenance=replace(c.provenance, held_out=held))
    return replace(corrections, **changed)


def held_out_points(prof, checks: list[dict]) -> dict[str, tuple]:
    """Correction name -> the :class:`~hidup.profiler.corrections.Point` of each of ``checks`` (of
    :func:`program_checks`, with their plans) for it: the measured time against the plan's prediction
    in that mode under ``prof``, its corrections applied."""

    out: dict[str, list] = {}
    for c in checks:
        if c.get("factor") is None or "measured_s" not in c or "plan" not in c:
            continue
        graph = _check_graph(c)
        predicted = _plan_time(
            graph,
            prof,
            Plan.from_dict(c["plan"]),
            c["precision"],
            bool(c.get("cuda_graphs")),
            c["factor"] == "dist_dup_scale",
        )
        out.setdefault(c["factor"], []).append(
            Point(c["model"], c["precision"], c["measured_s"], predicted, c.get("coverage", 0.0), c.get("scale", 0.0))
        )
    return {k: tuple(v) for k, v in out.items()}


def _check_graph(check: dict):
    """The traced graph (meta tensors, with its half-batch trace) of a check's model."""

    world = check["world"]
    model, inputs = hidup.models.build(check["model"], world_size=world, device="meta", **check.get("overrides", {}))
    return trace(model, inputs, world_size=world, half_batch=True)


def _plan_time(graph, prof, plan, precision: str, cuda_graphs: bool, duplicated: bool) -> float:
    """Predicted forward + backward seconds of ``plan`` in one mode under ``prof``."""

    ev = price(graph, prof, plan, precision, cuda_graphs)[duplicated]
    return ev.forward + ev.backward


def program_checks(
    prof,
    models: list[tuple[str, dict]],
    precisions: tuple[str, ...],
    device: torch.device,
    *,
    cuda_graphs: bool | None = None,
    trials: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> list[dict]:
    """One check per (zoo model with overrides, precision, mode), the same on every rank.

    The search's plan for this world under ``prof`` (its physical time: corrections taken as 1) is
    compiled without and with duplication and its forward + backward timed as training runs it
    (:func:`hidup.codegen.trial.time_modes`: a CUDA graph when ``cuda_graphs``, by default on GPUs;
    the slowest rank's median of ``trials``).  A check is ``{"model", "overrides", "precision",
    "factor" ("dist_scale" or "dist_dup_scale"), "measured_s", "predicted_s" (at factor 1),
    "coverage", "scale" | "error", "cuda_graphs", "plan"}``: ``scale`` is the factor that makes the
    cost model's forward + backward of the plan in that mode equal the measured time
    (:func:`fit_program_scale`)."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        raise ValueError("program_scales times plans on the ranks: run it on >= 2 ranks (NODERANK/CPN or torchrun)")
    rank, world = dist.get_rank(), dist.get_world_size()
    graphed = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
    base = prof.without_corrections()
    checks: list[dict] = []
    for name, overrides in models:
        meta_model, meta_inputs = hidup.models.build(name, world_size=world, device="meta", **overrides)
        graph = trace(meta_model, meta_inputs, world_size=world, half_batch=True)
        for precision in precisions:
            row = {
                "model": name,
                "overrides": dict(overrides),
                "precision": precision,
                "world": world,
                "cuda_graphs": graphed,
            }
            try:
                plan = search(
                    graph,
                    base,
                    world_size=world,
                    algorithm="dp",
                    duplication=True,
                    precision=precision,
                    cuda_graphs=graphed,
                )
            except SearchError as e:  # deterministic: every rank skips the same pair
                checks.append(dict(row, error=f"search: {e}"))
                continue
            model, inputs = hidup.models.build(name, world_size=world, seed=seed, **overrides)
            model = model.to(device)
            inputs = tuple(x.to(device) for x in inputs)
            autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
            with tf32(precision == "tf32"):
                measured = time_modes(
                    model,
                    plan,
                    rank,
                    world,
                    inputs,
                    cuda_graphs=graphed,
                    autocast_dtype=autocast,
                    trials=trials,
                    warmup=warmup,
                )
            del model, inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for mode, field in ((False, "dist_scale"), (True, "dist_dup_scale")):
                secs = measured["on_s" if mode else "off_s"]
                if secs is None:
                    checks.append(dict(row, factor=field, error="the batch does not halve"))
                    continue

                def predict(k, mode=mode, field=field, graph=graph, plan=plan, precision=precision):
                    return _plan_time(graph, base.with_corrections(**{field: k}), plan, precision, graphed, mode)

                k, coverage = fit_program_scale(predict, secs)
                check = dict(
                    row, factor=field, measured_s=secs, predicted_s=predict(1.0), coverage=coverage, plan=plan.to_dict()
                )
                if k is None:
                    check["error"] = (
                        f"measured {secs * 1e3:.2f} ms is out of reach of the prediction "
                        f"({check['predicted_s'] * 1e3:.2f} ms at factor 1)"
                    )
                else:
                    check["scale"] = k
                checks.append(check)
    return checks
