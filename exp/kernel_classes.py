"""How fast inductor's generated kernels run in a compiled rank program, by class of kernel.

Inputs: a ``hidup bench-rank --kernels`` JSON (every kernel's time per step by name, ``per_kernel``)
and the inductor code of the same run (``exp/gpu_predict.sh`` with ``CODE=1``: ``code-<plan>.tgz``,
generated with ``TORCHINDUCTOR_BENCHMARK_KERNEL=1`` so that each kernel carries ``kernel_num_gb``,
the bytes inductor counts it to read and write).  Each generated kernel's bytes per call are looked
up by its name in the compiled modules of the run's precision (a name used by several modules, with
different bytes, is ``mixed`` below), times its calls per step, and the kernels are grouped:

* ``poi``: pointwise kernels (``triton_poi_*``);
* ``per``: reductions whose whole reduced dim fits one block (``triton_per_*``, e.g. a row's norm);
* ``red``: reductions looping over the reduced dim (``triton_red_*``: a column sum for a bias's
  gradient, a long row);
* ``tiny``: any kernel moving under 4 MB a call, whose time is its latency rather than its bytes;
* ``mixed``: a name that modules launch with different bytes (the profiler adds their times under
  one name), so that its bytes per call are not known.

For each class: milliseconds per step, GB per step and the achieved GB/s, to compare with the
profile's ``memory_bandwidth`` (what the cost model prices every fused node at) -- a class running
below it, or kernels the cost model does not count, are where a compiled program's generated
kernels exceed their price.

    python exp/kernel_classes.py runs/rank-gpt-data.json code-gpt-data.tgz
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from collections import defaultdict

TINY_GB = 0.004  # a kernel moving less than this per call is latency-bound
_KERNEL = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)', '''(.*?)'''", re.S | re.M)
_NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")


def kernel_bytes(code_tgz: str) -> dict[str, dict[str, list[float]]]:
    """precision (``bf16`` if the module computes in bfloat16, else ``tf32``) -> kernel name -> GB per
    call in each compiled module that launches it, from the inductor code in ``code_tgz``."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tarfile.open(code_tgz) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            source = tar.extractfile(member).read().decode("utf-8", "replace")
            if "async_compile.triton(" not in source or "def call(" not in source:
                continue  # a kernel's own module, not a compiled graph's
            precision = "bf16" if "bfloat16" in source else "tf32"
            launched = set(re.findall(r"^\s*(\w+)\.run\(", source[source.index("def call(") :], re.M))
            for var, name, kernel in _KERNEL.findall(source):
                gb = _NUM_GB.search(kernel)
                if var in launched and gb:
                    out[precision][name].append(float(gb.group(1)))
    return out


def classes(run: dict, gb_per_call: dict[str, list[float]]) -> dict[str, list[float]]:
    """class -> [ms per step, GB per step, kernels per step] of the run's generated kernels."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for k in run["kernels"]["per_kernel"]:
        if k["kind"] != "generated":
            continue
        seen = gb_per_call.get(k["name"]) or [0.0]
        per_call = sum(seen) / len(seen)
        if len(set(seen)) > 1:
            cls = "mixed"
        else:
            cls = "tiny" if per_call < TINY_GB else k["name"].split("_")[1]
        row = out[cls]
        row[0] += k["ms"]
        row[1] += per_call * k["calls"]
        row[2] += k["calls"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a bench-rank JSON with every kernel's time (--kernels)")
    p.add_argument("code", help="the run's inductor code (code-<plan>.tgz from exp/gpu_predict.sh CODE=1)")
    args = p.parse_args(argv)
    data = json.loads(open(args.run).read())
    by_precision = kernel_bytes(args.code)
    for run in data["runs"]:
        if "per_kernel" not in (run.get("kernels") or {}):
            print(f"{args.run}: {run['precision']} {run['mode']} has no per-kernel times (--kernels)", file=sys.stderr)
            continue
        found = classes(run, by_precision.get(run["precision"], {}))
        names = sum(k["kind"] == "generated" for k in run["kernels"]["per_kernel"])
        print(f"{run['precision']} {run['mode']}: {names} generated kernels by name")
        for cls, (ms, gb, calls) in sorted(found.items()):
            rate = gb / ms * 1e3 if ms else 0.0
            print(f"  {cls:5s} {ms:7.3f} ms  {gb:7.3f} GB  {rate:6.0f} GB/s  {int(calls):4d} kernels per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
