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
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import hidup.models
import hidup.profiler
from hidup import codegen
from hidup.codegen.graphs import GraphedStep
from hidup.codegen.params import full_grad_dict
from hidup.frontend.trace import trace
from hidup.plan import Plan
from hidup.rules.random import single_device
from hidup.runtime.launch import Distributed, launch, positive_seconds
from hidup.runtime.locate import first_mismatch
from hidup.runtime.options import DEFAULT_PROFILE, add_model_args, mesh_phrase, settle_model
from hidup.search import STYLES, forced, search


def add_verify_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, world_default=2)
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="plan JSON (default: search one now); it records its model and world size",
    )
    p.add_argument(
        "--style",
        choices=("searched", *STYLES),
        default="searched",
        help="without --plan: a searched plan or a forced data/tensor/expert-parallel or FSDP-style one",
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile for the search")
    p.add_argument(
        "--duplication",
        choices=("plan", "on", "off"),
        default="plan",
        help="compile as the plan says (default, as `hidup train` on the CPU), or force duplication on "
        "or off; without --plan, off also searches without it",
    )
    p.add_argument("--no-duplication", action="store_true", help="the same as --duplication off")
    p.add_argument("--steps", type=int, default=0, help="also compare K optimizer steps (default 0)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest allowed relative difference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dist-timeout", type=positive_seconds, default=120.0, help="seconds before a hung collective fails"
    )


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
    ctx: Distributed,
    model_name: str,
    overrides: dict,
    *,
    plan=None,
    style: str = "searched",
    profile: str = "paper-v100-9.7gbps",
    duplication: bool | None = True,
    steps: int = 0,
    seed: int = 0,
    cuda_graph: bool = False,
    progress: bool = False,
    mesh: tuple[int, ...] | None = None,
    locate: float | None = None,
) -> dict:
    """Run one plan on every rank of ``ctx`` and, on rank 0, compare with the single-device model.

    ``model_name`` is a zoo name or ``package.module:function`` and ``overrides`` its arguments.
    ``duplication`` True or False forces the compiled module's two copies on or off; None compiles
    the plan as it says (as ``hidup train`` does), and lets a searched plan use duplication.
    Every rank must call it.  Returns (rank 0) the loss, the per-gradient relative differences and,
    with ``steps``, the losses of ``steps`` SGD steps on both sides; other ranks return ``{}``.
    ``cuda_graph`` runs the compiled module's forward and backward through
    :class:`hidup.codegen.GraphedStep` (captured as one CUDA graph on GPUs, eager elsewhere).
    ``progress``: rank 0 prints a line on stderr as each phase starts.  ``mesh``: without ``plan``, the
    plan is searched (or forced) for this device mesh of several axes.  ``locate``: a tolerance above
    which (loss or any gradient) every rank runs :func:`hidup.runtime.locate.first_mismatch` and the
    report names the first op that differs (``first_mismatch``)."""

    def say(text: str) -> None:
        if progress and ctx.rank == 0:
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
        profile=profile,
        duplication=duplication is not False,
        mesh=mesh,
    )
    batch = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    say("compiling the rank programs (torch.export of the step, then the rewrite) ...")
    module = codegen.compile(model.to(device), the_plan, ctx.rank, world, batch, duplication=duplication, seed=seed)
    say(f"forward and backward on {world} ranks" + (f", then {steps} SGD steps" if steps else "") + " ...")
    if cuda_graph:
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
        opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            opt.zero_grad()
            step_loss = forward_backward(batch)
            opt.step()
            step_losses.append(float(module.global_loss(step_loss)))
    ran = _Ran(the_plan, module, style, float(total), grads, graphed if cuda_graph else None, step_losses)
    report = _reference_report(ctx, model_name, overrides, seed, ran, say) if ctx.rank == 0 else {}
    if locate is not None:
        failed = [ctx.rank == 0 and _differs(report, locate)]
        torch.distributed.broadcast_object_list(failed, src=0)
        if failed[0]:
            say("finding the first op that differs ...")
            located = _first_mismatch(model_name, overrides, the_plan, ctx, batch, seed, profile, locate)
            report["first_mismatch"] = located
    return report


def _differs(report: dict, tolerance: float) -> bool:
    return not report["loss_rel"] <= tolerance or not all(d <= tolerance for d in report["grads"].values())


def _first_mismatch(model_name, overrides, plan, ctx: Distributed, batch, seed: int, profile: str, tolerance: float):
    """:func:`hidup.runtime.locate.first_mismatch` for this job (every rank calls it)."""
    world, device = ctx.world_size, ctx.device

    def model_of():
        return hidup.models.build(model_name, world_size=world, seed=seed, **overrides)[0].to(device)

    model, inputs = hidup.models.build(model_name, world_size=world, seed=seed, **overrides)
    mesh = tuple(getattr(plan, "mesh", None) or ()) or None
    graph = trace(model, inputs, world_size=world, mesh=mesh if mesh and len(mesh) > 1 else None)
    reference_plan = forced(trace(model, inputs, world_size=1), hidup.profiler.load(profile), "data")
    return first_mismatch(model_of, batch, plan, graph, reference_plan, ctx.rank, world, seed, tolerance)


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


def _duplication(args) -> bool | None:
    """``--duplication`` (``--no-duplication`` meaning off): None for the plan's setting."""
    return {"plan": None, "on": True, "off": False}["off" if args.no_duplication else args.duplication]


def _run_rank(ctx: Distributed, args) -> dict:
    return parity_report(
        ctx,
        args.model,
        args.model_args,
        plan=args.plan,
        style=args.style,
        profile=args.profile,
        duplication=_duplication(args),
        steps=args.steps,
        seed=args.seed,
        progress=True,
        mesh=getattr(args, "mesh", None),
        locate=args.tolerance,
    )


def run(args: argparse.Namespace) -> int:
    """Settle the model (the plan's record, or the flags) and the world size -- a plan for another
    world size is refused here, before any rank starts -- then run the ranks and report."""
    if args.plan is not None:
        if args.style != "searched":
            raise SystemExit(f"--style {args.style} forces a plan; it does not combine with --plan")
        settle_model(args, Plan.load(args.plan), args.plan)
    else:
        settle_model(args)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CPN=str(args.world), NNODES="1", NODERANK="0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = env.get("MASTER_PORT") or "0"  # 0: the launcher's store on a free port
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "gloo"
    report = launch(_run_rank, args, env=env, backend=backend, timeout_s=args.dist_timeout, announce=True)[0]
    plan_text = str(args.plan) if args.plan is not None else args.style
    dup_text = {None: "as the plan says", True: "forced on", False: "forced off"}[_duplication(args)]
    on_mesh = mesh_phrase(getattr(args, "mesh", None))
    print(
        f"model {args.model}, world {args.world}{on_mesh} ({backend}), plan: {plan_text}, "
        f"duplication {'on' if report['duplication'] else 'off'} ({dup_text}), "
        f"parallelism used: {', '.join(report['kinds'])}"
        f"{', %d layers recomputed' % report['recompute'] if report.get('recompute') else ''}"
        f"{', %d parameters resharded' % report['reshard'] if report.get('reshard') else ''}"
    )
    worst_name, worst = max(report["grads"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    print(f"loss {report['loss']:.8g} vs single device {report['loss_ref']:.8g}: rel diff {report['loss_rel']:.2e}")
    print(f"gradients: {len(report['grads'])} tensors, max rel diff {worst:.2e} ({worst_name})")
    bad = [n for n, d in report["grads"].items() if not d <= args.tolerance]
    failed = not report["loss_rel"] <= args.tolerance or bool(bad)
    if "steps" in report:
        print(f"{args.steps} SGD steps: max rel loss diff {report['steps_rel']:.2e}")
        failed = failed or not report["steps_rel"] <= args.tolerance * 10
    for n in bad[:10]:
        print(f"  MISMATCH {n}: rel diff {report['grads'][n]:.2e} > {args.tolerance:g}")
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
