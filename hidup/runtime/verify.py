"""``hidup verify``: prove that a plan computes what the single-device model computes.

Runs the model under the plan on N processes (gloo on CPUs, NCCL on GPUs) and on one device with the
same weights and the same global batch, and reports the largest relative difference of the loss and
of every parameter gradient (gradients are gathered to their logical, unsharded layout first):

    rel(a, b) = max|a - b| / max(max|b|, tiny)

The command exits non-zero when any difference exceeds ``--tolerance`` (1e-5 by default, fp32).
With ``--steps K`` it also takes K optimizer steps (SGD) on both sides and compares the losses.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch

from hidup.runtime.launch import Distributed, launch


def add_verify_args(p: argparse.ArgumentParser) -> None:
    from hidup.cli import DEFAULT_PROFILE, add_model_args

    add_model_args(p, world_default=2)
    p.add_argument("--plan", type=Path, default=None, help="plan JSON (default: search one now)")
    p.add_argument("--style", choices=("searched", "data", "tensor", "expert"), default="searched",
                   help="without --plan: a searched plan or a forced data/tensor/expert-parallel one")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile for the search")
    p.add_argument("--no-duplication", action="store_true", help="verify the plan without duplication")
    p.add_argument("--steps", type=int, default=0, help="also compare K optimizer steps (default 0)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest allowed relative difference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist-timeout", type=float, default=120.0, help="seconds before a hung collective fails")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _plan(args, model, inputs, world):
    from hidup.plan import Plan

    if args.plan is not None:
        return Plan.load(args.plan)
    import hidup.profiler
    from hidup.search import forced, search
    from hidup.trace import trace

    graph = trace(model, inputs, world_size=world)
    profile = hidup.profiler.load(args.profile)
    if args.style == "searched":
        return search(graph, profile, world_size=world, duplication=not args.no_duplication)
    plan = forced(graph, profile, args.style)
    plan.duplication = not args.no_duplication
    return plan


def _steps(model, inputs, steps: int, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _run_rank(ctx: Distributed, args) -> dict:
    import hidup.models
    from hidup.cli import model_overrides
    from hidup.codegen import compile
    from hidup.codegen.params import full_grad_dict

    world, device = ctx.world_size, ctx.device
    overrides = model_overrides(args)
    model, inputs = hidup.models.build(args.model, world_size=world, seed=args.seed, **overrides)
    plan = _plan(args, model, inputs, world)
    module = compile(model.to(device), plan, ctx.rank, world, tuple(x.to(device) for x in inputs),
                     duplication=False if args.no_duplication else None)
    batch = tuple(x.to(device) for x in inputs)
    loss = module(*batch)
    loss.backward()
    total = module.global_loss(loss)
    grads = full_grad_dict(module)
    module.zero_grad(set_to_none=True)
    step_losses = []
    if args.steps:
        opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(args.steps):
            l = module(*batch)
            l.backward()
            opt.step()
            opt.zero_grad()
            step_losses.append(float(module.global_loss(l)))
    if ctx.rank != 0:
        return {}
    ref_model, _ = hidup.models.build(args.model, world_size=world, seed=args.seed, **overrides)
    ref_loss = ref_model(*inputs)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    report = {"plan": f"{getattr(plan, 'algorithm', '?')} (duplication {module.duplication})",
              "loss": float(total), "loss_ref": float(ref_loss), "loss_rel": rel_diff(total, ref_loss),
              "grads": {}}
    for name, g in ref_grads.items():
        mine = grads.get(name)
        if g is None and mine is None:
            continue
        if g is None or mine is None:
            report["grads"][name] = float("inf")
            continue
        report["grads"][name] = rel_diff(mine, g)
    if args.steps:
        ref_model.zero_grad()
        ref_steps = _steps(ref_model, inputs, args.steps)
        report["steps"] = step_losses
        report["steps_ref"] = ref_steps
        report["steps_rel"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(step_losses, ref_steps))
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CPN=str(args.world), NNODES="1", NODERANK="0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = env.get("MASTER_PORT") or str(_free_port())
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "gloo"
    report = launch(_run_rank, args, env=env, backend=backend, timeout_s=args.dist_timeout)[0]
    worst_name, worst = max(report["grads"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    print(f"model {args.model}, world {args.world} ({backend}), plan {report['plan']}")
    print(f"loss {report['loss']:.8g} vs single device {report['loss_ref']:.8g}: rel diff {report['loss_rel']:.2e}")
    print(f"gradients: {len(report['grads'])} tensors, max rel diff {worst:.2e} ({worst_name})")
    bad = [n for n, d in report["grads"].items() if not d <= args.tolerance]
    failed = not report["loss_rel"] <= args.tolerance or bool(bad)
    if "steps" in report:
        print(f"{args.steps} SGD steps: max rel loss diff {report['steps_rel']:.2e}")
        failed = failed or not report["steps_rel"] <= args.tolerance * 10
    for n in bad[:10]:
        print(f"  MISMATCH {n}: rel diff {report['grads'][n]:.2e} > {args.tolerance:g}")
    print("FAILED" if failed else "OK: the plan matches the single-device model")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hidup verify", description=__doc__.split("\n\n")[0])
    add_verify_args(p)
    return run(p.parse_args(argv))
