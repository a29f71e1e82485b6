"""Build the built-in cluster profile ``h100x64-ib400``: links from published figures, compute from a measured H200.

Nobody here can time 64 H100s, so the profile has two sources, and its ``notes`` name both:

* **Links** (the ``collectives`` of a node and the ``network`` section) are nccl-tests-style curves
  written from published figures: NVLink 4 through NVSwitch, 900 GB/s per GPU both ways together
  (450 GB/s each way; nccl-tests all-reduce bus bandwidth on a DGX H100 about 450 GB/s), and one
  400 Gb/s InfiniBand NDR NIC per GPU (50 GB/s line rate, 45-48 GB/s of nccl-tests bus bandwidth).
  This script keeps them as the built-in file has them.
* **Compute** (the GEMM grid by shape and layout, the attention table, the square-matmul curve,
  Adam, the copy and reduction bandwidths, the fixed costs) is that of an H200 measured by ``hidup
  profile --quick`` (``exp/records/predict/h200-9/h200.json``, torch 2.11).  The H100 SXM and the
  H200 are the same Hopper die (GH100: 132 SMs, the same clocks and 700 W, 989.5 TFLOP/s dense
  bf16 on both datasheets); they differ in memory: HBM3 at 3.35 TB/s against HBM3e at 4.8 TB/s.
  So with ``r = 3.35 / 4.8``:

      compute-bound rates (GEMMs, attention, the FLOP rates): the H200's, then
          t_H100 = max(t_H200, bytes / (r * B_H200))   per grid point (a roofline floor at the
          H100's bandwidth: ``bytes`` the operands read and the result written once)
      memory-bound terms: memory, layout, transpose and reduction bandwidths times r; Adam's
          seconds per byte divided by r
      fixed costs (op launch and dispatch, a CUDA graph's gap, the gradient bucket copies' fixed
          part, a small generated kernel): the H200's (same software, same host class)

Beyond the measured grids a GEMM is priced at the nearest measured size's rate and an attention at
the longest measured sequence's rate (:mod:`hidup.profiler.gemm`, :mod:`hidup.profiler.attention`):
an efficiency that saturates, never one that grows past the largest measured shape.

    python exp/cluster_profile.py          # rewrites profiler/defaults/h100x64-ib400.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from hidup.profiler.attention import AttentionTable
from hidup.profiler.gemm import LAYOUTS, GemmGrid
from hidup.profiler.profile import CLUSTER_PROFILE, DEFAULTS_DIR, Profile, load, save

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "exp/records/predict/h200-9/h200.json"
H100_HBM, H200_HBM = 3.35e12, 4.8e12  # datasheet memory bandwidths, bytes/s
PEAK_BF16 = 989.5e12  # H100 SXM and H200 datasheets, dense bf16 tensor-core FLOP/s
ITEMSIZE = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}

LINKS = (
    "Links, from public figures (not timed on such a machine): NVLink 4 through NVSwitch inside a node, 900 GB/s "
    "per GPU both ways together (450 GB/s each way; H100 SXM datasheet), and 8x 400 Gb/s InfiniBand NDR per node "
    "between nodes, one NIC per GPU, rail-optimized (ConnectX-7 NDR datasheet, 50 GB/s line rate). Collectives: "
    "nccl-tests-style bus bandwidth curves, one per level, shared by the three ring collectives and by every group "
    "size (a fixed per-GPU link: NVSwitch inside a node, one NIC per rank between nodes): time(S) = alpha + k "
    "(S_ring + S_h) / B with S_ring = (n-1)/n S, k = 1 for all-gather and reduce-scatter and k = 2 for all-reduce "
    "(a reduce-scatter then an all-gather), so busbw = k S_ring / time and the ring relation holds: all-reduce "
    "algbw = busbw n / (2(n-1)), all-gather / reduce-scatter algbw = busbw n / (n-1); S_h is a half-bandwidth size "
    "that makes small messages latency-bound, and the table's algbw is net of alpha, S / (time - alpha). Node level "
    "(groups of 2, 4, 8 GPUs of one node): B = 460 GB/s, S_h = 2 MB, alpha = 5 us, so all-reduce busbw over 8 GPUs "
    "is 8 GB/s at 64 KiB, 104 at 1 MiB, 379 at 16 MiB, 454 at 256 MiB and 458 at 1 GiB (nccl-tests on a DGX H100 "
    "reach about 450 GB/s). Network level (section 'network': groups of 2, 4, 8 ranks one per node, every local "
    "rank's group at once, each on its own NIC): B = 47 GB/s, S_h = 0.5 MB, alpha = 15 us, so all-reduce busbw over "
    "8 nodes is 3 GB/s at 64 KiB, 24 at 1 MiB, 44 at 16 MiB, 47 at 256 MiB and 47 at 1 GiB (nccl-tests over one "
    "400 Gb/s NDR NIC per rank reach 45-48 GB/s of its 50 GB/s line rate). All-to-all (logical size S, each rank "
    "sending (n-1)/n^2 S): time = alpha + ((n-1)/n^2 S + S_h/n) / (0.9 B), a bus bandwidth of 90 % of the ring's, "
    "with the ring's shape along the size axis. alpha is a fixed per-call latency added on top of the table; no "
    "concurrency of two communicators is given (1 = not known)."
)


def gemm_floor(grid: GemmGrid, itemsize: int, bandwidth: float) -> GemmGrid:
    """``grid`` with each rate capped by the roofline of its shape at ``bandwidth`` (module docstring):
    ``2 m n k / max(t, (m k + k n + m n) itemsize / bandwidth)``; measured points are dropped (they
    are exact shapes of small plans on the measured GPU)."""
    sizes, n = grid.sizes, len(grid.sizes)
    by_layout = {}
    for layout, rates in grid.by_layout.items():
        capped = []
        for index, rate in enumerate(rates):
            m, nn, k = sizes[index // (n * n)], sizes[index // n % n], sizes[index % n]
            seconds = max(2.0 * m * nn * k / rate, (m * k + k * nn + m * nn) * itemsize / bandwidth)
            capped.append(2.0 * m * nn * k / seconds)
        by_layout[layout] = capped
    assert set(by_layout) <= set(LAYOUTS)
    return GemmGrid.of(sizes, by_layout)


def attention_floor(table: AttentionTable, itemsize: int, bandwidth: float) -> AttentionTable:
    """``table`` with each time at least the time to stream its tensors at ``bandwidth``: the forward
    reads q, k, v and writes the output (4 tensors of ``rows x seq x head_dim``), the backward reads
    those and the output's gradient and writes three gradients (8)."""
    by_variant = {}
    for variant, (forward, backward) in table.times:
        fwd, bwd = [], []
        for d, head_dim in enumerate(table.head_dims):
            for s, seq in enumerate(table.seqs):
                for r, rows in enumerate(table.rows):
                    i = (d * len(table.seqs) + s) * len(table.rows) + r
                    tensor = rows * seq * head_dim * itemsize
                    fwd.append(max(forward[i], 4 * tensor / bandwidth))
                    bwd.append(max(backward[i], 8 * tensor / bandwidth))
        by_variant[variant] = (fwd, bwd)
    return AttentionTable.of(table.head_dims, table.seqs, table.rows, by_variant)


# The optimizer offloaded to the host: not timed on such a node (hidup.codegen.offload prices it by these).
HOST_BANDWIDTH = 50e9  # bytes/s each way, a pinned copy over PCIe Gen5 x16 at ~80 % of its 63 GB/s
HOST_OPTIMIZER_S_PER_BYTE = 0.25e-9  # 1 G float32 parameters/s per GPU for torch's fused CPU Adam
HOST = (
    " host_bandwidth and host_optimizer_s_per_byte (the optimizer offloaded to the host) are not timed on such a "
    "node: host_bandwidth 50 GB/s, a pinned copy over PCIe Gen5 x16 (32 GT/s x 16 lanes, 63 GB/s per direction "
    "after encoding) at ~80% of it; host_optimizer_s_per_byte 0.25 ns, 1 G float32 parameters per second per GPU "
    "for torch's fused CPU Adam (measured 1.14 G/s on one core of a 2-core x86 host, torch 2.13; a rank of an "
    "8-GPU node gets several cores but shares the node's DRAM bandwidth, 28 bytes per parameter: 224 GB/s for 8 "
    "ranks)."
)


def compute_notes(measured: Profile, ratio: float) -> str:
    mb = measured.memory_bandwidth * ratio
    return (
        "A cluster of 8 nodes of 8 H100 SXM 80GB (DGX H100 / HGX H100 class). Compute: the tables of an NVIDIA H200 "
        f"measured by `hidup profile --quick` ({MEASURED.relative_to(ROOT)}, {measured.date}): GEMMs by shape and "
        "layout, attention by variant, head dim, sequence and rows, the square-matmul curve, Adam, copies. The H100 "
        "SXM and the H200 are the same Hopper die (GH100: 132 SMs, same clocks and power, 989.5 TFLOP/s dense BF16 "
        "and FP16 on both datasheets, whose tensor-core figures are with 2:4 sparsity and halved here); they differ "
        f"in memory, HBM3 at 3.35 TB/s against HBM3e at 4.8 TB/s, r = {ratio:.3f}. So compute-bound rates are the "
        "H200's (the largest measured bf16 GEMMs run at 670-800 TFLOP/s, 68-81 % of the datasheet peak; "
        f"flops['bf16'] = {measured.flops['bf16'] / 1e12:.1f} TFLOP/s, the measured 8192^3 matmul), each GEMM grid "
        "point and attention time floored by streaming its tensors at the H100's bandwidth; memory-bound terms "
        f"scale by r: memory_bandwidth {mb / 1e12:.2f} TB/s (the H200's device-to-device copy, "
        f"{measured.memory_bandwidth / 1e12:.2f} TB/s, times r), the layout, transpose and reduction bandwidths "
        f"likewise, Adam {measured.optimizer_s_per_byte / ratio * 1e12:.2f} ps per parameter byte (the H200's "
        f"{measured.optimizer_s_per_byte * 1e12:.2f} / r); fixed costs (op launch and dispatch, a CUDA graph's gap, "
        "the gradient bucket copies' fixed part, a small generated kernel) are the H200's: same software, same host "
        "class. Beyond the measured grids efficiency saturates: a GEMM dim past 16384 is priced at 16384's rate, an "
        "attention past sequence 2048 at 2048's. The HBM3 bandwidths are datasheet figures. " + LINKS + HOST
    )


def build(measured: Profile, links: Profile) -> Profile:
    """The cluster profile: ``links``'s collectives and network tables, ``measured``'s compute scaled
    to the H100 (module docstring)."""
    ratio = H100_HBM / H200_HBM
    membw = measured.memory_bandwidth * ratio
    return dataclasses.replace(
        links,
        notes=compute_notes(measured, ratio),
        flops=dict(measured.flops),
        matmul_sizes={d: dict(v) for d, v in measured.matmul_sizes.items()},
        gemm={d: gemm_floor(g, ITEMSIZE[d], membw) for d, g in measured.gemm.items()},
        attention={d: attention_floor(t, ITEMSIZE[d], membw) for d, t in measured.attention.items()},
        memory_bandwidth=membw,
        layout_bandwidth=measured.layout_bandwidth * ratio,
        transpose_bandwidth=measured.transpose_bandwidth * ratio,
        reduction_bandwidth={d: b * ratio for d, b in measured.reduction_bandwidth.items()},
        optimizer_s_per_byte=measured.optimizer_s_per_byte / ratio,
        op_overhead=measured.op_overhead,
        op_overhead_graph=measured.op_overhead_graph,
        kernel_floor_graph=measured.kernel_floor_graph,
        grad_copy_overhead=measured.grad_copy_overhead,
        grad_copy_overhead_graph=measured.grad_copy_overhead_graph,
        ops={},
        ops_timing=measured.ops_timing,
        date=measured.date,
        host_bandwidth=HOST_BANDWIDTH,
        host_optimizer_s_per_byte=HOST_OPTIMIZER_S_PER_BYTE,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path, default=MEASURED, help="the measured Hopper profile (default: an H200)")
    p.add_argument("--out", type=Path, default=DEFAULTS_DIR / f"{CLUSTER_PROFILE}.json")
    args = p.parse_args(argv)
    profile = build(load(args.measured), load(CLUSTER_PROFILE))
    save(profile, args.out)
    big = profile.gemm["bf16"].rate(8192, 8192, 8192)
    print(f"wrote {args.out}: bf16 GEMM 8192^3 at {big / 1e12:.0f} TFLOP/s ({big / PEAK_BF16:.0%} of peak)")
    assert math.isfinite(big)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
