"""The plans docs/memory.md checks on one GPU: zoo GPT at world 8, data / FSDP-style / FSDP-style
resharded after the forward / tensor, each with recomputation off and on.

    python exp/memory_plans.py --out plans            # writes plans/{data,fsdp,fsdp-reshard,tensor}{,-recompute}.json
    hidup bench-rank --plan plans/data.json ...       # then each plan's rank 0 on one GPU (docs/memory.md)

FSDP-style: every op data-parallel, every weight stored split 8 ways and gathered for use; resharded, the
gathered copy is freed after the forward and gathered again in the backward (``reshard="on"``).  The
recomputed plans recompute every repeated layer (``recompute="on"``) with the same choices otherwise.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import hidup
import hidup.profiler
from hidup.search import forced

CONFIG = dict(layers=8, d_model=1024, heads=16, ffn=4096, seq_len=1024, batch_per_gpu=8, vocab=32000)
WORLD = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the plan files (created)")
    ap.add_argument("--profile", default="h200x4-nvlink", help="profile the plans are searched under")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prof = hidup.profiler.load(args.profile)
    model, inputs = hidup.models.build("gpt", world_size=WORLD, device="meta", **CONFIG)
    graph = hidup.trace(model, inputs, world_size=WORLD)
    source = ("gpt", CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for recompute in ("off", "on"):
            suffix = "-recompute" if recompute == "on" else ""
            kw = dict(duplication=False, model_source=source, recompute=recompute)
            plans = {
                "data": forced(graph, prof, "data", **kw),
                "fsdp": forced(graph, prof, "fsdp", **kw),
                "fsdp-reshard": forced(graph, prof, "fsdp", reshard="on", **kw),
                "tensor": forced(graph, prof, "tensor", **kw),
            }
            for name, plan in plans.items():
                path = plan.save(args.out / f"{name}{suffix}.json")
                print(
                    f"{path}: predicted {plan.memory['total'] / 2**30:.3f} GiB per rank, "
                    f"{len(plan.recompute)} layers recomputed, {len(plan.reshard)} parameters resharded"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
