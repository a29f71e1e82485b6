"""Search-time study: how long the search takes as the model and the cluster grow.

BERT-SGMoE at the paper's defaults except the number of layers, for layers in {4, 8, 16, 32, 48} and
world sizes in {2, 4, 8, 16, 32, 64} (2 experts per GPU, so the expert count grows with the world).
Each model is built on the meta device and traced once per world size; the time reported is the
search alone (DP with duplication, paper profile), the median of ``--repeat`` runs.

Writes ``docs/search_time.json``, ``docs/search_time.md`` (table + command + host) and
``docs/search_time.png`` (needs matplotlib: ``pip install -e .[bench]``).  ``--render JSON`` redraws
the table and the figure from a recorded ``search_time.json`` (its command and host kept) without
measuring.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import hidup.models
import hidup.profiler
from hidup.frontend.trace import trace
from hidup.search import search

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, layers: int, world: int, profile, algorithm: str, repeat: int) -> dict:
    t0 = time.perf_counter()
    m, inputs = hidup.models.build(model, world_size=world, device="meta", layers=layers)
    graph = trace(m, inputs, world_size=world)
    trace_s = time.perf_counter() - t0
    times, plan = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = search(graph, profile, world_size=world, algorithm=algorithm, duplication=True)
        times.append(time.perf_counter() - t0)
    return {
        "model": model,
        "layers": layers,
        "world": world,
        "nodes": len(graph.nodes),
        "trace_s": trace_s,
        "search_s": statistics.median(times),
        "predicted_iteration_s": plan.predicted["total"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert-sgmoe")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--profile", default="paper-v100-9.7gbps")
    p.add_argument("--algorithm", default="dp", choices=("dp", "ilp"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="write the table and figure from a recorded search_time.json (no measuring)",
    )
    args = p.parse_args(argv)

    if args.render is not None:
        try:
            recorded = json.loads(args.render.read_text())
            rows, host, command = recorded["rows"], recorded["host"], recorded["command"]
            args.profile = recorded["profile"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--render {args.render}: not a search_time.json this script wrote ({e})")
        args.layers = sorted({r["layers"] for r in rows})
        args.worlds = sorted({r["world"] for r in rows})
        args.model = rows[0]["model"] if rows else args.model
        if m := re.search(r"--repeat (\d+)", command):
            args.repeat = int(m.group(1))
    else:
        profile = hidup.profiler.load(args.profile)
        rows = []
        for layers in args.layers:
            for world in args.worlds:
                r = measure(args.model, layers, world, profile, args.algorithm, args.repeat)
                rows.append(r)
                print(
                    f"layers {layers:3d} world {world:3d}: {r['nodes']:5d} nodes, trace {r['trace_s']:.2f} s, "
                    f"search {r['search_s']:.3f} s",
                    flush=True,
                )
        host = {
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "cpus": __import__("os").cpu_count(),
        }
        command = ("python exp/search_time.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search_time.json").write_text(
        json.dumps({"command": command, "host": host, "profile": args.profile, "rows": rows}, indent=1)
    )
    lines = [
        f"# Search time ({args.model}, {args.algorithm.upper()} with duplication, profile {args.profile})",
        "",
        f"Command: `{command}`  ",
        f"Host: {host['cpus']} CPUs ({host['machine']}), Python {host['python']}",
        "",
        "Search seconds (median of %d); rows: layers, columns: world size." % args.repeat,
        "",
        "| layers | " + " | ".join(str(w) for w in args.worlds) + " |",
        "|---|" + "---|" * len(args.worlds),
    ]
    for layers in args.layers:
        cells = [f"{r['search_s']:.3f}" for r in rows if r["layers"] == layers]
        lines.append(f"| {layers} | " + " | ".join(cells) + " |")
    (args.out / "search_time.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipped the figure (pip install -e .[bench])")
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for world in args.worlds:
        pts = [(r["layers"], r["search_s"]) for r in rows if r["world"] == world]
        ax.plot(*zip(*pts), marker="o", label=f"{world} GPUs")
    ax.set_xlabel("layers")
    ax.set_ylabel("search time (s)")
    ax.set_title(f"{args.model}: search time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "search_time.png", dpi=120)
    print(f"wrote {args.out / 'search_time.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
