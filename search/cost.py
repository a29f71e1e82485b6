"""Time of a node under a signature and of a form change, from a :class:`~hidup.profiler.Profile`.

Physical time and corrected time
--------------------------------
Every time below is first a *physical* time: built only from the profile's measurements of single
mechanisms -- per-op times, FLOP rates and memory bandwidth (the roofline), the fixed cost of one
op, alpha-beta collective tables, copy bandwidths and the speedup of two concurrent collectives --
with no factor fitted to whole programs.  The *corrected* time applies the profile's empirical
corrections (:class:`hidup.profiler.corrections.Corrections`, each with the plans and models it was
fitted on) to the compute of call nodes, and to nothing else::

    corrected_fwd(n, s) = k * t_fwd(n, s),    corrected_bwd(n, s) = k * t_bwd(n, s)
    k = dist_scale       for a plan without duplication (:meth:`CostModel.compute`),
    k = dist_dup_scale   for each duplicated copy, on its per-copy time (:meth:`CostModel.copy_compute`)

Communication, memory copies and the gradient buckets stay physical.  Every correction passes
through :meth:`CostModel.corrected`; :meth:`CostModel.device_compute` and
:meth:`CostModel.copy_device_compute` are the physical times (what one device runs), and a profile
without corrections (the built-in ones) prices the corrected time equal to the physical one.

The fixed costs (``op_overhead``, ``op_overhead_graph``, ``grad_copy_overhead(_graph)``) and the
``concurrency`` table are physical too: each is timed on its own mechanism (ops launched one after
the other, a bucket's copies, two concurrent collectives), not fitted to whole programs.  Which
fixed cost applies, eager or inside one CUDA graph, follows how the plan will run
(:meth:`~hidup.profiler.Profile.launched`); ``hidup train`` settles that by a trial after the
search, but the plan is chosen before it, and the two differ ten-fold per op.

Compute (one rank, the whole per-rank batch; physical)
------------------------------------------------------
``t_fwd(n, s) = measured forward time`` when the profile has ``op_key(n.target, local input shapes
under s, op_dtype(dtype, precision))`` (plus, for times measured inside a CUDA graph, the host
dispatch an eager step adds: ``op_overhead - op_overhead_graph`` per op, twice backward), else the
roofline plus a fixed per-op cost::

    t_fwd(n, s) = o + max(s.flops / rate(dtype, s.flops), bytes(n, s) / memory_bandwidth)

where ``rate(dtype, F)`` is the rate of a matmul of ``F`` FLOPs (:meth:`~hidup.profiler.Profile.rate_at`:
the measured square matmul of equal FLOPs where the profile has the sizes, else the dtype's peak) --
for a matmul with a 2-D right operand (:meth:`CostModel.gemm_shape`: rows ``m``, columns ``n``, inner
``k``) where the profile has a GEMM grid for the dtype, the rate of its own shape and layout
instead, ``rate(dtype, m, n, k, layout)`` (the profile's ``gemm[dtype]``,
:class:`~hidup.profiler.gemm.GemmGrid`), and its backward is the two GEMMs of the same FLOPs at their
shapes and layouts, each counted when its operand requires a gradient::

    t_bwd(n, s) = sum over {x: (m, k, n), w: (n, k, m)} requiring a gradient of
                  o + max(s.flops / rate(dtype, shape, layout), bytes(n, s) / memory_bandwidth)

The layouts (:meth:`CostModel.gemm_layouts`): a weight stored ``[n, k]`` (``linear``, or a right
operand made by a transpose) runs its forward ``nt``, the input's gradient ``nn``; a weight stored
``[k, n]`` (``mm``, ``addmm``, ``matmul`` of a plain tensor: GPT-2's ``Conv1D``) the forward ``nn``,
the input's gradient ``nt`` and its own gradient as ``(k, n, m)``; a weight's gradient is ``tn``.

``bytes(n, s)`` is what one rank reads and writes (the local sizes of the node's inputs and
outputs under ``s``), ``o`` the profile's ``op_overhead`` and ``dtype`` that of the node's first
output: float32 uses the ``precision`` rate (fp32 by default; ``precision="tf32"`` models TF32
matmuls), bfloat16 -> bf16, float16 -> fp16, anything else -> fp32 -- except attention
(:data:`ATTENTION_OPS`) on float32 under ``tf32``, at the fp32 rate: torch's float32 attention
kernels use no TF32 tensor cores.  An attention kernel works on blocks of :data:`ATTENTION_BLOCK`
queries and keys, so its ``s.flops`` count each sequence length rounded up to whole blocks
(:meth:`CostModel.attention_blocks`: 65 patches and a class token compute as 128).  (A profile
without a memory bandwidth prices FLOPs alone: elementwise ops then look free, and replicating them
looks harmless.)
An attention (:data:`ATTENTION_OPS`) whose storage dtype (float32 under ``tf32``) and variant
(:attr:`hidup.ir.Node.variant`: ``dense``, ``causal``, ``masked``) the profile's ``attention`` table
has is priced from that table instead (:class:`hidup.profiler.attention.AttentionTable`, at its local
head dim, sequence lengths and rows ``batch x heads``): ``t_fwd = o + table forward``, ``t_bwd =
o + table backward``.
``t_bwd(n, s) = measured backward time`` if measured, else (other than a GEMM priced by its shape)
``2 * t_fwd(n, s)`` -- ``2.5 * t_fwd``
for attention (:data:`ATTENTION_BACKWARD`: its backward recomputes the scores, five matmuls against
the forward's two) -- plus, for a ``linear``/``addmm`` whose bias requires a gradient, the bias's
gradient ``o + bytes(output under s) / memory_bandwidth`` (the sum of the output gradient over its
rows, one more read of it; :meth:`CostModel.bias_grad`, compiled as below); ``t_bwd`` is 0 when no input of ``n``
requires a gradient (nothing to differentiate).  Only ``call`` nodes compute.

Under ``bf16``/``fp16`` autocast a matmul (:func:`kernel_kind` ``matmul``) reads its float32
parameters (directly or through views) in the low dtype: each is cast in the forward and its
gradient cast back to float32 in the backward, each a kernel of ``o + (4 + 2) p / memory_bandwidth``
for ``p`` local elements (:meth:`CostModel.autocast_casts`), added to ``t_fwd`` and ``t_bwd``
(measured times included: they time the op at its own dtype).
The fixed part ``o`` (``2 o`` backward) does not shrink when a copy runs half the batch:
:meth:`CostModel.fixed` reports it so that duplication pays it once per copy.

Inside the distributed program a node's compute is its corrected time (above):
:meth:`CostModel.compute` is ``dist_scale`` times :meth:`CostModel.device_compute`.

Compiled programs (``profile.compiled``, :meth:`~hidup.profiler.Profile.launched`)
----------------------------------------------------------------------------------
When inductor compiles the rank program, pointwise chains fuse and views cost nothing, so a node is
priced by what the compiled program moves, by its kind (:func:`hidup.rules.fusion.fusion_kind`):

* ``view``: 0 (forward and backward; no fixed cost either);
* ``kernel`` (matmuls, attention, custom ops): as above (measured, else roofline), with the bytes of
  its tensors at their dtype under the precision (:func:`hidup.frontend.saved.tensor_nbytes`);
* ``fused``: ``t_fwd = (R + W) / memory_bandwidth + o [W > 0]``, ``t_bwd = 2 t_fwd`` (0 without a
  gradient), where ``R`` are the local bytes of the inputs it reads from memory and ``W`` of the
  outputs it writes to memory.  Looking through views, every tensor has a *source* (the node that
  computed it, or a parameter/input) and every node a *level*: the number of ``kernel`` nodes on
  its longest path from the inputs (``level(n) = max over inputs of level(src) + [src is a kernel]``).
  Two fused nodes can share one generated kernel only when no kernel lies between them, i.e. at
  equal levels.  So an input is read when its source is not a fused node or sits at a lower level,
  and an output is written when some consumer (through views) is a kernel, the loss, or a fused node
  at a higher level.  Measured per-op times are eager kernels and are not used for fused nodes.

A gradient summed over its rows -- a bias's (:meth:`CostModel.bias_grad`), or, where the profile has
measured inductor's sums (``reduction_bandwidth``, ``kernel_floor_graph``:
:mod:`hidup.profiler.profile`, "Generated kernels"), that of each parameter a fused node broadcasts
(fewer local elements than its output: a norm's weight and bias), added to the fused node's
``t_bwd`` -- runs in a compiled program as a looped reduction over blocks of rows and a small kernel
adding the partial sums (:meth:`CostModel.grad_row_sum`, ``b`` the local bytes of the output's
gradient at its dtype)::

    t_sum = o + b / reduction_bandwidth[dtype] + kernel_floor_graph

each term falling back to ``memory_bandwidth`` and 0 where not measured; eagerly ``o + b /
memory_bandwidth``.

A GEMM whose dims are not all multiples of :data:`GEMM_ALIGN_BYTES` bytes (a vocabulary of 30522)
runs on slower kernels; inductor then benchmarks the GEMM padded -- each dim rounded up to that
alignment, each operand with a padded dim copied into a padded buffer first -- and keeps whichever
is faster (its ``pad_mm`` pass).  The compiled price of each GEMM of a matmul is likewise
(:meth:`CostModel.gemm_seconds`, ``b`` the operands' element size, ``A = m k`` and ``B = k n`` the
operands' elements and ``A'``, ``B'`` the padded ones)::

    t = min(2 m n k / rate(m, n, k),  2 m' n' k' / rate(m', n', k') + sum over padded operands X of
                                      o + (X + X') b / memory_bandwidth)

with the rates of the GEMM grid (its measured points where it has them: the misaligned shape runs on
its own kernel, :mod:`hidup.profiler.gemm`).

Inductor pads the rows of the tensors it lays out (``padding_alignment_bytes``: a stride of at least
:data:`PAD_MIN_STRIDE` elements becomes a multiple of :data:`PAD_ALIGN_BYTES`), and pads a
matmul's misaligned dims for its tensor cores, so a matmul output whose innermost dim is at least
1024 elements and not a multiple of 128 bytes (a vocabulary of 30522) lives in padded rows.  A
form change is a custom op that takes and gives dense tensors: converting such an output copies it
to a dense tensor first (forward) and the dense gradient back into padded rows (backward), each
``M(b)`` for the ``b`` local bytes of the converted form (:meth:`CostModel.padded_copies`, part of
the conversion's copies below).  A fused consumer reads the padded rows in place: no copy.

Communication of a form change ``src -> dst`` of tensor ``t`` (``ir.conversion``)
-------------------------------------------------------------------------------
``fwd = T(c_f, bytes(t))`` and ``bwd = T(c_b, bytes(t))`` if ``t`` requires a gradient else 0, where
``c_f`` / ``c_b`` are the conversion's forward / backward collectives, ``bytes(t)`` is the logical
(global) size of ``t`` (nccl-tests convention) at the dtype it is sent in: its dtype under the
search's precision (:func:`hidup.frontend.saved.tensor_dtype`; under bf16/fp16 autocast a matmul's output
travels in the low dtype, a parameter in float32; a gradient has its tensor's dtype),
``T(c, b) = alpha_c + b / algbw_c(b)`` over the whole world, and local ops (slice, zero_pad,
keep_rank0, identity) cost 0.  ``algbw`` comes from the profile's fitted tables
(:meth:`~hidup.profiler.Profile.fitted`): the ring all-gather, reduce-scatter and all-reduce of one
group are kept consistent with one link, so that a wrong measurement of one of them does not make
the search trade it for the others.

Routed experts (``hidup::routed_experts``, :mod:`hidup.search.experts_cost`)
---------------------------------------------------------------------------
Compute: the grouped GEMMs of each local expert at ``T k / E`` rows (balanced routing, an
assumption) and the passes over the rows a rank processes: all ``T k`` pairs of the gathered tokens
under the all-gather dispatcher (other ranks' pairs padded), its own ``T_r k`` pairs under the
all-to-all one (:mod:`hidup.rules.dispatch`), which runs eagerly between compiled regions.  The
all-to-all dispatcher adds its communication to the node (:meth:`CostModel.dispatch_comm`), on the
group of the mesh axis that dispatches: forward two all-to-alls of the rows (out and back), logical
size ``N T_r k D`` in the compute dtype (autocast's, else x's), one all-to-all of the ``N`` counts and
one host synchronization, priced as :data:`DISPATCH_SYNC_OVERHEADS` launches; backward two more
all-to-alls of the rows.  It is blocking (on the compute stream's path), and a duplicated copy pays
half of it as of any node's batch-dependent time.

Memory copies around a form change (compute stream)
---------------------------------------------------
The runtime (:mod:`hidup.codegen.collectives`) copies memory around its collectives, and those
copies run on the compute stream: ``L(b) = o + 2 b / layout_rate`` for a layout-changing copy of
``b`` bytes (``layout_rate`` the profile's :meth:`~hidup.profiler.Profile.layout_rate`; for a copy
that moves the innermost dim, a transpose bound by its element count, the profile's
:meth:`~hidup.profiler.Profile.transpose_rate` at the tensor's element size),
``M(b) = o + 2 b / memory_bandwidth`` for a plain one, ``Z(b) = o + b / memory_bandwidth`` to zero
``b`` bytes.  With ``B = bytes(t)``, ``n`` ranks, and a dim ``d`` *moved* when the dims before it (of
the tensor the op reads) are not all of size 1:

* ``slice`` to ``gather_d``: ``L(B/n)`` if ``d`` is moved (the slice is strided), else 0;
* ``zero_pad`` from ``gather_d``: ``Z(B) + L(B/n)`` (``M(B/n)`` if ``d`` is not moved);
* ``keep_rank0``: ``Z(B)`` (the ranks other than 0 hold zeros);
* ``all_gather`` from ``gather_d``: ``L(B/n) + L(B)`` if ``d`` is moved (to the front and back), else 0;
* ``reduce_scatter`` to ``gather_d``: ``L(B) + L(B/n)`` if ``d`` is moved, else 0;
* ``all_reduce``: ``M(B)`` (the sum goes to a new buffer);
* ``all_to_all`` ``gather_s -> gather_d``: ``L(B/n)`` if ``d`` is moved, plus the concatenation of
  what was received: ``L(B/n)`` when ``d != 0`` (the parts are strided), else ``M(B/n)``.

Each is added to the compute of the consumer that pays the conversion (``ConvCost.fwd_copies``/``bwd_copies``, part
of ``fwd``/``bwd``).  Per duplicated copy a batch-dependent tensor copies half as many bytes (one
fixed cost ``o`` each); a batch-independent one copies the whole tensor in each copy.

Gradient all-reduce of a ``replicate`` parameter (``grad_sync``, the backward of ``replicate -> *``)
-----------------------------------------------------------------------------------------------------
A replicated parameter enters the rank program whole and converts like a ``full`` tensor; its
backward runs the forward op's adjoint (``zero_pad`` after a ``slice``: its copies as above) and
then the sum over ranks.  The runtime does not all-reduce each such gradient on its own: it packs them into buckets of
``bucket_mb`` MB (:mod:`hidup.codegen.grads`, as DDP does) and all-reduces whole buckets.  A
parameter of ``b`` bytes is charged its share of one bucket::

    G(b) = T(all_reduce, B) * b / B,   B = max(b, min(bucket_mb MB, trainable parameter bytes))

so the step pays one latency ``alpha`` per bucket, not per parameter, at the bandwidth of a
bucket-sized message (a parameter larger than a bucket gets a bucket of its own: ``G(b) = T(b)``;
a model smaller than one bucket syncs in one message).  The share is node-local, so the DP sums it
like any other cost; only the last, partly filled bucket is priced as if it were full.  A gradient
of ``b >= GRAD_PACK_BYTES`` bytes is summed where it lies and costs the compute stream nothing; a
smaller one is packed into its bucket's flat buffer, which costs ``g + 2 b / memory_bandwidth`` (``g``
the profile's :meth:`~hidup.profiler.Profile.grad_copy_fixed`; the sum is not copied back: the
gradient becomes a view of the buffer), once per step (with duplication: in copy A's item).

ZeRO (``zero``, :mod:`hidup.codegen.zero`)
------------------------------------------
A cost model of ZeRO stage ``z`` prices a replicated parameter that ZeRO splits
(:func:`hidup.ir.zero_stage`) differently.  Stage 2 reduce-scatters its gradient instead
of all-reducing it, bucketed and asynchronous like the all-reduce, never packed (no copies)::

    S(b) = T(reduce_scatter, B) * b / B     (B the bucket of G(b) above)

where a gradient of fewer than ``GRAD_PACK_BYTES`` bytes, which the all-reduce would have packed into
the bucket's flat buffer, is a tensor of its own in the coalesced call instead and adds ``g`` (the
packing's fixed cost, :data:`hidup.ir.GRAD_PACK_BYTES` says why they are alike) to the network's time.
Stage 1 keeps ``G(b)``.  Both then all-gather the updated rows after the optimizer step, exposed
(nothing runs beside it), bucketed the same way: ``A(b) = T(all_gather, B) * b / B`` (plus ``g`` for
a small one)
(:meth:`CostModel.zero_gather`, summed over the plan's split parameters into the plan's
``zero_gather`` time), and the optimizer steps ``b / N`` of such a parameter
(:meth:`hidup.search.memory.MemoryModel.stepped`).  A ring's reduce-scatter and all-gather each move
what half an all-reduce moves, so stage 2 sends what stage 0 sends, one half of it after the backward.

Gradients reduced in bf16 (``reduce_dtype``, :mod:`hidup.precision`)
-------------------------------------------------------------------
A cost model with ``reduce_dtype="bf16"`` (only under ``precision="bf16"``) prices every backward
collective that sums a float32 trainable parameter's gradient over ranks -- ``G(b)``, ``S(b)`` above, the
reduce-scatter adjoint of a parameter's all-gather, and a mesh step's -- at bfloat16's bytes,
``r = 1/2`` of them (:meth:`CostModel.reduce_share`)::

    G'(b) = T(all_reduce, r B) * b / B,   S'(b) = T(reduce_scatter, r B) * b / B,   T(c, r b) otherwise

(the bucket holds the same parameters, half the bytes), plus the casts around the collective on the
compute stream (:meth:`CostModel.reduce_casts`): float32 to bfloat16 of the whole gradient before it,
``o + 1.5 b / memory_bandwidth`` (4 bytes read and 2 written per element; none where the gradient
already arrives in bfloat16: a parameter gathered in autocast's dtype, "Weights on the wire"), and
back to float32 of what the rank receives after it, ``o + 1.5 b_recv / memory_bandwidth`` (``b_recv = b``
for an all-reduce, ``b / n`` for a reduce-scatter).  A ZeRO-2 parameter's all-gather after the
optimizer moves float32 weights and keeps its price.  The plan records the bytes the same way
(``ConversionRecord.wire``, a mesh step's ``backward_bytes``), so ``Plan.sent_bytes`` follows.

Nodes of one price
------------------
A node's compute reads of the node only its op and target, its fusion (compiled), its half-batch
twin (``graph.half``, found by name) and its input and output tensors: shapes, dtypes,
``requires_grad``, bytes under the precision, batch dependence, which of them are one tensor and
the parameter each is a view of.  Nodes equal in all of that (the same op of identical layers) are
priced alike under every signature, so :meth:`CostModel.device_compute` works each price out once,
for the first of them in graph order (:meth:`CostModel.twin`), and the others read it: the same
numbers, computed once instead of once per layer.

Duplication (two half-batch copies A and B)
-------------------------------------------
A tensor is *batch-dependent* when it derives from a model input; parameters, buffers and tensors
computed only from them are not.  Per copy:

* a batch-dependent node computes its measured time at the copy's own shapes when the graph carries
  its half-batch trace (``graph.half``, :func:`hidup.frontend.trace.trace_half_batch`) and the profile has
  both batch sizes measured -- small kernels run less efficiently, so a copy often takes more than
  half -- else ``t/2`` in each copy (``cA = cB = t/2``, plus the fixed per-op cost in each), and
  autocast's casts of its parameters whole in each (each copy casts the whole weight); a
  batch-independent one (an op on weights only) runs in both copies, since each copy
  runs the whole per-rank program (``cA = cB = t``) -- :meth:`CostModel.copy_device_compute`, the
  physical time; :meth:`CostModel.copy_compute` is it corrected, times ``dist_dup_scale``.  The
  schedule serializes the copies' compute although on the GPU their kernels run side by side on two
  streams: measured on one H200, the two-stream step took 0.96-1.08 times the copies priced one
  after the other (each half-batch kernel slows by about what the overlap gains), so nothing
  corrects for it;
* a batch-dependent conversion moves half the tensor in each copy: ``mA = mB = T(c, bytes/2)``
  (alpha is paid twice); a batch-independent one moves the whole tensor in each copy
  (``mA = mB = T(c, bytes)``: a sharded weight is all-gathered, and its gradient reduce-scattered,
  once per copy) -- except the gradient all-reduce of a ``replicate`` parameter, which the bucketed
  gradient synchronization does once per step after both copies: ``bA = G(bytes), bB = 0``;
* the two copies communicate on two communicators, and two collectives in flight at once can move
  more bytes per second than one (parallel connections over sockets): a per-copy collective
  ``c`` of ``b`` bytes is charged ``T(c, b) / k_c(b)``, with ``k_c(b)`` in [1, 2] the profile's
  measured ``pair_speedup`` (aggregate throughput of two equal concurrent calls over one), so the
  serialized two-copy schedule below occupies the network as long as the concurrent calls do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hidup.frontend.saved import tensor_dtype, tensor_nbytes
from hidup.ir import (
    DTYPE_BYTES,
    FORM_CHANGE_OPS,
    FULL,
    GRAD_BUCKET_MB,
    GRAD_PACK_BYTES,
    REPLICATE,
    Conversion,
    Form,
    Graph,
    Layout,
    MeshConversion,
    Node,
    Signature,
    Tensor,
    conversion,
    held_fraction,
    layout_conversions,
    zero_stage,
)
from hidup.precision import (
    AUTOCAST_LOW_OPS,
    casts_on_wire,
    check_reduce_dtype,
    reduce_low_params,
    reduce_share,
    wire_low_params,
)
from hidup.profiler.profile import DTYPES, Corrections, op_dtype
from hidup.rules.dispatch import dispatch_axis
from hidup.rules.fusion import fusion_kind
from hidup.search.experts_cost import ExpertsShape, experts_seconds

__all__ = ["CostModel", "ConvCost", "profile_dtype", "PRECISIONS", "KERNEL_KINDS", "kernel_kind"]

PRECISIONS = DTYPES  # the profile's FLOP-rate keys are the precisions a search can price

# What a node's compute is reported as, by the kind of GPU kernel it runs (the kinds a profiler
# trace is split into: :data:`hidup.runtime.bench_rank.KERNEL_KINDS`): ``copies`` are the memory
# copies around form changes and the gradient buckets, ``optimizer`` the Adam step.
KERNEL_KINDS = ("matmul", "attention", "generated", "copies", "optimizer", "other")
MATMUL_OPS = AUTOCAST_LOW_OPS  # the ops autocast runs in its low dtype are the matmul kernels
ATTENTION_OPS = frozenset({"scaled_dot_product_attention"})
# An attention kernel's backward recomputes the scores: 5 matmuls of the forward's 2 (flash attention)
ATTENTION_BACKWARD = 2.5
# queries and keys per block of torch's attention kernels (flash, memory-efficient, cuDNN: 64 x 64 tiles)
ATTENTION_BLOCK = 64
# the routed experts' all-to-all dispatcher waits once per layer for its split sizes (a host
# synchronization): the launch queue drains and the next kernels start from an idle GPU, priced as
# this many launches (search/cost.py docstring, "Routed experts")
DISPATCH_SYNC_OVERHEADS = 4
# autocast's low dtype per precision
LOW_PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}
# inductor pads the strides of the tensors it lays out to multiples of this many bytes, where a
# stride is at least PAD_MIN_STRIDE elements (torch._inductor.config.padding_alignment_bytes,
# padding_stride_threshold)
GEMM_ALIGN_BYTES = 16  # inductor pads a GEMM's dims to multiples of 16 bytes (4 float32, 8 bfloat16 elements)
PAD_ALIGN_BYTES = 128
PAD_MIN_STRIDE = 1024


def kernel_kind(target: str) -> str | None:
    """The :data:`KERNEL_KINDS` entry a call node of op ``target`` runs as in a compiled program:
    ``matmul``/``attention`` for library kernels of those ops, ``generated`` for fused ops
    (:func:`hidup.rules.fusion.fusion_kind`), ``other`` for any other kernel; None for a view."""
    base = target.split(".", 1)[0]
    if base in MATMUL_OPS:
        return "matmul"
    if base in ATTENTION_OPS:
        return "attention"
    return {"view": None, "fused": "generated"}.get(fusion_kind(target), "other")


def profile_dtype(torch_dtype: str, precision: str = "fp32") -> str:
    """Profile FLOP-rate key for a tensor dtype; float32 follows ``precision``."""
    if torch_dtype == "float32":
        return precision
    return {"bfloat16": "bf16", "float16": "fp16"}.get(torch_dtype, "fp32")


def gemm_itemsize(rate_key: str) -> int:
    """Bytes of a matmul operand at the profile dtype ``rate_key`` (its operands are in that dtype)."""
    return 2 if rate_key in LOW_PRECISIONS else 4


def padded_gemm(dims: tuple[int, ...], rate_key: str) -> tuple[int, ...]:
    """The GEMM ``dims`` as inductor pads it for operands at ``rate_key``: each rounded up to a multiple
    of :data:`GEMM_ALIGN_BYTES` bytes (module docstring, "Compiled programs")."""
    align = max(1, GEMM_ALIGN_BYTES // gemm_itemsize(rate_key))
    return tuple(-(-d // align) * align for d in dims)


@dataclass(frozen=True)
class ConvCost:
    """Costs of one form change: no-duplication forward/backward and per-copy (A, B) times."""

    conv: Conversion
    fwd: float  # no duplication: forward communication + memory copies
    bwd: float  # no duplication: backward communication + memory copies
    fwd_comm_a: float  # with duplication: copy A's and copy B's forward communication
    fwd_comm_b: float
    bwd_comm_a: float  # with duplication: copy A's and copy B's backward communication
    bwd_comm_b: float
    grad_sync: bool = False  # replicate -> *: the bucketed, asynchronous gradient all-reduce (bwd)
    # memory copies on the compute stream (part of fwd / bwd; per copy beside the communication)
    fwd_copies: float = 0.0
    bwd_copies: float = 0.0
    fwd_copies_a: float = 0.0
    fwd_copies_b: float = 0.0
    bwd_copies_a: float = 0.0
    bwd_copies_b: float = 0.0
    # the backward communication split: the bucketed gradient all-reduce (asynchronous) and the
    # collectives the compute stream waits for (``bwd = bwd_async + bwd_block + bwd_copies``)
    bwd_async: float = 0.0
    bwd_block: float = 0.0


def _copies_keep_rank0(copy, moved, frm, to, whole, part, membw, layout):
    return copy(whole, membw, 1.0)  # the zeros written on the other ranks


def _copies_slice(copy, moved, frm, to, whole, part, membw, layout):
    return copy(part, layout(to.dim)) if moved(frm, to.dim) else 0.0


def _copies_zero_pad(copy, moved, frm, to, whole, part, membw, layout):
    return copy(whole, membw, 1.0) + copy(part, layout(frm.dim) if moved(to, frm.dim) else membw)


def _copies_all_gather(copy, moved, frm, to, whole, part, membw, layout):
    return copy(part, layout(frm.dim)) + copy(whole, layout(frm.dim)) if moved(frm, frm.dim) else 0.0


def _copies_reduce_scatter(copy, moved, frm, to, whole, part, membw, layout):
    return copy(whole, layout(to.dim)) + copy(part, layout(to.dim)) if moved(frm, to.dim) else 0.0


def _copies_all_to_all(copy, moved, frm, to, whole, part, membw, layout):
    front = copy(part, layout(to.dim)) if moved(frm, to.dim) else 0.0
    return front + copy(part, layout(to.dim) if to.dim != 0 else membw)


# The memory copies of every local or collective op of hidup.ir.FORM_CHANGE_OPS (module docstring,
# "Memory copies around a form change"); grad_sync's are the gradient bucket's (CostModel.grad_copies)
# plus its local op's.
_COPY_MODELS = {
    "identity": lambda *args: 0.0,
    "slice": _copies_slice,
    "zero_pad": _copies_zero_pad,
    "keep_rank0": _copies_keep_rank0,
    "all_gather": _copies_all_gather,
    "reduce_scatter": _copies_reduce_scatter,
    "all_reduce": lambda copy, moved, frm, to, whole, part, membw, layout: copy(whole, membw),
    "all_to_all": _copies_all_to_all,
}
if set(_COPY_MODELS) | {"grad_sync"} != set(FORM_CHANGE_OPS):
    raise AssertionError(f"copy models for {sorted(_COPY_MODELS)}, the IR declares {sorted(FORM_CHANGE_OPS)}")


class CostModel:
    """Prices nodes and form changes of one graph under one profile (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        profile,
        precision: str = "fp32",
        bucket_mb: float = GRAD_BUCKET_MB,
        zero: int = 0,
        reduce_dtype: str = "fp32",
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
        check_reduce_dtype(reduce_dtype, precision)
        self.reduce_dtype = reduce_dtype  # the dtype parameter gradients are summed in (module docstring)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 (the runtime's gradient bucket size in MB), got {bucket_mb!r}")
        self.graph, self.profile, self.precision = graph, profile, precision
        self.bucket_mb = bucket_mb  # the runtime's gradient bucket, MB (a compiled program's graphs follow it)
        self.zero = zero  # the ZeRO stage of the replicated parameters (module docstring, "ZeRO")
        self.world, self.mesh = graph.world_size, graph.mesh
        trainable = sum(t.nbytes for t in graph.tensors.values() if t.is_param and t.requires_grad)
        self.bucket_bytes = float(min(bucket_mb * 2**20, trainable)) if trainable else bucket_mb * 2**20
        self._conv_cache: dict[tuple, ConvCost | None] = {}  # by (shape, bytes, grad, batch, src, dst)
        self._conv_by_tensor: dict[tuple, ConvCost | None] = {}  # by (tensor id, src, dst)
        self.batch = self._batch_dependence(graph)
        self.comm_profile = profile.fitted()  # collective times (fitted tables)
        # measured op times timed inside a CUDA graph hold no host dispatch: an eager step adds it
        launched, in_graph = profile.op_overhead, profile.op_overhead_graph
        self._dispatch_extra = max(0.0, launched - in_graph) if profile.ops_timing == "graph" and in_graph > 0 else 0.0
        self._half_sigs: dict[str, dict] = {}
        # (twin's name, id(signature)) -> (signature, physical (forward, backward)): a node's price does
        # not depend on the problem that asks for it, so every problem sharing this model reuses it, and
        # the nodes of one price share it (module docstring, "Nodes of one price")
        self._device: dict[tuple, tuple] = {}
        # the layout changes of a mesh: (src, dst) -> ir.layout_conversions, and (conversion class, axis,
        # layout before, form after) -> the priced parts of that one-axis step (paths share steps)
        self._paths: dict[tuple, list] = {}
        self._steps: dict[tuple, tuple] = {}
        # bytes each tensor sends: at its dtype under the precision (autocast's low dtype where it applies)
        self.nbytes = {tid: tensor_nbytes(graph, tid, precision) for tid in graph.tensors}
        self.corrections: Corrections = profile.corrections
        self.compiled = bool(getattr(profile, "compiled", False))
        self._fusion: dict[str, tuple[str, frozenset, frozenset]] = self._fused_traffic(graph) if self.compiled else {}
        self._param_of = self._params_through_views(graph)
        low = LOW_PRECISIONS.get(precision)
        self._wire = wire_low_params(graph) if low else frozenset()
        self._wire_share = DTYPE_BYTES[low] / 4 if low else 1.0
        self._reduce = reduce_low_params(graph) if reduce_dtype != "fp32" else frozenset()
        self._reduce_share = reduce_share(reduce_dtype)
        self._padded = self._padded_matmul_outputs(graph) if self.compiled else frozenset()
        self._twin = self._price_twins(graph)

    def _price_twins(self, graph: Graph) -> dict[str, Node]:
        """node name -> the first node (in graph order) priced as it is under every signature (module
        docstring, "Nodes of one price")."""
        first: dict[tuple, Node] = {}
        return {n.name: first.setdefault(self._price_key(n), n) for n in graph.nodes}

    def _price_key(self, node: Node) -> tuple:
        """Everything :meth:`device_compute` and :meth:`copy_device_compute` read of ``node`` besides the
        signature: its op, target and variant, its fusion in a compiled program, its name where a half-batch graph
        is looked up by it, which inputs are one tensor, and per input and output tensor the shape, the
        dtype, ``requires_grad``, the bytes under the precision, the batch dependence and the dtype and
        ``requires_grad`` of the parameter it is a view of."""
        g = self.graph

        def tensor(t: int) -> tuple:
            x, param = g.tensors[t], self._param_of.get(t)
            of_param = None if param is None else (g.tensors[param].dtype, g.tensors[param].requires_grad)
            return x.shape, x.dtype, x.requires_grad, self.nbytes[t], self.batch.get(t, False), of_param

        return (
            node.op,
            node.target,
            node.variant,
            self._fusion.get(node.name),
            node.name if g.half is not None else None,
            tuple(node.inputs.index(t) for t in node.inputs),
            tuple(map(tensor, node.inputs)),
            tuple(map(tensor, node.outputs)),
        )

    def twin(self, node: Node) -> Node:
        """The node whose prices ``node`` shares (module docstring, "Nodes of one price"): ``node`` itself
        or an earlier node of the graph equal to it in all they read."""
        return self._twin[node.name]

    @staticmethod
    def _fused_traffic(graph: Graph) -> dict[str, tuple[str, frozenset, frozenset]]:
        """node name -> (fusion kind, positions of the inputs it reads from memory, positions of the
        outputs it writes to memory) of every call node of a compiled program (module docstring,
        "Compiled programs"; the positions only for ``fused`` nodes)."""
        kind = {n.name: fusion_kind(n.target) for n in graph.nodes if n.op == "call"}
        source: dict[int, tuple[str, int]] = {}  # tensor id -> (kind of its source, the source's level)
        level: dict[str, int] = {}
        consumers: dict[int, list[Node]] = {}
        for n in graph.nodes:
            for t in n.inputs:
                consumers.setdefault(t, []).append(n)
            k = kind.get(n.name, "leaf")
            srcs = [source.get(t, ("leaf", 0)) for t in n.inputs]
            if k == "view":
                through = srcs[0] if srcs else ("leaf", 0)
                for t in n.outputs:
                    source[t] = through
                continue
            level[n.name] = max((lv + (sk == "kernel") for sk, lv in srcs), default=0)
            for t in n.outputs:
                source[t] = (k, level[n.name])

        def written(tid: int, lv: int) -> bool:
            for c in consumers.get(tid, ()):
                ck = kind.get(c.name, "leaf")
                if ck == "view":
                    if any(written(t, lv) for t in c.outputs):
                        return True
                elif ck != "fused" or level[c.name] > lv:
                    return True
            return False

        out = {}
        for n in graph.nodes:
            if n.op != "call":
                continue
            k = kind[n.name]
            if k != "fused":
                out[n.name] = (k, frozenset(), frozenset())
                continue
            lv = level[n.name]
            sources = [source.get(t, ("leaf", 0)) for t in n.inputs]
            reads = frozenset(i for i, (sk, slv) in enumerate(sources) if sk != "fused" or slv < lv)
            writes = frozenset(i for i, t in enumerate(n.outputs) if written(t, lv))
            out[n.name] = (k, reads, writes)
        return out

    def _local_bytes(self, tid: int, form: Form) -> float:
        """Bytes of tensor ``tid``'s local piece under ``form`` at its dtype under the precision."""
        t = self.graph.tensors[tid]
        whole = math.prod(t.shape)
        return self.nbytes[tid] * (math.prod(form.local_shape(t.shape, self.mesh)) / whole if whole else 1.0)

    def _compiled_compute(self, node: Node, sig: Signature) -> tuple[float, float] | None:
        """(forward, backward) of a ``view`` or ``fused`` node in a compiled program; None for a
        ``kernel`` node (priced as an op of its own)."""
        kind, reads, writes = self._fusion[node.name]
        if kind == "view":
            return 0.0, 0.0
        if kind != "fused":
            return None
        measured_sums = self.profile.reduction_bandwidth or self.profile.kernel_floor_graph
        try:
            moved = sum(self._local_bytes(node.inputs[i], sig.inputs[i]) for i in reads)
            moved += sum(self._local_bytes(node.outputs[i], sig.outputs[i]) for i in writes)
            sums = self._broadcast_params(node, sig) if measured_sums and self.requires_backward(node) else 0
        except ValueError:
            return math.inf, math.inf
        membw = self.profile.memory_bandwidth
        fwd = (moved / membw if membw else 0.0) + (self.profile.op_overhead if writes else 0.0)
        if not self.requires_backward(node):
            return fwd, 0.0
        if sums and membw:
            out = node.outputs[0]
            return fwd, 2.0 * fwd + sums * self.grad_row_sum(self._local_bytes(out, sig.outputs[0]), out)
        return fwd, 2.0 * fwd

    def _broadcast_params(self, node: Node, sig: Signature) -> int:
        """How many parameters requiring a gradient ``node`` broadcasts under ``sig``: fewer local elements
        than its first output (a norm's weight and bias), each gradient a sum over rows."""
        if not node.outputs:
            return 0
        g, mesh = self.graph, self.mesh
        out = math.prod(sig.outputs[0].local_shape(g.tensors[node.outputs[0]].shape, mesh))
        params = ((g.tensors[t], form) for t, form in zip(node.inputs, sig.inputs))
        return sum(
            1
            for t, form in params
            if t.is_param and t.requires_grad and math.prod(form.local_shape(t.shape, mesh)) < out
        )

    @staticmethod
    def _batch_dependence(graph: Graph) -> dict[int, bool]:
        """tensor id -> derives from a model input (True) or only from parameters/constants."""
        batch: dict[int, bool] = {}
        for n in graph.nodes:
            b = n.op == "input" or (n.op == "call" and any(batch.get(t, False) for t in n.inputs))
            for t in n.outputs:
                batch[t] = b
        return batch

    def node_is_batch(self, node: Node) -> bool:
        return any(self.batch.get(t, False) for t in node.inputs) or node.op == "input"

    def requires_backward(self, node: Node) -> bool:
        return any(self.graph.tensors[t].requires_grad for t in node.inputs)

    def _local_shapes(self, graph: Graph, node: Node, sig: Signature) -> list | None:
        try:
            return [f.local_shape(graph.tensors[t].shape, graph.mesh) for t, f in zip(node.inputs, sig.inputs)]
        except ValueError:
            return None

    def measured(self, graph: Graph, node: Node, sig: Signature) -> tuple[float, float] | None:
        """The profile's measured (forward, backward) of ``node`` (a node of ``graph``) under ``sig``,
        plus the dispatch cost a graph-timed measurement leaves out (physical); None when not measured."""
        shapes = self._local_shapes(graph, node, sig)
        if shapes is None or not self.profile.ops:
            return None
        dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
        measured = self.profile.op_time(node.target, shapes, op_dtype(dtype, self.precision))
        if measured is None:
            return None
        fwd, bwd = measured
        extra = self._dispatch_extra
        return fwd + extra, (bwd + 2.0 * extra if self.requires_backward(node) else 0.0)

    def corrected(self, physical: tuple[float, float], duplicated: bool) -> tuple[float, float]:
        """A call node's physical (forward, backward) compute with the profile's corrections applied:
        times ``dist_dup_scale`` for one duplicated copy, else ``dist_scale`` (module docstring,
        "Physical time and corrected time").  The one place any correction enters a time."""
        k = self.corrections.factor(duplicated)
        return physical[0] * k, physical[1] * k

    def compute(self, node: Node, sig: Signature) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` under ``sig`` on one rank (whole batch), inside the
        distributed program without duplication: :meth:`device_compute` corrected."""
        return self.in_program(self.device_compute(node, sig))

    def in_program(self, device: tuple[float, float]) -> tuple[float, float]:
        """A :meth:`device_compute` result inside the distributed program without duplication
        (:meth:`corrected`)."""
        return self.corrected(device, duplicated=False)

    def device_compute(self, node: Node, sig: Signature) -> tuple[float, float]:
        """(forward, backward) physical seconds of ``node`` under ``sig`` on one device (whole batch):
        the measured time or the roofline (module docstring, "Compute")."""
        if node.op != "call":
            return 0.0, 0.0
        twin = self._twin[node.name]
        key = (twin.name, id(sig))
        hit = self._device.get(key)
        if hit is None or hit[0] is not sig:
            (cf, cb), (mf, mb) = self._device_compute(twin, sig), self.dispatch_comm(twin, sig)
            hit = self._device[key] = (sig, (cf + mf, cb + mb))
        return hit[1]

    def dispatch(self, node: Node, sig: Signature) -> tuple[int | None, float, int] | None:
        """(mesh axis or None, logical bytes of one all-to-all of the rows, all-to-alls of the rows per
        step) of a routed-experts node under its ``all_to_all`` signature (module docstring, "Routed
        experts"): the rows of every rank's (token, slot) pairs in the compute dtype; None for any
        other node or signature."""
        axis = dispatch_axis(sig)
        if axis is None or node.op != "call" or node.target.split(".", 1)[0] != "routed_experts":
            return None
        shapes = self._local_shapes(self.graph, node, sig)
        if shapes is None:
            return None
        on = axis if sig.axes else None
        n, _ = self.group(on)
        (tokens, hidden), (_, k) = shapes[0], shapes[1]
        low = LOW_PRECISIONS.get(self.precision)
        itemsize = DTYPE_BYTES[low] if low else DTYPE_BYTES.get(self.graph.tensors[node.inputs[0]].dtype, 4)
        return on, float(n * tokens * k * hidden * itemsize), 4 if self.requires_backward(node) else 2

    def dispatch_comm(self, node: Node, sig: Signature) -> tuple[float, float]:
        """(forward, backward) seconds of the all-to-all token dispatch inside a routed-experts node
        (:meth:`dispatch`): two all-to-alls of the rows, the counts' and one host synchronization
        forward, two of the rows backward; zero for any other node or signature."""
        d = self.dispatch(node, sig)
        if d is None:
            return 0.0, 0.0
        on, rows, exchanges = d
        n, _ = self.group(on)
        counts = self.comm("all_to_all", n * n * 8, on) + DISPATCH_SYNC_OVERHEADS * self.profile.op_overhead
        one = self.comm("all_to_all", rows, on)
        return 2.0 * one + counts, (exchanges - 2) * one

    def _device_compute(self, node: Node, sig: Signature) -> tuple[float, float]:
        if self.compiled:
            fused = self._compiled_compute(node, sig)
            if fused is not None:
                return fused
        cast_fwd, cast_bwd = self.autocast_casts(node, sig)
        g = self.graph
        measured = self.measured(g, node, sig)
        if measured is not None:
            return measured[0] + cast_fwd, measured[1] + cast_bwd
        dtype = g.tensors[node.outputs[0]].dtype if node.outputs else "float32"
        needs_bwd = self.requires_backward(node)
        shapes = self._local_shapes(g, node, sig)
        if node.target.split(".", 1)[0] == "routed_experts" and shapes is not None:
            dispatched = dispatch_axis(sig) is not None
            fwd, bwd = self.experts_time(node, shapes, profile_dtype(dtype, self.precision), needs_bwd, dispatched)
            return fwd + cast_fwd, (bwd + cast_bwd if needs_bwd else 0.0)
        kind = kernel_kind(node.target)
        rate_key = profile_dtype(dtype, self.precision)
        flops = sig.flops
        if kind == "attention":
            if rate_key == "tf32":  # float32 attention kernels use no TF32 tensor cores
                rate_key = "fp32"
            timed = self.attention_time(node, shapes, rate_key)
            if timed is not None:
                o = self.profile.op_overhead
                return timed[0] + o + cast_fwd, (timed[1] + o + cast_bwd if needs_bwd else 0.0)
            flops *= self.attention_blocks(node)
        gemms = self.gemms(node, shapes) if kind == "matmul" else None
        grads = None  # seconds of each gradient GEMM at its own shape, where the profile has the grid
        grid = self.profile.gemm.get(rate_key) if gemms is not None else None
        if grid is not None:
            (_, dims, layout, _), *backward = gemms
            fwd = self.gemm_seconds(grid, dims, layout, rate_key)
            grads = [
                self.gemm_seconds(grid, d, lay, rate_key) for _, d, lay, t in backward if g.tensors[t].requires_grad
            ]
        else:
            fwd = flops / self.profile.rate_at(rate_key, flops)
        floor = 0.0  # seconds to move the kernel's bytes
        membw = self.profile.memory_bandwidth
        if membw and shapes is not None and self.compiled:
            moved = sum(self._local_bytes(t, f) for t, f in zip(node.inputs, sig.inputs))
            moved += sum(self._local_bytes(t, f) for t, f in zip(node.outputs, sig.outputs))
            floor = moved / membw
        elif membw and shapes is not None:
            moved = sum(math.prod(sh) * DTYPE_BYTES.get(g.tensors[t].dtype, 4) for t, sh in zip(node.inputs, shapes))
            for t, f in zip(node.outputs, sig.outputs):
                tensor = g.tensors[t]
                moved += math.prod(f.local_shape(tensor.shape, self.mesh)) * DTYPE_BYTES.get(tensor.dtype, 4)
            floor = moved / membw
        o = self.profile.op_overhead
        fwd = max(fwd, floor) + o
        if not needs_bwd:
            return fwd + cast_fwd, 0.0
        if grads is not None:
            bwd = sum(max(t, floor) + o for t in grads)
        else:
            bwd = (ATTENTION_BACKWARD if kind == "attention" else 2.0) * fwd
        return fwd + cast_fwd, bwd + self.bias_grad(node, sig) + cast_bwd

    def experts_time(
        self, node: Node, shapes: list, rate_key: str, needs_bwd: bool, dispatched: bool = False
    ) -> tuple[float, float]:
        """(forward, backward) of a routed-experts node at its local ``shapes``: its grouped GEMMs at
        each expert's shape under balanced routing and its passes over the rows
        (:mod:`hidup.search.experts_cost`).  ``dispatched``: the all-to-all signature, whose rank
        receives its local experts' rows only (every row valid) and runs eagerly (a graph break)."""
        x, idx, w, gate_up, down = shapes[:5]
        g = self.graph
        low = LOW_PRECISIONS.get(self.precision)
        compute = DTYPE_BYTES[low] if low else gemm_itemsize(rate_key)
        x_bytes = DTYPE_BYTES.get(g.tensors[node.inputs[0]].dtype, 4)
        shape = ExpertsShape(
            tokens=x[0],
            hidden=x[1],
            ffn=down[2],
            k=idx[1],
            local_experts=gate_up[0],
            experts=gate_up[0] if dispatched else g.tensors[node.inputs[3]].shape[0],
            compute_bytes=compute,
            x_bytes=x_bytes,
        )
        grid = self.profile.gemm.get(rate_key)

        def gemm(dims: tuple[int, int, int], layout: str) -> float:
            if grid is not None:
                return self.gemm_seconds(grid, dims, layout, rate_key)
            flops = 2.0 * math.prod(dims)
            return flops / self.profile.rate_at(rate_key, flops)

        return experts_seconds(shape, gemm, self.profile.memory_bandwidth, self.profile.op_overhead, needs_bwd)

    def gemm_seconds(self, grid, dims: tuple[int, int, int], layout: str, rate_key: str) -> float:
        """Seconds of the GEMM ``dims = (m, n, k)`` in ``layout`` at the profile's ``rate_key`` dtype, from
        the profile's GEMM ``grid`` (module docstring, "Compute"); in a compiled program the cheaper of
        the GEMM as it is and inductor's padded GEMM (module docstring, "Compiled programs")."""
        m, n, k = dims
        seconds = 2.0 * m * n * k / grid.rate(m, n, k, layout)
        padded = padded_gemm(dims, rate_key)
        membw = self.profile.memory_bandwidth
        if not self.compiled or padded == dims or not membw:
            return seconds
        itemsize = gemm_itemsize(rate_key)
        pm, pn, pk = padded
        copies = 0.0  # each operand with a padded dim is copied into a padded buffer: read it, write that
        for size, padded_size in ((m * k, pm * pk), (k * n, pk * pn)):
            if size != padded_size:
                copies += self.profile.op_overhead + (size + padded_size) * itemsize / membw
        return min(seconds, 2.0 * pm * pn * pk / grid.rate(pm, pn, pk, layout) + copies)

    @staticmethod
    def gemm_shape(node: Node, shapes: list | None) -> tuple[tuple[int, int, int], tuple[int, int]] | None:
        """``((m, n, k), (x, w))`` of a matmul with a 2-D right operand -- ``linear(x[..., k], w[n, k])``,
        ``mm(x[m, k], w[k, n])``, ``addmm(b, x, w)``, ``matmul(x[..., k], w[k, n])`` at the local
        ``shapes`` of its inputs, ``m`` the rows of ``x`` over its leading dims, ``x``/``w`` the
        tensor ids whose gradients are the ``(m, k, n)`` and ``(n, k, m)`` GEMMs of its backward
        (:mod:`hidup.profiler.gemm`); None for any other op (batched, einsum, convolutions, experts)."""
        if shapes is None:
            return None
        base = node.target.split(".", 1)[0]
        first = {"linear": 0, "mm": 0, "matmul": 0, "addmm": 1}.get(base)
        if first is None or len(shapes) < first + 2:
            return None
        xs, ws = shapes[first], shapes[first + 1]
        if len(ws) != 2 or len(xs) < (1 if base in ("linear", "matmul") else 2):
            return None
        if base == "linear":
            n, k = ws
        else:
            k, n = ws
        if xs[-1] != k:
            return None
        return (math.prod(xs[:-1]), n, k), (node.inputs[first], node.inputs[first + 1])

    def gemms(self, node: Node, shapes: list | None) -> list[tuple[str, tuple[int, int, int], str, int | None]] | None:
        """``(role, (m, n, k), layout, tensor)`` of each GEMM of a matmul :meth:`gemm_shape` reads: the
        ``forward`` (tensor None), the ``input-grad`` and the ``weight-grad``, each with the tensor whose
        gradient it computes (module docstring, "Compute"); None for any other op."""
        gemm = self.gemm_shape(node, shapes)
        if gemm is None:
            return None
        (m, n, k), (x, w) = gemm
        fwd_layout, dx_layout = self.gemm_layouts(node)
        dw = (n, k, m) if fwd_layout == "nt" else (k, n, m)  # the weight's gradient, as the weight is stored
        return [("forward", (m, n, k), fwd_layout, None), ("input-grad", (m, k, n), dx_layout, x),
                ("weight-grad", dw, "tn", w)]  # fmt: skip

    def gemm_layouts(self, node: Node) -> tuple[str, str]:
        """(forward, input's gradient) layouts of a matmul :meth:`gemm_shape` reads (module docstring):
        ``("nt", "nn")`` for a weight stored ``[n, k]`` -- ``linear``'s, or one a transpose made --
        else ``("nn", "nt")``."""
        base = node.target.split(".", 1)[0]
        if base == "linear":
            return "nt", "nn"
        w = node.inputs[2 if base == "addmm" else 1]
        producer = self.graph.node(self.graph.tensors[w].producer)
        transposed = producer.op == "call" and producer.target.split(".", 1)[0] in ("t", "transpose", "permute")
        return ("nt", "nn") if transposed else ("nn", "nt")

    def attention_time(self, node: Node, shapes: list | None, dtype: str) -> tuple[float, float] | None:
        """(forward, backward) kernel seconds of attention ``node`` at its local ``shapes`` from the
        profile's measured table of ``dtype`` (module docstring, "Compute"), None where the profile
        has no table of that dtype and the node's variant (then it is priced by its FLOPs)."""
        table = self.profile.attention.get(dtype)
        if table is None or shapes is None:
            return None
        q, k = shapes[0], shapes[1]
        return table.time(node.variant or "dense", q[-1], q[-2], k[-2], math.prod(q[:-2]))

    def attention_blocks(self, node: Node) -> float:
        """How many times its FLOPs an attention kernel computes: it works on blocks of
        :data:`ATTENTION_BLOCK` queries and keys, so each sequence length counts rounded up to a
        whole block (module docstring, "Compute")."""
        q, k = (self.graph.tensors[t].shape for t in node.inputs[:2])
        return math.prod(math.ceil(n / ATTENTION_BLOCK) * ATTENTION_BLOCK / n for n in (q[-2], k[-2]) if n)

    def bias_grad(self, node: Node, sig: Signature) -> float:
        """Seconds of the bias gradient of a ``linear``/``addmm`` whose bias requires a gradient: the
        sum of the output gradient over its rows, one read of the output's local bytes plus a kernel
        (module docstring, "Compute"); 0 for any other node."""
        base = node.target.split(".", 1)[0]
        position = {"linear": 2, "addmm": 0}.get(base)
        if position is None or len(node.inputs) <= position or not node.outputs:
            return 0.0
        if not self.graph.tensors[node.inputs[position]].requires_grad or not self.profile.memory_bandwidth:
            return 0.0
        return self.grad_row_sum(self._local_bytes(node.outputs[0], sig.outputs[0]), node.outputs[0])

    def grad_row_sum(self, nbytes: float, tid: int) -> float:
        """Seconds of summing the gradient of tensor ``tid``, ``nbytes`` local bytes, over its rows (a
        bias's or a broadcast weight's gradient): one read at the memory bandwidth plus a kernel; in a
        compiled program the read at the profile's ``reduction_bandwidth`` for its dtype where measured,
        plus ``kernel_floor_graph`` for the kernel adding the partial sums (module docstring, "Compiled
        programs")."""
        rate = self.profile.memory_bandwidth
        seconds = self.profile.op_overhead
        if self.compiled:
            dtype = profile_dtype(tensor_dtype(self.graph, tid, self.precision))  # its storage: fp32, not tf32
            rate = self.profile.reduction_bandwidth.get(dtype, rate)
            seconds += self.profile.kernel_floor_graph
        return seconds + nbytes / rate

    def autocast_casts(self, node: Node, sig: Signature) -> tuple[float, float]:
        """(forward, backward) seconds of the casts autocast adds around a matmul under a low
        precision: each float32 parameter it reads (directly or through views) is cast to the low
        dtype in the forward (4 bytes read, 2 written per element) and its gradient cast back to
        float32 in the backward (2 read, 4 written), each a kernel of its own (module docstring,
        "Compute"); (0, 0) under fp32/tf32 and for any node that is not a matmul."""
        if self.precision not in LOW_PRECISIONS or kernel_kind(node.target) != "matmul":
            return 0.0, 0.0
        membw, o = self.profile.memory_bandwidth, self.profile.op_overhead
        fwd = bwd = 0.0
        for t, f in zip(node.inputs, sig.inputs):
            param = self._param_of.get(t)
            if param is None or self.graph.tensors[param].dtype != "float32":
                continue
            try:
                elements = math.prod(f.local_shape(self.graph.tensors[t].shape, self.mesh))
            except ValueError:
                return math.inf, math.inf
            moved = (4 + DTYPE_BYTES[LOW_PRECISIONS[self.precision]]) * elements / membw if membw else 0.0
            fwd += moved + o
            if self.graph.tensors[param].requires_grad:
                bwd += moved + o
        return fwd, bwd

    def _padded_matmul_outputs(self, graph: Graph) -> frozenset[int]:
        """Tensor ids of matmul outputs (and views of them keeping the innermost dim) whose rows
        inductor pads: an innermost dim of at least ``PAD_MIN_STRIDE`` elements whose bytes are not a
        multiple of ``PAD_ALIGN_BYTES`` (module docstring, "Compiled programs")."""
        padded: set[int] = set()
        for n in graph.nodes:
            if n.op != "call":
                continue
            kind = kernel_kind(n.target)
            for t in n.outputs:
                shape = graph.tensors[t].shape
                if kind is None and n.inputs and n.inputs[0] in padded:
                    if shape[-1:] == graph.tensors[n.inputs[0]].shape[-1:]:
                        padded.add(t)
                elif kind == "matmul" and shape and shape[-1] >= PAD_MIN_STRIDE:
                    itemsize = self.nbytes[t] / max(1, math.prod(shape))
                    if (shape[-1] * itemsize) % PAD_ALIGN_BYTES:
                        padded.add(t)
        return frozenset(padded)

    def padded_copies(self, tid: int, form: Form | Layout, op: str, share: float = 1.0) -> float:
        """Seconds of the copy a compiled program makes between a padded matmul output (see
        :meth:`_padded_matmul_outputs`) and a form-change op ``op`` on it: the conversion is a custom
        op that takes and gives dense tensors, so the padded rows are copied to a dense tensor of
        the local piece under ``form`` (forward) and its gradient back to padded rows (backward), for
        ``share`` of it (a duplicated copy's half: 0.5); 0 for any other tensor, op ``identity`` or an
        uncompiled program."""
        if tid not in self._padded or not op or op == "identity":
            return 0.0
        local = float(self.nbytes[tid]) * held_fraction(form, self.mesh) * share
        return self._copy(local, self.profile.memory_bandwidth)

    @staticmethod
    def _params_through_views(graph: Graph) -> dict[int, int]:
        """tensor id -> the parameter it is (or a view of, through ``view`` nodes only)."""
        param_of = {t: t for t, tensor in graph.tensors.items() if tensor.is_param}
        for n in graph.nodes:
            if n.op == "call" and fusion_kind(n.target) == "view" and n.inputs and n.inputs[0] in param_of:
                for t in n.outputs:
                    param_of[t] = param_of[n.inputs[0]]
        return param_of

    def compute_half(self, node: Node, sig: Signature) -> tuple[float, float] | None:
        """(forward, backward) seconds of one duplicated copy of ``node`` under ``sig``, measured at the
        half-batch shapes of ``graph.half``; None when there is no half-batch graph, the node or the
        signature is not in it, or either batch size was not measured (the caller then halves)."""
        half = self.graph.half
        if half is None or node.op != "call" or not self.profile.ops:
            return None
        try:
            hnode = half.node(node.name)
        except KeyError:
            return None
        if hnode.target != node.target or len(hnode.inputs) != len(node.inputs):
            return None
        hsig = self._half_sigs.get(node.name)
        if hsig is None:
            hsig = self._half_sigs[node.name] = {(s.inputs, s.outputs): s for s in hnode.signatures}
        match = hsig.get((sig.inputs, sig.outputs))
        if match is None or self.measured(self.graph, node, sig) is None:
            return None
        return self.measured(half, hnode, match)

    def copy_compute(
        self, node: Node, sig: Signature, device: tuple[float, float] | None = None, batch: bool | None = None
    ) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` under ``sig`` in one duplicated copy inside the
        distributed program: :meth:`copy_device_compute` corrected (:meth:`corrected`)."""
        return self.corrected(self.copy_device_compute(node, sig, device, batch), duplicated=True)

    def copy_device_compute(
        self, node: Node, sig: Signature, device: tuple[float, float] | None = None, batch: bool | None = None
    ) -> tuple[float, float]:
        """(forward, backward) physical seconds of ``node`` under ``sig`` in one duplicated copy
        (module docstring, "Duplication"): :meth:`compute_half` for a batch-dependent node, else half
        of its whole-batch time above the fixed per-op cost and autocast's casts of its parameters
        (:meth:`autocast_casts`, which each copy makes whole); the whole of it for a node on weights
        only.  ``device`` is this node's :meth:`device_compute` when the caller has it."""
        if node.op != "call":
            return 0.0, 0.0
        cf, cb = device if device is not None else self.device_compute(node, sig)
        if batch if batch is not None else self.node_is_batch(node):
            castf, castb = self.autocast_casts(node, sig)
            half = self.compute_half(node, sig)
            if half is not None:  # measured without the dispatcher's communication: add its half
                mf, mb = self.dispatch_comm(self._twin[node.name], sig)
                half = (half[0] + mf / 2, half[1] + mb / 2)
            else:
                of, ob = self.fixed(node)
                half = ((cf - castf - of) / 2 + of, (cb - castb - ob) / 2 + ob)
            cf, cb = half[0] + castf, half[1] + castb
        return cf, cb

    def fixed(self, node: Node) -> tuple[float, float]:
        """(forward, backward) seconds of ``node`` that do not depend on the batch size (launch and
        dispatch overhead), paid by each duplicated copy in full."""
        if node.op != "call":
            return 0.0, 0.0
        o = self.profile.op_overhead
        if self.compiled:
            kind, _, writes = self._fusion[node.name]
            if kind == "view" or (kind == "fused" and not writes):
                return 0.0, 0.0
        return o, (2.0 * o if self.requires_backward(node) else 0.0)

    def group(self, axis: int | None = None) -> tuple[int, str]:
        """(ranks, link level) of the group a collective runs over: mesh axis ``axis``, or the whole
        world (``None``).  An axis of size ``n`` whose members are ``stride`` ranks apart (the product of
        the sizes of the axes after it) runs at the profile's :meth:`~hidup.profiler.Profile.group_level`."""
        if axis is None:
            n, stride = self.world, 1
        else:
            n, stride = self.mesh[axis], math.prod(self.mesh[axis + 1 :])
        return n, self.profile.group_level(stride, n, self.world)

    def comm(self, collective: str, nbytes: float, axis: int | None = None) -> float:
        """Seconds of one collective over the whole world (or mesh axis ``axis``'s group) on a logical
        buffer of ``nbytes``."""
        if not collective:
            return 0.0
        n, level = self.group(axis)
        return self.comm_profile.comm_time(collective, n, nbytes, level=level)

    def grad_sync(self, nbytes: float, axis: int | None = None, share: float = 1.0) -> float:
        """Seconds of a replicated parameter's gradient all-reduce of ``nbytes``: its share of one
        bucket's all-reduce, the bucket's bytes sent at ``share`` of them (module docstring; a bf16
        reduction: :meth:`reduce_share`)."""
        bucket = max(float(nbytes), self.bucket_bytes)
        return self.comm("all_reduce", bucket * share, axis) * float(nbytes) / bucket

    def bucket_share(self, collective: str, nbytes: float, share: float = 1.0) -> float:
        """Seconds of ``nbytes``' share of one gradient bucket's ``collective`` over the world, the
        bucket's bytes sent at ``share`` of them."""
        bucket = max(float(nbytes), self.bucket_bytes)
        return self.comm(collective, bucket * share) * float(nbytes) / bucket

    def zero_gather(self, tid: int, form) -> float:
        """Seconds of all-gathering the updated rows of parameter ``tid`` stored in ``form`` after the
        optimizer step: ``A(b)`` where ZeRO splits it, else 0 (module docstring, "ZeRO")."""
        if not zero_stage(self.graph, self.zero, tid, form):
            return 0.0
        return self.zero_share("all_gather", float(self.nbytes[tid]))

    def zero_share(self, collective: str, nbytes: float, share: float = 1.0) -> float:
        """Seconds of a split parameter's ``nbytes`` in a bucket's coalesced ``collective`` (sent at
        ``share`` of its bytes), a small one a tensor of its own in it (module docstring, "ZeRO")."""
        own = self.profile.grad_copy_fixed() if nbytes < GRAD_PACK_BYTES else 0.0
        return self.bucket_share(collective, nbytes, share) + own

    def reduce_share(self, tid: int, collective: str) -> float:
        """The share of its float32 bytes that a backward ``collective`` of tensor ``tid``'s gradient
        sends: bfloat16's half for a sum over ranks of a float32 parameter's gradient under
        ``reduce_dtype="bf16"`` (module docstring, "Gradients reduced in bf16"), else 1."""
        if tid in self._reduce and collective in ("all_reduce", "reduce_scatter"):
            return self._reduce_share
        return 1.0

    def reduce_casts(self, nbytes: float, received: float, arrives_low: bool) -> float:
        """Seconds of the casts around a gradient reduction in bfloat16 of ``nbytes`` float32 bytes of
        which the rank receives ``received``: to bfloat16 before it (none when the gradient
        ``arrives_low``), back to float32 after it (module docstring, "Gradients reduced in bf16")."""
        membw = self.profile.memory_bandwidth
        if membw <= 0:
            return 0.0
        down = 0.0 if arrives_low else self._copy(0.75 * nbytes, membw)
        return down + self._copy(0.75 * received, membw)

    def pair_speedup(self, collective: str, nbytes: float, axis: int | None = None) -> float:
        """How much faster two copies' equal collectives go together than one after the other
        (the profile's measured ``concurrency``; 1 where unmeasured)."""
        if not collective:
            return 1.0
        n, level = self.group(axis)
        return self.profile.pair_speedup(collective, n, nbytes, level=level)

    def _copy(self, nbytes: float, rate: float, passes: float = 2.0) -> float:
        """Seconds of one copy kernel moving ``nbytes`` (read and written: ``passes=2``; written
        only: 1) at ``rate`` bytes/s, plus the fixed per-op cost."""
        moved = passes * nbytes / rate if rate > 0 else 0.0
        return self.profile.op_overhead + moved

    def local_copies(
        self, op: str, frm: Form, to: Form, shape: tuple, nbytes: float, n: int | None = None, share: float = 1.0
    ) -> float:
        """Seconds of the memory copies form-change op ``op`` (:data:`hidup.ir.FORM_CHANGE_OPS`)
        makes on the compute stream turning ``share`` of a tensor of global ``shape`` and ``nbytes``
        (a duplicated copy's half: 0.5) from form ``frm`` into ``to`` over ``n`` ranks (default the
        world) (module docstring, "Memory copies around a form change")."""
        if not op:
            return 0.0
        model = _COPY_MODELS.get(op)
        if model is None:
            raise ValueError(f"no copy model for conversion op {op!r}")
        n = self.world if n is None else n
        membw = self.profile.memory_bandwidth
        itemsize = nbytes / max(1, math.prod(shape))

        def layout(dim: int) -> float:  # the rate of a copy moving `dim` to or from the front
            return self.profile.transpose_rate(itemsize) if dim == len(shape) - 1 else self.profile.layout_rate()

        def moved(form: Form, dim: int) -> bool:  # the dims before `dim` of the local tensor are not all 1
            local = form.local_shape(shape, n)
            return dim > 0 and math.prod(local[:dim]) > 1

        return model(self._copy, moved, frm, to, nbytes * share, nbytes * share / n, membw, layout)

    def grad_copies(self, nbytes: float) -> float:
        """Seconds of packing a replicated parameter's gradient of ``nbytes`` into its bucket's flat
        buffer; 0 for one summed in place (module docstring)."""
        if nbytes >= GRAD_PACK_BYTES:
            return 0.0
        membw = self.profile.memory_bandwidth
        return self.profile.grad_copy_fixed() + (2.0 * nbytes / membw if membw > 0 else 0.0)

    def conversion_class(self, tid: int) -> tuple:
        """What :meth:`conversion` reads of tensor ``tid``: tensors of one class convert alike."""
        t: Tensor = self.graph.tensors[tid]
        return (
            t.shape,
            self.nbytes[tid],
            t.requires_grad,
            self.batch.get(tid, False),
            tid in self._padded,
            self.wire_share(tid),
            zero_stage(self.graph, self.zero, tid, REPLICATE),
            tid in self._reduce,
        )

    def wire_share(self, tid: int) -> float:
        """The fraction of its bytes tensor ``tid`` sends forward: autocast's low dtype over float32 for a
        parameter whose every use casts it (:mod:`hidup.precision`: its slices are cast before they
        travel; its gradient travels in float32), 1 for anything else."""
        return self._wire_share if tid in self._wire else 1.0

    def conversion(self, tid: int, src: Form, dst: Form) -> ConvCost | None:
        """Cost of turning tensor ``tid`` from ``src`` into ``dst``; None when impossible."""
        hit = self._conv_by_tensor.get((tid, src, dst), self._conv_by_tensor)
        if hit is not self._conv_by_tensor:
            return hit
        t: Tensor = self.graph.tensors[tid]
        batch = self.batch.get(tid, False)
        key = self.conversion_class(tid) + (src, dst)
        if key in self._conv_cache:
            self._conv_by_tensor[(tid, src, dst)] = self._conv_cache[key]
            return self._conv_cache[key]
        if isinstance(src, Layout):
            cost = self._cheapest_path(t, tid, batch, src, dst)
            self._conv_cache[key] = self._conv_by_tensor[(tid, src, dst)] = cost
            return cost
        conv = conversion(src, dst)
        if conv is None:
            cost = None
        else:
            cf, cb = conv.collectives
            if not t.requires_grad:
                cb = ""
            b = float(self.nbytes[tid])
            cast = self.wire_share(tid) if casts_on_wire([conv.forward]) else 1.0
            bf = b * cast  # what travels forward
            share = self.reduce_share(tid, cb)  # what travels backward, per float32 byte
            grad_sync = conv.grad_sync and t.requires_grad
            bwd_op = conv.backward_local if t.requires_grad else ""
            fwd = self.comm(cf, bf)
            pad = self.padded_copies(tid, src, conv.forward)
            lf = self.local_copies(conv.forward, src, dst, t.shape, bf) + pad
            lb = self.local_copies(bwd_op, dst, src, t.shape, b) + (pad if t.requires_grad else 0.0)
            zero2 = grad_sync and zero_stage(self.graph, self.zero, tid, src) == 2
            if zero2:  # reduce-scattered, never packed
                bwd = self.zero_share("reduce_scatter", b, share)
            elif grad_sync:  # bucketed and asynchronous, its packing and unpacking on the compute stream
                bwd = self.grad_sync(b, share=share)
                lb += self.grad_copies(b)
            else:
                bwd = self.comm(cb, b * share)
            if share != 1.0:  # to bfloat16 and back around the sum (module docstring)
                scattered = zero2 or cb == "reduce_scatter"
                lb += self.reduce_casts(b, b / self.world if scattered else b, cast != 1.0)
            if batch:
                pad_half = self.padded_copies(tid, src, conv.forward, share=0.5)
                fA = fB = self.comm(cf, b / 2) / self.pair_speedup(cf, b / 2)
                bA = bB = self.comm(cb, b * share / 2) / self.pair_speedup(cb, b * share / 2)
                lfA = lfB = self.local_copies(conv.forward, src, dst, t.shape, b, share=0.5) + pad_half
                lbA = lbB = self.local_copies(bwd_op, dst, src, t.shape, b, share=0.5) + (
                    pad_half if t.requires_grad else 0.0
                )
            elif grad_sync:  # each copy runs the local forward op; the gradient is summed once, after both
                fA, fB, bA, bB = fwd, fwd, bwd, 0.0
                lfA, lfB, lbA, lbB = lf, lf, lb, 0.0
            else:
                fA = fB = fwd / self.pair_speedup(cf, bf)
                bA = bB = bwd / self.pair_speedup(cb, b * share)
                lfA = lfB = lf
                lbA = lbB = lb
            cost = ConvCost(
                conv,
                fwd + lf,
                bwd + lb,
                fA,
                fB,
                bA,
                bB,
                grad_sync,
                lf,
                lb,
                lfA,
                lfB,
                lbA,
                lbB,
                bwd if grad_sync else 0.0,
                0.0 if grad_sync else bwd,
            )
        self._conv_cache[key] = self._conv_by_tensor[(tid, src, dst)] = cost
        return cost

    def step_bytes(self, tid: int, before: Layout, axis: int) -> float:
        """Logical bytes of a one-axis step on mesh axis ``axis`` from layout ``before``: tensor
        ``tid`` as the other axes hold it (the nccl-tests size of that axis's collective)."""
        return float(self.nbytes[tid]) * held_fraction(before.with_axis(axis, FULL), self.mesh)

    def _cheapest_path(self, t: Tensor, tid: int, batch: bool, src: Layout, dst: Layout) -> ConvCost | None:
        """The cheapest (forward + backward, no duplication) of :func:`hidup.ir.layout_conversions`,
        each step priced as a one-axis form change over its axis's group (module docstring, "Meshes")."""
        paths = self._paths.get((src, dst))
        if paths is None:
            paths = self._paths[(src, dst)] = layout_conversions(src, dst)
        best = None
        for path in paths:
            cost = self._path_cost(t, tid, batch, path)
            if best is None or cost.fwd + cost.bwd < best.fwd + best.bwd:
                best = cost
        return best

    def _path_cost(self, t: Tensor, tid: int, batch: bool, path: MeshConversion) -> ConvCost:
        tot = dict.fromkeys(
            ("fwd", "bwd", "fA", "fB", "bA", "bB", "lf", "lb", "lfA", "lfB", "lbA", "lbB", "async", "block"), 0.0
        )
        cls = self.conversion_class(tid)
        # a parameter's slices travel in the low dtype where the layout change runs one collective
        wire = self.wire_share(tid) if casts_on_wire(s.conv.forward for s in path.steps) else 1.0
        for step in path.steps:
            key = (cls, step.axis, step.before, step.after.forms[step.axis], wire)
            parts = self._steps.get(key)
            if parts is None:
                parts = self._steps[key] = self._step_cost(t, tid, batch, step, wire)
            for name, v in parts:
                tot[name] += v
        grad = t.requires_grad
        if path.steps:  # the first step's custom op takes the padded rows (one copy per layout change)
            first = path.steps[0].conv.forward
            pad = self.padded_copies(tid, path.src, first)
            half = self.padded_copies(tid, path.src, first, share=0.5) if batch else pad
            for name, v in (("lf", pad), ("lb", pad), ("lfA", half), ("lfB", half), ("lbA", half), ("lbB", half)):
                tot[name] += v if name.startswith("lf") or grad else 0.0
        return ConvCost(
            path,
            tot["fwd"] + tot["lf"],
            tot["bwd"] + tot["lb"],
            tot["fA"],
            tot["fB"],
            tot["bA"],
            tot["bB"],
            path.grad_sync and grad,
            tot["lf"],
            tot["lb"],
            tot["lfA"],
            tot["lfB"],
            tot["lbA"],
            tot["lbB"],
            tot["async"],
            tot["block"],
        )

    def _step_cost(self, t: Tensor, tid: int, batch: bool, step, wire: float = 1.0) -> tuple[tuple[str, float], ...]:
        """The (part, seconds) of one one-axis step of a layout change of tensor ``tid``, in the order
        :meth:`_path_cost` adds them up (kept per conversion class and step: paths share steps);
        ``wire`` the share of the bytes that travel forward (:meth:`wire_share`)."""
        grad = t.requires_grad
        conv, k = step.conv, step.axis
        n = self.mesh[k]
        b = self.step_bytes(tid, step.before, k)
        shape = step.before.with_axis(k, FULL).local_shape(t.shape, self.mesh)
        frm, to = step.before.forms[k], step.after.forms[k]
        cf, cb = conv.collectives
        cb = cb if grad else ""
        sync = conv.grad_sync and grad
        bwd_op = conv.backward_local if grad else ""
        bf = b * (wire if cf else 1.0)
        share = self.reduce_share(tid, cb)  # a float32 parameter's gradient summed in bf16 (module docstring)
        fwd = self.comm(cf, bf, k)
        lf = self.local_copies(conv.forward, frm, to, shape, bf, n)
        lb = self.local_copies(bwd_op, to, frm, shape, b, n)
        if sync:
            bwd = self.grad_sync(b, k, share)
            lb += self.grad_copies(b)
        else:
            bwd = self.comm(cb, b * share, k)
        if share != 1.0:
            lb += self.reduce_casts(b, b if sync or cb == "all_reduce" else b / n, wire != 1.0 and bool(cf))
        if batch:
            fA = self.comm(cf, b / 2, k) / self.pair_speedup(cf, b / 2, k)
            bA = self.comm(cb, b * share / 2, k) / self.pair_speedup(cb, b * share / 2, k)
            parts = (fA, fA, bA, bA)
            lfA = self.local_copies(conv.forward, frm, to, shape, b, n, share=0.5)
            lbA = self.local_copies(bwd_op, to, frm, shape, b, n, share=0.5)
            copies = (lfA, lfA, lbA, lbA)
        elif sync:
            parts, copies = (fwd, fwd, bwd, 0.0), (lf, lf, lb, 0.0)
        else:
            fA, bA = fwd / self.pair_speedup(cf, bf, k), bwd / self.pair_speedup(cb, b * share, k)
            parts, copies = (fA, fA, bA, bA), (lf, lf, lb, lb)
        return tuple(zip(("fwd", "bwd", "lf", "lb", "async" if sync else "block"), (fwd, bwd, lf, lb, bwd))) + tuple(
            zip(("fA", "fB", "bA", "bB", "lfA", "lfB", "lbA", "lbB"), parts + copies)
        )
