"""Parity suite: every zoo model x plan style x duplication, inside ONE process group.

For each configuration the model runs under the plan on all ranks and is compared on rank 0 with the
single-device model (same weights, same batch): relative difference of the loss, of every gradient
(gathered to the logical layout) and of the losses over ``--steps`` SGD steps.  Works on gloo (CPU)
and NCCL (GPUs, where duplication runs the two copies on two CUDA streams).

    python exp/parity.py --world 4                       # CPU, gloo
    NCCL_NVLS_ENABLE=0 python exp/parity.py --world 4    # on a 4-GPU host, NCCL
    NCCL_NVLS_ENABLE=0 python exp/parity.py --world 4 --cuda-graph   # the same, each step one CUDA graph
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

import hidup.models
from hidup.runtime.launch import launch
from hidup.runtime.verify import parity_report

SMALL = dict(layers=2, d_model=32, heads=4, ffn=64, batch_per_gpu=2, vocab=64)
STYLES = {"mlp": ("searched", "data", "tensor"), "gpt": ("searched", "data", "tensor")}
MOE_STYLES = ("searched", "data", "tensor", "expert")


def configs(models, styles, duplications):
    for m in models:
        seq = 16 if m.startswith("vit") else 8
        for style in styles or STYLES.get(m, MOE_STYLES):
            for dup in duplications:
                yield m, dict(SMALL, seq_len=seq), style, dup


def _rank(ctx, args) -> list:
    out = []
    for m, over, style, dup in configs(args.models, args.styles, args.duplication):
        t0 = time.perf_counter()
        try:
            r = parity_report(
                ctx,
                m,
                over,
                style=style,
                duplication=dup,
                steps=args.steps,
                profile=args.profile,
                cuda_graph=args.cuda_graph,
            )
        except Exception as e:  # recorded, the sweep goes on
            r = {"model": m, "style": style, "duplication": dup, "error": f"{type(e).__name__}: {e}"}
            if ctx.world_size > 1:
                raise
        if ctx.rank == 0:
            r["seconds"] = time.perf_counter() - t0
            r.pop("grads", None)
            ok = "error" not in r and max(r["loss_rel"], r["grad_rel"], r.get("steps_rel", 0.0) / 10) <= args.tolerance
            r["ok"] = ok
            print(
                f"{m:18s} {style:9s} dup={str(dup):5s} "
                + ("graph " if r.get("cuda_graph") else "")
                + (
                    f"loss {r['loss_rel']:.1e} grads {r['grad_rel']:.1e} steps {r.get('steps_rel', 0):.1e} "
                    f"[{','.join(r['kinds'])}] {'OK' if ok else 'MISMATCH'}"
                    if "error" not in r
                    else r["error"]
                ),
                flush=True,
            )
            out.append(r)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", nargs="+", default=hidup.models.names())
    p.add_argument("--styles", nargs="+", default=None, help="default: searched, data, tensor (+ expert for MoE)")
    p.add_argument(
        "--duplication",
        nargs="+",
        type=lambda s: s.lower() in ("1", "on", "true"),
        default=[False, True],
        help="on/off values to test (default: off on)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", default="paper-v100-9.7gbps")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="run the compiled modules' forward+backward as one captured CUDA graph (GPUs)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(CPN=str(args.world), NNODES="1", NODERANK="0", MASTER_ADDR="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "gloo"
    print(f"parity suite: world {args.world}, backend {backend}, torch {torch.__version__}", flush=True)
    rows = launch(_rank, args, env=env, backend=backend, timeout_s=300)[0]
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} configurations in parity (tolerance {args.tolerance:g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"world": args.world, "backend": backend, "torch": torch.__version__, "rows": rows}, indent=1)
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
