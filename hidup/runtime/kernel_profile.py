"""Where a training step's device time goes, by CUDA kernel: ``hidup bench-rank --kernels``.

The steps run under ``torch.profiler``; each kernel's device time per step is summed (every kernel
is kept, by name, so that inductor's generated kernels -- named after the ops they fuse -- can be
matched to the ops the cost model prices), and kernels are grouped into kinds by name fragments
(:data:`KERNEL_KINDS`: the optimizer, attention, matrix multiplies of the vendor libraries,
inductor's generated kernels, copies, and ``other``)."""

from __future__ import annotations

import torch

__all__ = ["KERNEL_KINDS", "kernel_kind", "kernel_breakdown"]

# kernel kinds by name fragment, first match wins (cuBLAS names its kernels gemm / nvjet / sm90_xmma ...)
KERNEL_KINDS = (
    ("optimizer", ("adam", "multi_tensor")),
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk", "sm90_", "sm80_")),
    ("generated", ("triton",)),
    ("copies", ("copy", "memcpy", "memset", "cat", "fill", "elementwise", "reduce_kernel", "index")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its name (:data:`KERNEL_KINDS`; ``other`` when none matches)."""
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def kernel_breakdown(step, inputs, device: torch.device, steps: int = 3) -> dict:
    """Device milliseconds per step of ``step(*inputs)`` by kernel kind (:func:`kernel_kind`) and per
    kernel, heaviest first, from ``torch.profiler`` over ``steps`` steps (after one untimed)."""
    from torch.profiler import ProfilerActivity, profile

    step(*inputs)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*inputs)
        torch.cuda.synchronize(device)
    per_kernel: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / 1e3 / steps
            counts[e.name] = counts.get(e.name, 0) + 1
    kinds: dict[str, float] = {}
    for name, ms in per_kernel.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {
        "device_ms": sum(per_kernel.values()),
        "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "kernels_per_step": sum(counts.values()) / steps,
        "per_kernel": [
            {"name": n[:160], "ms": ms, "calls": counts[n] / steps, "kind": kernel_kind(n)}
            for n, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])
        ],
    }
