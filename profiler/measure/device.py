"""Device compute rate (FLOP/s per dtype) and memory bandwidth, measured by timing.

FLOP rate
---------
A square matmul ``C = A @ B`` with ``A, B`` of shape ``n x n`` does ``2 n^3`` floating-point
operations (one multiply and one add per term of each of the ``n^2`` dot products of length ``n``).
For each size ``n`` we time ``k`` back-to-back matmuls per sample and take the median over samples:

    t(n)    = median_s( elapsed_s / k )
    rate(n) = 2 n^3 / t(n)                      [FLOP/s]
    rate    = max_n rate(n)                     (the achieved peak; small sizes under-fill the device)

``tf32`` is ``float32`` storage with ``torch.backends.cuda.matmul.allow_tf32 = True`` (on CUDA
the tensor cores round the inputs to 10-bit mantissas).  On a CPU the flag has no effect and the
measured rate equals ``fp32``'s.

GEMM shapes
-----------
:func:`gemm_grid` times ``C[m, n] = A[m, k] @ B[n, k]^T`` (a linear's forward layout, ``nt``),
``A[m, k] @ B[k, n]`` (``nn``) and ``A[k, m]^T @ B[k, n]`` (``tn``) at every ``(m, n, k)`` of
``sizes x sizes x sizes`` the same way, ``rate = 2 m n k / t``: the rate of a matmul by its shape and
layout (:mod:`hidup.profiler.gemm`).

Attention
---------
:func:`attention_table` times ``F.scaled_dot_product_attention`` in each variant (no mask;
``is_causal``; a causal boolean mask ``[B, 1, S, S]`` given as ``attn_mask``) at every point of
``head_dims x seqs x rows``: the forward under ``no_grad`` and the forward with the backward of
``q, k, v``, the backward's time being their difference (:mod:`hidup.profiler.attention`).  On a GPU
each is timed as :data:`ATTENTION_REPS` calls captured in one CUDA graph and replayed
(:func:`hidup.codegen.timing.graph_time`): timed eagerly, a short attention's backward measures the
host's dispatch (about 0.2 ms on an H200 host) rather than its kernels, which a compiled and graphed
step does not pay.

Memory bandwidth
----------------
A device-to-device copy of ``b`` bytes reads ``b`` and writes ``b`` bytes, so
``bandwidth = 2 b / t_copy`` [bytes/s].  A copy that changes the layout (``x.movedim(1, 0)
.contiguous()``, what a collective on a dim other than the first needs around it) reads and writes as
much but strides through one side: :func:`layout_bandwidth` times it the same way.  A copy that moves
the innermost dim (``x.movedim(-1, 0).contiguous()``, a collective on a tensor's last dim) reads
rows and writes columns element by element, so its rate follows the element count rather than the
bytes: :func:`transpose_bandwidth` times it on float32 (the cost model scales it by ``itemsize / 4``
for other dtypes).

Adam
----
:func:`adam_seconds_per_byte` times torch's fused Adam step over float32 parameters (on a GPU
captured in a CUDA graph) and divides by their bytes: the optimizer's price per byte of local
trainable parameters (``optimizer_s_per_byte``), where the roofline of seven passes over the
parameters at the copy bandwidth leaves out the step's arithmetic and its per-tensor work.

The optimizer offloaded to the host
-----------------------------------
:func:`host_copy_bandwidth` times copies between a pinned host buffer and the device, each way (on a
GPU; 0 elsewhere: the profile then keeps its documented default), and keeps the slower direction's
bytes per second: an offloaded step moves every stepped gradient one way and every weight the other
(``host_bandwidth``).  :func:`host_adam_seconds_per_byte` times torch's fused CPU Adam over float32
parameters in host memory with the threads this process has, so ranks measuring at once share the
node's cores and memory bandwidth as their offloaded steps will (``host_optimizer_s_per_byte``).

Sums over rows
--------------
Inductor sums a gradient over its rows (a bias's, a norm weight's) in two kernels: a looped reduction
over blocks of rows, then a small kernel adding the blocks' partial sums.
:func:`reduction_bandwidth` compiles ``x.sum(0)`` with inductor for a ``[rows, 1024]`` tensor of
about 64 MiB in the given dtype and times it inside a CUDA graph: ``bytes of x / t``, bytes read per
second (the small second kernel is under 1% of it).  :func:`kernel_floor` times the compiled sum of
a ``[64, 1024]`` float32 tensor the same way: one small generated kernel, whose time is its latency.

Gradient bucket copies
----------------------
The runtime packs the gradients of replicated parameters into flat buckets before each all-reduce
and copies the sums back (:mod:`hidup.codegen.grads`): per parameter, a share of one ``torch.cat``
and one ``copy_``.  :func:`grad_copy_overhead` times both on tiny tensors (the bytes are
negligible) and divides by their number: the fixed cost per parameter, eagerly or inside a CUDA
graph; the bytes are priced at the memory bandwidth.

Timing
------
:func:`hidup.codegen.timing.time_call`: CUDA events on a GPU (kernels are asynchronous; the events
bracket ``k`` launches and we synchronize once), ``time.perf_counter`` on a CPU, after ``warmup``
untimed calls; the median over samples bounded by ``budget_s`` per size.  Matmuls (square sizes and
the GEMM grid), attention and the Adam step are timed on a GPU by :func:`kernel_seconds`: ``reps``
calls captured in one CUDA graph and replayed, for a matmul as many as span about
:data:`KERNEL_SPAN_S` at a rate of :data:`FAST_FLOPS` (more than any GPU's, :func:`matmul_reps`):
launched one by one, a short GEMM (a 128-row bf16 GEMM runs
for a few microseconds) measures the host's dispatch rather than its kernel, which a compiled,
captured step does not pay.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.fx

from hidup.codegen.graphs import GraphedStep
from hidup.codegen.timing import graph_time, time_call
from hidup.profiler.attention import VARIANTS, AttentionTable
from hidup.profiler.gemm import LAYOUTS, GemmGrid
from hidup.profiler.profile import DTYPES

__all__ = [
    "MatmulRate",
    "matmul_rate",
    "device_rates",
    "memory_bandwidth",
    "layout_bandwidth",
    "transpose_bandwidth",
    "grad_copy_overhead",
    "default_matmul_sizes",
    "default_gemm_sizes",
    "gemm_grid",
    "torch_dtype",
]

# The compute dtypes are a profile's (DTYPES); "tf32" means float32 tensors with TF32 matmuls enabled.
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "tfloat32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}
_STORAGE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def canonical_dtype(name: str) -> str:
    """``fp32``/``tf32``/``bf16``/``fp16`` or a long name (``bfloat16``) -> the short name."""
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(
            f"unknown compute dtype {name!r}; expected one of {', '.join(DTYPES)} (or {', '.join(_ALIASES)})"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Storage dtype of a compute dtype name (``tf32`` is stored as ``float32``)."""
    return _STORAGE[canonical_dtype(name)]


@contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Set ``torch.backends.cuda.matmul.allow_tf32`` (and cuDNN's) for the block, then restore."""
    old_mm, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_mm
        torch.backends.cudnn.allow_tf32 = old_cudnn


@dataclass
class MatmulRate:
    """Measured matmul rate of one dtype: ``rate`` [FLOP/s] is the best over ``per_size``."""

    dtype: str
    rate: float
    per_size: dict[int, float] = field(default_factory=dict)  # n -> FLOP/s of an n x n x n matmul

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "rate": self.rate, "per_size": {str(k): v for k, v in self.per_size.items()}}


def default_matmul_sizes(device: torch.device | str) -> tuple[int, ...]:
    """Square sizes that reach peak on the device in well under a second each."""
    return (2048, 4096, 8192) if torch.device(device).type == "cuda" else (128, 256, 512)


def default_gemm_sizes(device: torch.device | str) -> tuple[int, ...]:
    """Grid sizes of :func:`gemm_grid`: from a tensor-parallel shard of a small model's features
    to a large model's tokens per GPU (a GPU); a few small ones on a CPU."""
    if torch.device(device).type == "cuda":
        return (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    return (16, 64)


def gemm_grid(
    device: torch.device | str,
    dtype: str,
    sizes: tuple[int, ...] | None = None,
    *,
    budget_s: float = 10.0,
    warmup: int = 1,
    layouts: tuple[str, ...] = LAYOUTS,
) -> GemmGrid:
    """Rates of the GEMMs ``(m, n, k)`` in ``dtype`` at every point of ``sizes^3``, in each of
    ``layouts`` (``nt`` first; module docstring, "GEMM shapes"); ``budget_s`` of timing in all, shared
    evenly by the points."""
    device = torch.device(device)
    dtype = canonical_dtype(dtype)
    sizes = tuple(sorted(set(int(n) for n in (sizes or default_gemm_sizes(device)))))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"GEMM grid sizes must be positive integers, got {sizes}")
    if not layouts or layouts[0] != "nt" or set(layouts) - set(LAYOUTS):
        raise ValueError(f"GEMM grid layouts must start with 'nt' and be of {LAYOUTS}, got {layouts}")
    storage = torch_dtype(dtype)
    biggest = sizes[-1] ** 2
    gen = torch.Generator(device=device).manual_seed(0)
    a_flat = torch.randn(biggest, generator=gen, device=device).to(storage)
    b_flat = torch.randn(biggest, generator=gen, device=device).to(storage)
    c_flat = torch.empty(biggest, device=device, dtype=storage)
    per_point = budget_s / (len(sizes) ** 3 * len(layouts))
    rates: dict[str, list[float]] = {layout: [] for layout in layouts}
    with tf32(dtype == "tf32"):
        for layout in layouts:
            for m in sizes:
                for n in sizes:
                    for k in sizes:
                        call = _gemm_call(layout, m, n, k, a_flat, b_flat, c_flat)
                        seconds = kernel_seconds(call, device, per_point, matmul_reps(2.0 * m * n * k), warmup)
                        rates[layout].append(2.0 * m * n * k / seconds)
    del a_flat, b_flat, c_flat
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return GemmGrid.of(sizes, rates)


def _gemm_call(layout: str, m: int, n: int, k: int, a_flat, b_flat, c_flat) -> Callable[[], object]:
    """``torch.mm`` of the GEMM ``(m, n, k)`` in ``layout`` on views of the flat buffers (each at least
    as long as its operand), as the GEMM grid stores its operands."""
    out = c_flat[: m * n].view(m, n)
    if layout == "nt":
        a, b = a_flat[: m * k].view(m, k), b_flat[: n * k].view(n, k).t()
    elif layout == "nn":
        a, b = a_flat[: m * k].view(m, k), b_flat[: k * n].view(k, n)
    else:
        a, b = a_flat[: k * m].view(k, m).t(), b_flat[: k * n].view(k, n)
    return functools.partial(torch.mm, a, b, out=out)


def gemm_point_seconds(
    device: torch.device | str, dtype: str, layout: str, m: int, n: int, k: int, *, budget_s: float = 0.05
) -> float:
    """Seconds of the one GEMM ``(m, n, k)`` in ``dtype`` and ``layout``, timed as :func:`gemm_grid` times
    its points (a measured point of :class:`hidup.profiler.gemm.GemmGrid`)."""
    device = torch.device(device)
    dtype = canonical_dtype(dtype)
    storage = torch_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    a_flat = torch.randn(m * k, generator=gen, device=device).to(storage)
    b_flat = torch.randn(k * n, generator=gen, device=device).to(storage)
    c_flat = torch.empty(m * n, device=device, dtype=storage)
    with tf32(dtype == "tf32"):
        call = _gemm_call(layout, m, n, k, a_flat, b_flat, c_flat)
        return kernel_seconds(call, device, budget_s, matmul_reps(2.0 * m * n * k))


KERNEL_SPAN_S = 2e-4  # the span of the CUDA graph kernel_seconds replays, at FAST_FLOPS
FAST_FLOPS = 1e15  # FLOP/s above any GPU's dense rate: reps estimated at it are never too few


def kernel_seconds(
    fn: Callable[[], object], device: torch.device, budget_s: float, reps: int, warmup: int = 1
) -> float:
    """Seconds per call of ``fn``'s kernels: on a GPU, ``reps`` calls captured in one CUDA graph and
    replayed (:func:`hidup.codegen.timing.graph_time`, module docstring "Timing"); on a CPU, or where
    ``fn`` does not capture, :func:`hidup.codegen.timing.time_call`."""
    if device.type == "cuda":
        seconds = graph_time(fn, device, budget_s, reps)
        if seconds is not None:
            return seconds
    return time_call(fn, device, warmup=warmup, sample_s=0.002, budget_s=budget_s)


def matmul_reps(flops: float) -> int:
    """Calls of a matmul of ``flops`` FLOPs that :func:`kernel_seconds` captures: as many as span
    :data:`KERNEL_SPAN_S` at :data:`FAST_FLOPS`, 1 to 64."""
    return max(1, min(64, int(KERNEL_SPAN_S * FAST_FLOPS / max(flops, 1.0))))


ATTENTION_HEADS = 8  # the heads of a timed attention; its batch is rows / ATTENTION_HEADS
ATTENTION_REPS = 8  # attention calls per captured CUDA graph when timing one


def default_attention_grid(device: torch.device | str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(head_dims, seqs, rows)`` of :func:`attention_table`: the head dims of most models, sequences
    from a short one to a long one (longer ones are priced from the longest: the work is quadratic),
    and rows from an under-filled device to a full one; nothing on a CPU."""
    if torch.device(device).type == "cuda":
        return (64, 128), (128, 256, 512, 1024, 2048), (16, 64, 256, 1024)
    return (), (), ()


def _attention_seconds(tensors: tuple, kwargs: dict, device: torch.device, budget_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one attention on ``tensors`` = ``(q, k, v, output gradient)``."""
    import torch.nn.functional as F

    q, k, v, grad = tensors

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def both():
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v), grad)

    fwd, total = (kernel_seconds(fn, device, budget_s / 2, ATTENTION_REPS) for fn in (forward, both))
    return fwd, max(total - fwd, 0.05 * fwd)  # the floor: timing noise on a backward far shorter than its forward


def attention_table(
    device: torch.device | str,
    dtype: str,
    head_dims: tuple[int, ...],
    seqs: tuple[int, ...],
    rows: tuple[int, ...],
    variants: tuple[str, ...] = VARIANTS,
    *,
    budget_s: float = 20.0,
) -> AttentionTable:
    """Forward and backward seconds of ``F.scaled_dot_product_attention`` on ``dtype`` tensors (a
    storage dtype: ``tf32`` times float32, whose attention uses no TF32) in each of ``variants`` at
    every point of ``head_dims x seqs x rows`` (module docstring, "Attention"); ``budget_s`` of timing
    in all, shared evenly by the points."""
    device = torch.device(device)
    storage = torch_dtype(dtype)
    per_point = budget_s / (len(head_dims) * len(seqs) * len(rows) * len(variants))
    gen = torch.Generator(device=device).manual_seed(0)
    by_variant: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in variants}
    for d in head_dims:
        for s in seqs:
            for r in rows:
                batch = max(1, r // ATTENTION_HEADS)
                shape = (batch, ATTENTION_HEADS, s, d)
                tensors = tuple(torch.randn(shape, generator=gen, device=device).to(storage) for _ in range(4))
                for t in tensors[:3]:
                    t.requires_grad_()
                mask = torch.ones(s, s, device=device, dtype=torch.bool).tril().expand(batch, 1, s, s).contiguous()
                for name in variants:
                    kwargs = {"causal": {"is_causal": True}, "masked": {"attn_mask": mask}}.get(name, {})
                    fwd, bwd = _attention_seconds(tensors, kwargs, device, per_point)
                    by_variant[name][0].append(fwd)
                    by_variant[name][1].append(bwd)
                del tensors, mask
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return AttentionTable.of(head_dims, seqs, rows, by_variant)


def dtype_supported(device: torch.device | str, dtype: str) -> bool:
    """Whether ``dtype`` matmuls run on ``device`` (bf16 needs compute capability >= 8.0)."""
    device = torch.device(device)
    dtype = canonical_dtype(dtype)
    if device.type != "cuda":
        return True
    major, _ = torch.cuda.get_device_capability(device)
    if dtype == "bf16":
        return major >= 8
    if dtype == "tf32":
        return major >= 8  # earlier GPUs have no TF32 tensor cores; the flag is a no-op there
    return True


def matmul_rate(
    device: torch.device | str,
    dtype: str,
    sizes: tuple[int, ...] | None = None,
    *,
    budget_s: float = 0.3,
    warmup: int = 2,
) -> MatmulRate:
    """FLOP/s of square matmuls of ``dtype`` on ``device`` (see the module docstring)."""
    device = torch.device(device)
    dtype = canonical_dtype(dtype)
    sizes = tuple(sizes or default_matmul_sizes(device))
    if not sizes or any(int(n) <= 0 for n in sizes):
        raise ValueError(f"matmul sizes must be positive integers, got {sizes}")
    storage = torch_dtype(dtype)
    per_size: dict[int, float] = {}
    gen = torch.Generator(device=device).manual_seed(0)  # on the device: no host-side generation
    with tf32(dtype == "tf32"):
        for n in sizes:
            a = torch.randn(n, n, generator=gen, device=device).to(storage)
            b = torch.randn(n, n, generator=gen, device=device).to(storage)
            out = torch.empty(n, n, device=device, dtype=storage)
            call = functools.partial(torch.mm, a, b, out=out)
            seconds = kernel_seconds(call, device, budget_s / len(sizes), matmul_reps(2.0 * n**3), warmup)
            per_size[int(n)] = 2.0 * n**3 / seconds
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return MatmulRate(dtype, max(per_size.values()), per_size)


def device_rates(
    device: torch.device | str,
    dtypes: tuple[str, ...] = DTYPES,
    sizes: tuple[int, ...] | None = None,
    *,
    budget_s: float = 0.3,
    on_dtype: Callable[[str], None] | None = None,
) -> dict[str, MatmulRate]:
    """:func:`matmul_rate` for each supported dtype of ``dtypes`` (unsupported ones are left out).

    ``on_dtype(name)`` is called after each dtype (for progress bars).
    """
    out: dict[str, MatmulRate] = {}
    for d in dtypes:
        d = canonical_dtype(d)
        if dtype_supported(device, d):
            out[d] = matmul_rate(device, d, sizes, budget_s=budget_s)
        if on_dtype is not None:
            on_dtype(d)
    return out


def memory_bandwidth(device: torch.device | str, nbytes: int | None = None, *, budget_s: float = 0.2) -> float:
    """Copy bandwidth in bytes/s: ``2 * nbytes / t`` for a ``nbytes`` device-to-device copy."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    n = max(1, nbytes // 4)
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, budget_s=budget_s)
    src = dst = None  # release before emptying the cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2.0 * n * 4 / seconds


def layout_bandwidth(device: torch.device | str, nbytes: int | None = None, *, budget_s: float = 0.2) -> float:
    """Bandwidth in bytes/s (read + written) of a layout-changing copy: ``x.movedim(1, 0).contiguous()``
    of a 4-d float32 tensor of about ``nbytes`` (default 32 MiB on a GPU, 64 MiB on a CPU) whose moved
    dim is neither the first nor the last, as the collectives' ``_to_front`` / ``_from_front`` copy."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (32 << 20) if device.type == "cuda" else (64 << 20)
    rows = max(1, nbytes // (8 * 64 * 256 * 4))
    x = torch.ones((8, 64, rows, 256), device=device, dtype=torch.float32)
    seconds = time_call(lambda: x.movedim(1, 0).contiguous(), device, budget_s=budget_s)
    moved = 2.0 * x.numel() * 4
    x = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return moved / seconds


def transpose_bandwidth(device: torch.device | str, nbytes: int | None = None, *, budget_s: float = 0.2) -> float:
    """Bandwidth in bytes/s (read + written) of a copy that moves the innermost dim to the front:
    ``x.movedim(-1, 0).contiguous()`` of a 3-d float32 tensor of about ``nbytes`` (default 32 MiB on a
    GPU, 64 MiB on a CPU), as a collective on a tensor's last dim copies around it."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (32 << 20) if device.type == "cuda" else (64 << 20)
    rows = max(1, nbytes // (64 * 1024 * 4))
    x = torch.ones((rows, 64, 1024), device=device, dtype=torch.float32)
    seconds = time_call(lambda: x.movedim(-1, 0).contiguous(), device, budget_s=budget_s)
    moved = 2.0 * x.numel() * 4
    x = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return moved / seconds


def adam_seconds_per_byte(device: torch.device | str, nbytes: int | None = None, *, budget_s: float = 0.2) -> float:
    """Seconds per byte of float32 parameters of torch's fused Adam step (``fused=True``; on a GPU
    ``capturable=True``, captured in a CUDA graph as a compiled, captured step runs it), over
    parameters of about ``nbytes`` (default 128 MiB on a GPU, 8 MiB on a CPU) shaped like a model's:
    square weights and a vector for each (module docstring, "Adam")."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (128 << 20) if device.type == "cuda" else (8 << 20)
    side = 2048 if device.type == "cuda" else 512
    count = max(1, nbytes // (side * side * 4))
    params = [
        torch.zeros(shape, device=device, requires_grad=True) for _ in range(count) for shape in ((side, side), (side,))
    ]
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    cuda = device.type == "cuda"
    adam = torch.optim.Adam(params, lr=1e-4, fused=True, **({"capturable": True} if cuda else {}))
    seconds = kernel_seconds(adam.step, device, budget_s, reps=1)
    total = sum(p.numel() * 4 for p in params)
    del adam, params
    if cuda:
        torch.cuda.empty_cache()
    return seconds / total


def host_copy_bandwidth(device: torch.device | str, nbytes: int = 256 << 20, *, budget_s: float = 0.2) -> float:
    """Bytes per second of the slower direction of a copy of ``nbytes`` between pinned host memory and
    the device (module docstring, "The optimizer offloaded to the host"); 0 off a GPU (not measured)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    to_device = time_call(lambda: dev.copy_(host, non_blocking=True), device, warmup=1, budget_s=budget_s)
    to_host = time_call(lambda: host.copy_(dev, non_blocking=True), device, warmup=1, budget_s=budget_s)
    return nbytes / max(to_device, to_host)


def host_adam_seconds_per_byte(nbytes: int = 64 << 20, *, budget_s: float = 0.2) -> float:
    """Seconds per byte of float32 parameters of torch's Adam step on the CPU over ``nbytes`` of host
    memory (:func:`hidup.codegen.offload.host_adam`: the fused CPU kernel where torch has it), with the
    threads this process has (module docstring, "The optimizer offloaded to the host")."""
    from hidup.codegen.offload import host_adam

    side = 1024
    count = max(1, nbytes // (side * side * 4))
    params = [torch.zeros(side, side, requires_grad=True) for _ in range(count)]
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    adam = host_adam(params, 1e-4)
    seconds = time_call(adam.step, torch.device("cpu"), warmup=1, budget_s=budget_s)
    total = sum(p.numel() * 4 for p in params)
    del adam, params
    return seconds / total


def _compiled_sum_seconds(x: torch.Tensor, budget_s: float, backend: str) -> float:
    """Seconds of ``x.sum(0)`` compiled by ``backend`` (inductor in a profile), timed by
    :func:`kernel_seconds`."""
    summed = torch.compile(lambda t: t.sum(0), backend=backend, dynamic=False, fullgraph=True)
    return kernel_seconds(lambda: summed(x), x.device, budget_s, reps=8, warmup=2)


def reduction_bandwidth(
    device: torch.device | str, dtype: str = "fp32", nbytes: int = 64 << 20, *, budget_s: float = 0.2,
    backend: str = "inductor",
) -> float:  # fmt: skip
    """Bytes per second read by the compiled sum over the rows of a ``[rows, 1024]`` tensor of about
    ``nbytes`` in ``dtype`` (module docstring, "Sums over rows")."""
    device = torch.device(device)
    storage = torch_dtype(canonical_dtype(dtype))
    rows = max(1, nbytes // (1024 * storage.itemsize))
    x = torch.ones((rows, 1024), device=device, dtype=storage)
    seconds = _compiled_sum_seconds(x, budget_s, backend)
    read = x.numel() * storage.itemsize
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return read / seconds


def kernel_floor(device: torch.device | str, *, budget_s: float = 0.2, backend: str = "inductor") -> float:
    """Seconds of one small generated kernel: the compiled sum over the rows of a ``[64, 1024]``
    float32 tensor (module docstring, "Sums over rows")."""
    x = torch.ones((64, 1024), device=torch.device(device))
    return _compiled_sum_seconds(x, budget_s, backend)


def grad_copy_overhead(
    device: torch.device | str, params: int = 64, *, budget_s: float = 0.2, graphed: bool = False
) -> float:
    """Seconds per parameter of packing ``params`` tiny gradients into one flat buffer
    (``torch.cat``) and copying each back out of it (``copy_``), as the gradient buckets do
    (:mod:`hidup.codegen.grads`); ``graphed=True`` (CUDA only) times them captured in a CUDA graph."""
    device = torch.device(device)
    grads = [torch.ones(64, device=device) for _ in range(params)]

    def step():
        flat = torch.cat([g.reshape(-1) for g in grads])
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    if graphed:
        if device.type != "cuda":
            raise ValueError(f"grad_copy_overhead(graphed=True) needs a CUDA device, got {device}")
        seconds = graph_time(step, device, budget_s, reps=1)
        if seconds is None:
            raise RuntimeError("grad_copy_overhead: the bucket copies could not be captured in a CUDA graph")
    else:
        seconds = time_call(step, device, budget_s=budget_s)
    return seconds / params


def op_overhead(device: torch.device | str, ops: int = 64, *, budget_s: float = 0.2, graphed: bool = False) -> float:
    """Seconds of fixed cost per op: a torch.fx program of ``ops`` elementwise ops on a tiny tensor,
    forward and backward, timed as a whole and divided by ``3 * ops`` (a backward launches about two
    kernels per forward op).  At this size no kernel does measurable work, so what is left is the
    launch and host-dispatch cost that every op of a generated program pays.  ``graphed=True``
    (CUDA only) times the same step captured as one CUDA graph
    (:class:`hidup.codegen.graphs.GraphedStep`): what is left is the GPU's gap between kernels."""
    device = torch.device(device)
    root = torch.nn.Module()
    root.leaf = torch.nn.Parameter(torch.ones(8, device=device))
    graph = torch.fx.Graph()
    y = graph.get_attr("leaf")
    for i in range(ops):
        y = graph.call_function(torch.mul if i % 2 else torch.add, (y, 1.0001))
    graph.output(graph.call_function(torch.sum, (y,)))
    program = torch.fx.GraphModule(root, graph)  # a loss of the parameter `leaf`, no inputs

    def step():
        program().backward()

    if graphed:
        if device.type != "cuda":
            raise ValueError(f"op_overhead(graphed=True) needs a CUDA device, got {device}")

        step = GraphedStep(program, ())  # the same step, captured and replayed

    return time_call(step, device, budget_s=budget_s) / (3 * ops)
