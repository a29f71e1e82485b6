"""``hidup verify``: prove that a plan computes what the single-device model computes.

Runs the model under the plan on N processes (gloo on CPUs, NCCL on GPUs) and on one device with the
same weights and the same global batch, and reports the largest relative difference of the loss and
of every parameter gradient (gradients are gathered to their logical, unsharded layout first):

    rel(a, b) = max|a - b| / max(max|b|, 1e-2 * G)

where G is the largest gradient entry of the whole model: a gradient that is zero in exact
arithmetic (the bias of attention keys: softmax ignores a constant shift) holds only rounding noise,
and dividing that noise by itself would report a mismatch where there is none.

The command exits non-zero when any difference exceeds ``--tolerance`` (1e-5 by default, fp32), and
then names the first op of the plan whose forward value differs from one device's
(:mod:`hidup.runtime.locate`), or says that the forward matches op by op.
With ``--steps K`` it also takes K optimizer steps (SGD) on both sides and compares the losses.

Random ops (dropout) draw the same values on both sides: hidup's counter-based values of the step
(:mod:`hidup.rules.random`), the reference through :func:`hidup.rules.random.single_device`.

The plan runs as ``hidup train`` runs it: the model the plan records (zoo name or
``package.module:function``; no model flags needed), on the plan's world size, compiled with the
plan's duplication setting (``--duplication on|off`` overrides it, as in ``train``; ``train``'s
``auto`` times both on GPUs and keeps the faster, so verify each with ``on`` and ``off``).

The command line (:mod:`hidup.cli.verify_flags`) makes a :class:`VerifyOptions`, which :func:`run`
settles and launches; every rank runs :func:`parity_report` with its :class:`ParityOptions`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hidup.models
import hidup.profiler
from hidup import codegen
from hidup.codegen.graphs import GraphedStep
from hidup.codegen.params import full_grad_dict
from hidup.frontend.trace import trace
from hidup.optionset import OptionSet
from hidup.plan import Plan
from hidup.rules.random import single_device
from hidup.runtime.launch import DEFAULT_TIMEOUT_S, Distributed, launch
from hidup.runtime.locate import Comparison, first_mismatch
from hidup.runtime.options import DEFAULT_PROFILE, ModelRequest, check_plan_fits, mesh_phrase, settle_model
from hidup.search import forced, search

__all__ = ["VerifyOptions", "ParityOptions", "parity_report", "make_plan", "rel_diff", "run"]


@dataclass(frozen=True)
class VerifyOptions:
    """What ``hidup verify`` checks (the flags of the same names; :mod:`hidup.cli.verify_flags`):
    ``model`` the model asked for, ``plan`` a plan file (None: search one now with ``profile``, or
    force ``style``), ``duplication`` ``"plan"``, ``"on"`` or ``"off"``, ``steps`` optimizer steps also
    compared, ``tolerance`` the largest relative difference allowed, ``seed``, and ``dist_timeout``
    seconds before a hung collective fails."""

    model: ModelRequest = field(default_factory=ModelRequest)
    plan: Path | None = None
    style: str = "searched"
    profile: str = DEFAULT_PROFILE
    duplication: str = "plan"
    steps: int = 0
    tolerance: float = 1e-5
    seed: int = 0
    dist_timeout: float = DEFAULT_TIMEOUT_S

    @property
    def forced_duplication(self) -> bool | None:
        """``duplication`` as :class:`ParityOptions` takes it: None for the plan's setting."""
        return {"plan": None, "on": True, "off": False}[self.duplication]


@dataclass(frozen=True)
class ParityOptions(OptionSet):
    """How :func:`parity_report` runs the plan (it takes them as keywords too).

    ``plan`` a plan file (None: searched with ``profile``, or forced to ``style``; on the device
    ``mesh`` of several axes when given).  ``duplication`` True or False forces the compiled module's
    two copies on or off; None compiles the plan as it says (as ``hidup train`` does), and lets a
    searched plan use duplication.  ``steps`` SGD steps also compared; ``seed``.  ``cuda_graph`` runs
    the compiled module's forward and backward through :class:`hidup.codegen.GraphedStep` (captured as
    one CUDA graph on GPUs, eager elsewhere).  ``progress``: rank 0 prints a line on stderr as each
    phase starts.  ``locate``: a tolerance above which (loss or any gradient) every rank runs
    :func:`hidup.runtime.locate.first_mismatch` and the report names the first op that differs
    (``first_mismatch``)."""

    plan: Path | str | None = None
    style: str = "searched"
    profile: str = DEFAULT_PROFILE
    duplication: bool | None = True
    steps: int = 0
    seed: int = 0
    cuda_graph: bool = False
    progress: bool = False
    mesh: tuple[int, ...] | None = None
    locate: float | None = None
    WHAT = "parity_report"


def rel_diff(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max|a - b| / max(max|b|, floor)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor)) if b.numel() else 0.0


def make_plan(
    model,
    inputs,
    world: int,
    *,
    plan=None,
    style: str = "searched",
    profile: str = "paper-v100-9.7gbps",
    duplication: bool = True,
    mesh: tuple[int, ...] | None = None,
):
    """A plan for ``model``: loaded from ``plan`` (a path), else searched, else forced to ``style``
    (on the device ``mesh`` when given); ``duplication`` is what a searched or forced plan may use."""
    if plan is not None:
        return Plan.load(plan)

    graph = trace(model, inputs, world_size=world, mesh=mesh)
    prof = hidup.profiler.load(profile)
    if style == "searched":
        return search(graph, prof, world_size=world, duplication=duplication)
    result = forced(graph, prof, style)
    result.duplication = duplication
    return result


def _steps(model, inputs, steps: int, seed: int, lr: float = 1e-2) -> list[float]:
    """Losses of ``steps`` plain SGD steps of the single-device model, drawing the random values of
    steps 1, 2, ... (step 0 is the compared step)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(1, steps + 1):
        with single_device(seed, step):
            loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def parity_report(
    ctx: Distributed, model_name: str, overrides: dict, options: ParityOptions | None = None, **changes
) -> dict:
    """Run one plan on every rank of ``ctx`` and, on rank 0, compare with the single-device model.

    ``model_name`` is a zoo name or ``package.module:function`` and ``overrides`` its arguments;
    ``options`` (:class:`ParityOptions`) are updated by the keyword ``changes``.  Every rank must call
    it.  Returns (rank 0) the loss, the per-gradient relative differences and, with ``steps``, the
    losses of ``steps`` SGD steps on both sides; other ranks return ``{}``."""
    opts = ParityOptions.of(options, **changes)
    plan, style, duplication, steps, seed = opts.plan, opts.style, opts.duplication, opts.steps, opts.seed

    def say(text: str) -> None:
        if opts.progress and ctx.rank == 0:
            print(f"verify: {text}", file=sys.stderr, flush=True)

    world, device = ctx.world_size, ctx.device
    what = (
        "loading the plan"
        if plan is not None
        else ("searching a plan" if style == "searched" else f"making a forced {style}-parallel plan")
    )
    say(f"building {model_name} and {what} on each of the {world} ranks ...")
    model, inputs = hidup.models.build(model_name, world_size=world, seed=seed, **overrides)
    the_plan = make_plan(
        model,
        inputs,
        world,
        plan=plan,
        style=style,
        profile=opts.profile,
        duplication=duplication is not False,
        mesh=opts.mesh,
    )
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    say("compiling the rank programs (torch.export of the step, then the rewrite) ...")
    module = codegen.compile(model.to(device), the_plan, ctx.rank, world, batch, duplication=duplication, seed=seed)
    say(f"forward and backward on {world} ranks" + (f", then {steps} SGD steps" if steps else "") + " ...")
    if opts.cuda_graph:
        graphed = GraphedStep(module, batch)  # its warm-up steps compute gradients, never step the weights
        module.rng_step = 0  # the compared step draws step 0's random values, as the reference does

        def forward_backward(b):
            return graphed(*b)
    else:

        def forward_backward(b):
            out = module(*b)
            out.backward()
            return out

    loss = forward_backward(batch)
    total = module.global_loss(loss)
    grads = full_grad_dict(module)
    module.zero_grad(set_to_none=True)
    step_losses = []
    if steps:
        # over each rank's rows of the weights ZeRO splits, all-gathered after each step (hidup.codegen.zero)
        opt = module.bind_optimizer(torch.optim.SGD(module.optimizer_parameters(), lr=1e-2))
        for _ in range(steps):
            opt.zero_grad()
            module.zero_grad(set_to_none=True)  # ZeRO-1's whole gradients, which the optimizer does not hold
            step_loss = forward_backward(batch)
            opt.step()
            step_losses.append(float(module.global_loss(step_loss)))
    ran = _Ran(the_plan, module, style, float(total), grads, graphed if opts.cuda_graph else None, step_losses)
    report = _reference_report(ctx, model_name, overrides, seed, ran, say) if ctx.rank == 0 else {}
    if opts.locate is not None:
        failed = [ctx.rank == 0 and _differs(report, opts.locate)]
        torch.distributed.broadcast_object_list(failed, src=0)
        if failed[0]:
            say("finding the first op that differs ...")
            located = _first_mismatch(model_name, overrides, the_plan, ctx, batch, opts)
            report["first_mismatch"] = located
    return report


def _differs(report: dict, tolerance: float) -> bool:
    return not report["loss_rel"] <= tolerance or not all(d <= tolerance for d in report["grads"].values())


def _first_mismatch(model_name, overrides, plan, ctx: Distributed, batch, opts: ParityOptions):
    """:func:`hidup.runtime.locate.first_mismatch` for this job (every rank calls it)."""
    world, device, seed = ctx.world_size, ctx.device, opts.seed

    def model_of():
        return hidup.models.build(model_name, world_size=world, seed=seed, **overrides)[0].to(device)

    model, inputs = hidup.models.build(model_name, world_size=world, seed=seed, **overrides)
    mesh = tuple(getattr(plan, "mesh", None) or ()) or None
    graph = trace(model, inputs, world_size=world, mesh=mesh if mesh and len(mesh) > 1 else None)
    reference_plan = forced(trace(model, inputs, world_size=1), hidup.profiler.load(opts.profile), "data")
    comparison = Comparison(plan, graph, reference_plan, seed=seed, tolerance=opts.locate)
    return first_mismatch(model_of, batch, comparison, ctx.rank, world)


@dataclass
class _Ran:
    """What the plan's ranks computed, for rank 0's comparison (:func:`_reference_report`)."""

    plan: object
    module: object
    style: str
    loss: float
    grads: dict
    graphed: object | None
    step_losses: list[float]


def _reference_report(ctx: Distributed, model_name: str, overrides: dict, seed: int, ran: _Ran, say) -> dict:
    """Rank 0's comparison with the single-device model (:func:`parity_report`)."""
    world, the_plan, steps = ctx.world_size, ran.plan, len(ran.step_losses)
    say("the same step on one device (the reference) ...")
    ref_model, ref_inputs = hidup.models.build(model_name, world_size=world, seed=seed, **overrides)
    with single_device(seed, 0):  # dropout draws the values the plan's ranks draw (hidup.rules.random)
        ref_loss = ref_model(*ref_inputs)
    ref_loss.backward()
    kinds = sorted({s.kind for s in the_plan.choices.values()}) if hasattr(the_plan, "choices") else []
    report = {
        "model": model_name,
        "style": ran.style,
        "duplication": bool(ran.module.duplication),
        "kinds": kinds,
        "recompute": len(getattr(the_plan, "recompute", None) or []),
        "recompute_selective": len(getattr(the_plan, "recompute_selective", None) or []),
        "reshard": len(getattr(the_plan, "reshard", None) or []),
        "cuda_graph": getattr(ran.graphed, "graph", None) is not None,
        "loss": ran.loss,
        "loss_ref": float(ref_loss.detach()),
        "loss_rel": rel_diff(torch.tensor(ran.loss, dtype=torch.float64), ref_loss),
        "grads": {},
    }
    scale = max((float(p.grad.abs().max()) for p in ref_model.parameters() if p.grad is not None), default=0.0)
    for name, p in ref_model.named_parameters():
        mine, g = ran.grads.get(name), p.grad
        if g is None and mine is None:
            continue
        report["grads"][name] = float("inf") if g is None or mine is None else rel_diff(mine, g, 1e-2 * scale)
    report["grad_rel"] = max(report["grads"].values(), default=0.0)
    if steps:
        ref_model.zero_grad()
        ref_steps = _steps(ref_model, ref_inputs, steps, seed)
        report["steps"], report["steps_ref"] = ran.step_losses, ref_steps
        report["steps_rel"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ran.step_losses, ref_steps))
    return report


def run(opts: VerifyOptions) -> int:
    """Settle the model (the plan's record, or the flags) and the world size -- a plan for another
    world size is refused here, before any rank starts -- then run the ranks and report."""
    if opts.plan is not None:
        if opts.style != "searched":
            raise SystemExit(f"--style {opts.style} forces a plan; it does not combine with --plan")
        plan = Plan.load(opts.plan)
        choice = settle_model(opts.model, plan, opts.plan)
        check_plan_fits(choice, plan, opts.plan)
    else:
        choice = settle_model(opts.model)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CPN=str(choice.world), NNODES="1", NODERANK="0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = env.get("MASTER_PORT") or "0"  # 0: the launcher's store on a free port
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= choice.world else "gloo"
    parity = ParityOptions(
        plan=opts.plan,
        style=opts.style,
        profile=opts.profile,
        duplication=opts.forced_duplication,
        steps=opts.steps,
        seed=opts.seed,
        progress=True,
        mesh=choice.mesh,
        locate=opts.tolerance,
    )
    report = launch(
        parity_report,
        choice.model,
        choice.model_args,
        parity,
        env=env,
        backend=backend,
        timeout_s=opts.dist_timeout,
        announce=True,
    )[0]
    return _print_report(opts, choice, backend, report)


def _print_report(opts: VerifyOptions, choice, backend: str, report: dict) -> int:
    """Print rank 0's report; the exit status (1 when a difference exceeds the tolerance)."""
    plan_text = str(opts.plan) if opts.plan is not None else opts.style
    dup_text = {None: "as the plan says", True: "forced on", False: "forced off"}[opts.forced_duplication]
    on_mesh = mesh_phrase(choice.mesh)
    print(
        f"model {choice.model}, world {choice.world}{on_mesh} ({backend}), plan: {plan_text}, "
        f"duplication {'on' if report['duplication'] else 'off'} ({dup_text}), "
        f"parallelism used: {', '.join(report['kinds'])}"
        f"{', %d layers recomputed' % report['recompute'] if report.get('recompute') else ''}"
        f"{', %d selectively' % report['recompute_selective'] if report.get('recompute_selective') else ''}"
        f"{', %d parameters resharded' % report['reshard'] if report.get('reshard') else ''}"
    )
    tolerance = opts.tolerance
    worst_name, worst = max(report["grads"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    print(f"loss {report['loss']:.8g} vs single device {report['loss_ref']:.8g}: rel diff {report['loss_rel']:.2e}")
    print(f"gradients: {len(report['grads'])} tensors, max rel diff {worst:.2e} ({worst_name})")
    bad = [n for n, d in report["grads"].items() if not d <= tolerance]
    failed = not report["loss_rel"] <= tolerance or bool(bad)
    if "steps" in report:
        print(f"{opts.steps} SGD steps: max rel loss diff {report['steps_rel']:.2e}")
        failed = failed or not report["steps_rel"] <= tolerance * 10
    for n in bad[:10]:
        print(f"  MISMATCH {n}: rel diff {report['grads'][n]:.2e} > {tolerance:g}")
    located = report.get("first_mismatch")
    if located and located["node"]:
        print(
            f"first op that differs: {located['node']} ({located['target']}, {located['source'] or 'source unknown'}): "
            f"{located['why']}, rel diff {located['rel']:.2e}"
        )
    elif located:
        print(f"first op that differs: none; {located['why']}")
    print("FAILED" if failed else "OK: the plan matches the single-device model")
    return 1 if failed else 0
