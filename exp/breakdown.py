"""Per-iteration time breakdown from a chrome trace: computation, communication, and hidden communication.

This is the HiDup paper's Table III.  A trace (``torch.profiler`` ``export_chrome_trace`` of one
training iteration on one rank) holds device events ``ph == "X"`` with a start ``ts`` and a duration
``dur`` (microseconds) on a stream ``tid``.  Each device event is classified:

* communication ``M``: NCCL kernels (name contains ``nccl``) and, as in the paper, device-to-device
  copies (``Memcpy DtoD``; ``dtod_as_comm=False`` counts them as computation);
* computation ``C``: every other kernel, memset and memcpy.

With ``U(S)`` the union of the intervals of a set of events and ``|.|`` its length:

    compute  = |U(C)|                      communication = |U(M)|
    hidden   = |U(M) ∩ U(C)|               communication that ran while a compute kernel ran
    exposed  = communication - hidden      communication nothing overlapped
    span     = last end - first start      (over C and M)
    idle     = span - |U(C) ∪ U(M)|
    hidden fraction = hidden / communication
    concurrent comm = time during which communication of two or more streams runs at once

The last one shows collectives sharing the network: duplication's two copies, each on its own
communicator and stream, and the gradient all-reduce beside them.  A trace of several iterations
(``ProfilerStep#N`` annotations, as ``hidup train --chrome-trace`` writes) is divided by their
number (``steps``), so the table is always per iteration.

Events on one stream never overlap, so ``hidden > 0`` means communication and computation ran on
different streams at the same time (DDP's bucketed all-reduce, FSDP's prefetch, duplication's
two copies).  An NCCL kernel's duration includes the time it waits for its peers, so
"communication" is the time the device spent inside collectives, as the trace shows it.

Traces without device events (CPU runs) are read from ``cpu_op`` events: ``c10d::``/``gloo:``/
``nccl:`` ops are communication and the other ops, minus the communication intervals they enclose,
computation (``source: cpu`` in the result; an approximation, since gloo works on its own threads).

Command line::

    python exp/breakdown.py exp/records/traces/*.json.gz           # table to stdout
    python exp/breakdown.py TRACE... --doc docs/benchmarks.md     # and into its "breakdown" section
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, not as exp.<module>: `exp` comes from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exp.report import ms, save_json, table, text_table, write_section

__all__ = [
    "analyze",
    "analyze_file",
    "load_events",
    "union",
    "intersect_length",
    "total_length",
    "breakdown_rows",
    "BREAKDOWN_HEADERS",
]

_CPU_COMM = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms)", re.IGNORECASE)
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def union(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted union of ``(start, end)`` intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total_length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect_length(a, b) -> float:
    """``|U(a) ∩ U(b)|`` by a sweep over the two disjoint sorted unions."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(a, b) -> list[tuple[float, float]]:
    """``U(a) \\ U(b)`` as disjoint intervals."""
    out = []
    ub = union(b)
    for s, e in union(a):
        cur = s
        for bs, be in ub:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def load_events(trace) -> list[dict]:
    """The event list of a chrome trace given as a path, a dict (``traceEvents``) or a list."""
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        try:
            if path.suffix == ".gz":
                with gzip.open(path, "rt") as f:
                    trace = json.load(f)
            else:
                trace = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError, EOFError) as e:
            raise ValueError(f"{path}: not a chrome trace (invalid JSON: {e})") from None
    if isinstance(trace, dict):
        trace = trace.get("traceEvents")
    if not isinstance(trace, list):
        raise ValueError(
            "a chrome trace is a JSON list of events or an object with a 'traceEvents' list; "
            "export one with torch.profiler.profile(...).export_chrome_trace(path)"
        )
    return trace


def concurrent_length(by_stream: dict) -> float:
    """Time covered by the intervals of at least two of the streams (``stream -> intervals``)."""
    edges = []
    for intervals in by_stream.values():
        for s, e in union(intervals):
            edges += [(s, 1), (e, -1)]
    total, depth, last = 0.0, 0, None
    for t, d in sorted(edges, key=lambda x: (x[0], x[1])):
        if depth >= 2 and last is not None:
            total += t - last
        depth += d
        last = t
    return total


def _steps(events: list[dict]) -> int:
    """Iterations in the trace: distinct ``ProfilerStep#N`` annotations (1 when there are none)."""
    return max(1, len({e.get("name") for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}))


def _is_comm_device(ev: dict, dtod_as_comm: bool) -> bool:
    name = str(ev.get("name", ""))
    if "nccl" in name.lower():
        return True
    return dtod_as_comm and ev.get("cat") == "gpu_memcpy" and ("DtoD" in name or "Device -> Device" in name)


def analyze(trace, *, dtod_as_comm: bool = True, device: int | None = None) -> dict:
    """Breakdown of one iteration's trace (see the module docstring); times in seconds."""
    events = [
        e
        for e in load_events(trace)
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("dur"), (int, float))
    ]
    dev_events = [e for e in events if e.get("cat") in _DEVICE_CATS]
    if dev_events:
        devices = sorted({(e.get("args") or {}).get("device", 0) for e in dev_events}, key=lambda d: (d is None, d))
        chosen = devices[0] if device is None else device
        dev_events = [e for e in dev_events if (e.get("args") or {}).get("device", 0) == chosen]
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in dev_events if _is_comm_device(e, dtod_as_comm)]
        comp = [(e["ts"], e["ts"] + e["dur"]) for e in dev_events if not _is_comm_device(e, dtod_as_comm)]
        by_stream: dict = {}  # comm stream -> its intervals
        for e in dev_events:
            if _is_comm_device(e, dtod_as_comm):
                by_stream.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
        streams = {
            "comm": len(by_stream),
            "compute": len({e.get("tid") for e in dev_events if not _is_comm_device(e, dtod_as_comm)}),
        }
        concurrent = concurrent_length(by_stream)
        source, n = "device", len(dev_events)
    else:
        chosen = None
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        comm_ev = [e for e in ops if _CPU_COMM.match(str(e.get("name", "")))]
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in comm_ev]
        comp = subtract(
            [(e["ts"], e["ts"] + e["dur"]) for e in ops if not _CPU_COMM.match(str(e.get("name", "")))], comm
        )
        streams = {"comm": len({e.get("tid") for e in comm_ev}), "compute": len({e.get("tid") for e in ops})}
        source, n = "cpu", len(ops)
        concurrent = 0.0  # gloo's collectives run on its own threads: not visible per stream
    if not comm and not comp:
        raise ValueError(
            "the trace has no device kernels and no cpu_op events to analyze; profile with "
            "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] around one iteration"
        )
    everything = comm + comp
    span = max(e for _, e in everything) - min(s for s, _ in everything)
    c, m = total_length(comp), total_length(comm)
    hidden = intersect_length(comm, comp)
    busy = total_length(everything)
    steps = _steps(events)
    us = 1e-6 / steps
    return {
        "source": source,
        "device": chosen,
        "events": n,
        "steps": steps,
        "span_s": span * us,
        "compute_s": c * us,
        "comm_s": m * us,
        "hidden_s": hidden * us,
        "exposed_s": (m - hidden) * us,
        "idle_s": (span - busy) * us,
        "hidden_fraction": hidden / m if m > 0 else None,
        "concurrent_comm_s": concurrent * us,
        "streams": streams,
        "dtod_as_comm": dtod_as_comm,
    }


def analyze_file(path: str | Path, **kwargs) -> dict:
    out = analyze(path, **kwargs)
    out["trace"] = str(path)
    return out


BREAKDOWN_HEADERS = [
    "run",
    "iteration span (ms)",
    "compute (ms)",
    "comm (ms)",
    "hidden comm (ms)",
    "exposed comm (ms)",
    "hidden %",
    "idle (ms)",
    "concurrent comm (ms)",
]


def breakdown_rows(items: list[tuple[str, dict]]) -> list[list]:
    """Table rows for ``(label, analyze() result)`` pairs."""
    rows = []
    for label, b in items:
        frac = b.get("hidden_fraction")
        rows.append(
            [
                label,
                ms(b["span_s"]),
                ms(b["compute_s"]),
                ms(b["comm_s"]),
                ms(b["hidden_s"]),
                ms(b["exposed_s"]),
                "-" if frac is None else f"{100 * frac:.0f}",
                ms(b["idle_s"]),
                ms(b.get("concurrent_comm_s", 0.0)),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Computation / communication / hidden-communication breakdown of "
        "chrome traces (one training iteration each)."
    )
    p.add_argument("traces", nargs="+", type=Path, help="chrome trace JSON files (.json or .json.gz)")
    p.add_argument(
        "--dtod-compute",
        action="store_true",
        help="count device-to-device copies as computation (default: communication, as HiDup does)",
    )
    p.add_argument("--device", type=int, default=None, help="device index to analyze (default: the lowest)")
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="also write the table into this markdown file's 'breakdown' section (e.g. docs/benchmarks.md)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the numbers as JSON")
    args = p.parse_args(argv)
    items = []
    for path in args.traces:
        if not path.is_file():
            print(f"error: no trace file {path}", file=sys.stderr)
            return 2
        label = path.name.removesuffix(".gz").removesuffix(".json")
        items.append((label, analyze_file(path, dtod_as_comm=not args.dtod_compute, device=args.device)))
    rows = breakdown_rows(items)
    print(text_table(BREAKDOWN_HEADERS, rows))
    if args.json is not None:
        save_json(args.json, {label: b for label, b in items})
    if args.doc is not None:
        cmd = " ".join(["python", "exp/breakdown.py"] + (sys.argv[1:] if argv is None else list(argv)))
        body = (
            "## Time breakdown of one iteration (from traces)\n\n"
            f"Command: `{cmd}`\n\n" + table(BREAKDOWN_HEADERS, rows) + "\n\n"
            "compute / comm: busy time of compute kernels / NCCL kernels"
            + ("" if args.dtod_compute else " and device-to-device copies")
            + "; hidden: communication overlapped by compute on another stream; exposed = comm - hidden; "
            "concurrent comm: communication of two or more streams at once."
        )
        write_section(args.doc, "breakdown", body, title="Benchmarks")
        print(f"wrote the breakdown section of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
