"""Time the gradient sync of a model's replicated parameters (hidup.codegen.grads.GradBucketer) on
the ranks of a process group, two ways, alternating:

* ``in-place``: the runtime's rule, gradients of at least ``hidup.ir.GRAD_PACK_BYTES`` summed where
  they lie in one coalesced all-reduce per bucket, the smaller ones packed into a flat buffer;
* ``packed``: every gradient copied into its bucket's flat buffer (as DDP does) and the sum viewed
  back (``GradBucketer(..., pack_bytes=inf)``).

Each timed sync launches every bucket and waits for all of them (no backward to overlap), so the
figure is the sync's own cost: the copies on the compute stream plus the all-reduces. Best of
``--rounds`` windows of ``--steps`` syncs between two device syncs, after ``--warmup`` syncs.

Usage: torchrun --nproc_per_node 2 exp/grad_sync.py --model bert-sgmoe --world-model 4 --out r.json
(``--device cpu`` runs it on gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import hidup.models
from hidup.codegen import GradBucketer
from hidup.ir import GRAD_BUCKET_MB


def _sync(bucketer) -> None:
    for bucket in bucketer.buckets:
        bucket.ready = {id(p) for p in bucket.params}
        bucketer._launch(bucket)
    bucketer._next = len(bucketer.buckets)
    bucketer._finish()


def _time(bucketer, device, steps: int, rounds: int, warmup: int) -> float:
    def fence():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(warmup):
        _sync(bucketer)
    best = float("inf")
    for _ in range(rounds):
        fence()
        start = time.perf_counter()
        for _ in range(steps):
            _sync(bucketer)
        fence()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-sgmoe", help="zoo model whose parameters are synced")
    ap.add_argument("--world-model", type=int, default=4, help="the world size the model is configured for")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--bucket-mb", type=float, default=GRAD_BUCKET_MB)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file written by rank 0")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, _ = hidup.models.build(args.model, world_size=args.world_model, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    bucketers = {
        "in-place": GradBucketer(params, None, args.bucket_mb),
        "packed": GradBucketer(params, None, args.bucket_mb, pack_bytes=float("inf")),
    }
    bucketer = bucketers["in-place"]
    big = sum(p.numel() * p.element_size() for p in params if p.numel() * p.element_size() >= bucketer.pack_bytes)
    total = sum(p.numel() * p.element_size() for p in params)
    results = {"in-place": [], "packed": []}
    for _ in range(2):  # alternate, twice each
        for name, b in bucketers.items():
            results[name].append(_time(b, device, args.steps, args.rounds, args.warmup))
    record = {
        "config": {
            **vars(args),
            "world": dist.get_world_size(),
            "backend": dist.get_backend(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "buckets": len(bucketer.buckets),
            "gradient_bytes": total,
            "bytes_summed_in_place": big,
        },
        "sync_ms_best": {k: min(v) for k, v in results.items()},
        "sync_ms_each": results,
    }
    if dist.get_rank() == 0:
        print(json.dumps(record, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
