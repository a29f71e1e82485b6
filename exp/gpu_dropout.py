"""Dropout as hidup draws it, on one GPU: exact under inductor and a captured CUDA graph, and what it costs.

    python exp/gpu_dropout.py [--out results.json]

For the zoo GPT (small shapes, float32) at world 1, compiled with inductor and captured whole
(:class:`hidup.codegen.GraphedStep`), it checks that

* the replayed step gives the loss and gradients of the model run eagerly under
  :func:`hidup.rules.random.single_device` for the same step (float32: inductor reorders sums, so the
  tolerance is a few hundred float32 epsilons);
* each replay draws the next step's values (two replays of one batch differ) and setting
  ``module.rng_step`` back replays the same values bitwise;

and times the captured step with dropout 0.1 against dropout 0 (median of 50 replays after 10), to show
what the counter-based masks cost once inductor fuses them.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import hidup.models
import hidup.profiler
from hidup import codegen
from hidup.codegen.graphs import GraphedStep
from hidup.codegen.params import full_grad_dict
from hidup.codegen.timing import median_seconds
from hidup.frontend.trace import trace
from hidup.rules.random import single_device
from hidup.search import forced

SIZES = dict(layers=4, d_model=512, heads=8, ffn=2048, seq_len=512, batch_per_gpu=8, vocab=8192)


def _build(dropout: float):
    model, inputs = hidup.models.build("gpt", world_size=1, seed=0, dropout=dropout, **SIZES)
    return model.cuda(), tuple(x.cuda() for x in inputs)


def _graphed(dropout: float):
    model, inputs = _build(dropout)
    plan = forced(trace(model, inputs, world_size=1), hidup.profiler.load("h200x4-nvlink"), "data")
    module = codegen.compile(model, plan, 0, 1, inputs, duplication=False, compile=True, seed=7)
    return module, GraphedStep(module, inputs), inputs


def check_exact() -> dict:
    module, step, inputs = _graphed(0.1)
    module.rng_step = 0
    loss0 = float(step(*inputs))
    grads = {k: v.clone() for k, v in full_grad_dict(module).items()}
    loss1 = float(step(*inputs))
    module.rng_step = 0
    again = float(step(*inputs))
    ref, ref_inputs = _build(0.1)
    with single_device(7, 0):
        ref_loss = ref(*ref_inputs)
    ref_loss.backward()
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    worst = max(
        float((grads[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-2 * scale)
        for n, p in ref.named_parameters()
        if p.grad is not None
    )
    tol = 512 * torch.finfo(torch.float32).eps
    out = {
        "loss_step0": loss0,
        "loss_ref": float(ref_loss),
        "loss_rel": abs(loss0 - float(ref_loss)) / abs(float(ref_loss)),
        "grad_rel": worst,
        "tolerance": tol,
        "loss_step1": loss1,
        "step0_again_bitwise": again == loss0,
        "steps_differ": loss1 != loss0,
        "graph": step.mode,
    }
    out["ok"] = out["loss_rel"] <= tol and worst <= tol and out["step0_again_bitwise"] and out["steps_differ"]
    return out


def time_step(dropout: float) -> float:
    module, step, inputs = _graphed(dropout)
    for _ in range(10):
        step(*inputs)
    return median_seconds(lambda: step(*inputs), torch.device("cuda"), 50) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": SIZES}
    result["exact"] = check_exact()
    print(json.dumps(result["exact"]), flush=True)
    result["ms_dropout_0.1"] = time_step(0.1)
    result["ms_dropout_0"] = time_step(0.0)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("ms")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["exact"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
