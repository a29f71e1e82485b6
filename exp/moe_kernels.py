"""The routed-experts math on a GPU: torch's grouped kernel against the masked form, and its time.

For each case ``(tokens, hidden, ffn, experts, k, local, offset)`` the op's math
(:func:`hidup.rules.experts.routed_experts_math`) runs twice on the same inputs in bfloat16 autocast:
once as it runs (torch's grouped kernel, :func:`hidup.rules.grouped.native_grouped_mm`) and once with
the grouped matmul forced to the masked form of dense matmuls, in float32, as the reference.  It
prints the largest difference of the output and of each gradient relative to the reference's
largest value, against bfloat16's tolerance ``8 eps_bf16`` (the inputs are rounded to bfloat16 once
and each product sums ``hidden`` or ``ffn`` terms in float32), and the forward and forward+backward
times of the op eagerly and compiled (inductor) in a CUDA graph.  ``local < experts`` with an
``offset`` is one rank's slice under the expert signature: its rows of other experts must add nothing;
with ``N T`` tokens it is the all-gather dispatcher's rank, whose pairs of other ranks' experts pad
the grouped kernels' rows (``N T k`` rows, ``T k`` of them its own): against the one-device case of
``T`` tokens it shows what the padding costs.

    python exp/moe_kernels.py --out moe_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from unittest import mock

import torch

from hidup.codegen.timing import graph_time
from hidup.rules import grouped
from hidup.rules.experts import routed_experts_math

# (tokens, hidden, ffn, experts in the layer, k, experts held, first expert held)
CASES = [
    (4096, 1024, 2816, 8, 2, 8, 0),  # Mixtral-style layer, one device's share
    (4096, 1024, 2816, 8, 2, 2, 2),  # its world-4 rank 1 under the expert signature
    (4096, 1024, 384, 128, 8, 16, 0),  # Qwen3-MoE-style, world-8 rank 0
    (4096, 1024, 512, 64, 6, 8, 0),  # DeepSeek-V3-style, world-8 rank 0
    # the all-gather dispatcher's rank: the N T gathered tokens' N T k pairs, of which its experts take T k
    (16384, 1024, 2816, 8, 2, 2, 0),  # Mixtral-style, world-4 rank 0
    (32768, 1024, 384, 128, 8, 16, 0),  # Qwen3-MoE-style, world-8 rank 0
]


def _inputs(tokens, hidden, ffn, experts, k, local, offset, gen):
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", requires_grad=True)
    idx = torch.rand(tokens, experts, generator=gen, device="cuda").topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=gen, device="cuda").requires_grad_()
    gate_up = (torch.randn(local, 2 * ffn, hidden, generator=gen, device="cuda") / hidden**0.5).requires_grad_()
    down = (torch.randn(local, hidden, ffn, generator=gen, device="cuda") / ffn**0.5).requires_grad_()
    return x, idx, w, gate_up, down


def _run(inputs, offset, gy, masked: bool):
    x, idx, w, gate_up, down = inputs
    for t in (x, w, gate_up, down):
        t.grad = None
    # the reference: the masked form in float32; else torch's kernel in bfloat16 autocast
    mode = (
        mock.patch.object(grouped, "native_grouped_mm", lambda a, b: False)
        if masked
        else torch.autocast("cuda", dtype=torch.bfloat16)
    )
    with mode:
        y = routed_experts_math(x, idx, w, gate_up, down, offset, "silu")
    y.backward(gy)
    return [y.detach().float()] + [t.grad.float() for t in (x, w, gate_up, down)]


def _times(inputs, offset, gy) -> dict:
    x, idx, w, gate_up, down = inputs
    out = {}
    compiled = torch.compile(routed_experts_math, dynamic=False)
    for name, fn in (("eager", routed_experts_math), ("compiled", compiled)):

        def fwd(fn=fn):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(x, idx, w, gate_up, down, offset, "silu")

        def both(fwd=fwd):
            torch.autograd.grad(fwd(), (x, w, gate_up, down), gy)

        for _ in range(3):
            both()
        torch.cuda.synchronize()
        fwd_s, both_s = graph_time(fwd, torch.device("cuda"), 0.2, 8), graph_time(both, torch.device("cuda"), 0.4, 4)
        out[name] = {  # None: the CUDA graph capture failed (a host synchronization)
            "forward_ms": None if fwd_s is None else fwd_s * 1e3,
            "fwd_bwd_ms": None if both_s is None else both_s * 1e3,
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    tol = 8 * torch.finfo(torch.bfloat16).eps
    results, ok = [], True
    for case in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = _inputs(*case, gen)
        offset = case[-1]
        gy = torch.randn(case[0], case[1], generator=gen, device="cuda")
        got = _run(inputs, offset, gy, masked=False)
        ref = _run(inputs, offset, gy, masked=True)
        errs = {
            name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            for name, a, b in zip(("y", "x", "w", "gate_up", "down"), got, ref)
        }
        case_ok = all(e <= tol for e in errs.values()) and all(torch.isfinite(g).all() for g in got)
        ok &= case_ok
        times = _times(inputs, offset, gy)
        results.append({"case": case, "relative_errors": errs, "within_tolerance": case_ok, "times": times})
        print(
            f"case {case}: max rel err {max(errs.values()):.2e} (tol {tol:.1e}) {'ok' if case_ok else 'FAILED'}; "
            + "; ".join(f"{m} fwd {t['forward_ms']} ms, fwd+bwd {t['fwd_bwd_ms']} ms" for m, t in times.items()),
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": results}, f, indent=1
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
