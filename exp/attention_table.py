"""Measure this GPU's attention table (:mod:`hidup.profiler.attention`) into an existing profile.

``hidup profile`` measures the table with everything else; this measures only the table, in each
storage dtype of ``--dtypes``, on the default grid (:func:`hidup.profiler.measure.device.default_attention_grid`),
and writes ``--profile`` with it (replacing any table it had) to ``--out``:

    python exp/attention_table.py --profile h200.json --out h200-attention.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hidup.profiler.measure.device import attention_table, default_attention_grid
from hidup.profiler.profile import ATTENTION_DTYPES, load, save


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="the profile JSON the table goes into")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"storage dtypes of {ATTENTION_DTYPES} (default fp32,bf16)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timing per dtype (default 20)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("exp/attention_table.py: no GPU here; the attention table is measured on a GPU", file=sys.stderr)
        return 2
    dtypes = [d for d in args.dtypes.split(",") if d]
    if set(dtypes) - set(ATTENTION_DTYPES):
        print(f"--dtypes: not storage dtypes: {sorted(set(dtypes) - set(ATTENTION_DTYPES))}", file=sys.stderr)
        return 2
    profile = load(args.profile)
    device = torch.device("cuda", torch.cuda.current_device())
    grid = default_attention_grid(device)
    for d in dtypes:
        start = time.perf_counter()
        profile.attention[d] = attention_table(device, d, *grid, budget_s=args.budget)
        print(f"attention {d}: {time.perf_counter() - start:.0f} s", flush=True)
    profile.notes += (
        f"; attention {', '.join(dtypes)} re-measured on {torch.cuda.get_device_name(device)} with torch "
        f"{torch.__version__} on head dims x seqs x rows {[list(a) for a in grid]}, each in a CUDA graph"
    )
    save(profile, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
