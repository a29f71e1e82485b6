"""All-to-all token dispatch of the routed experts: each (token, slot) pair travels to its expert's rank only.

The expert-parallel signature ``all_to_all`` of :mod:`hidup.rules.experts` keeps the tokens split
(``x, top_k_index, top_k_weights gather_0``) and the experts split (``gate_up_proj, down_proj
gather_0``, rank ``r`` of ``N`` holding experts ``[r E_l, (r+1) E_l)``, ``E_l = E / N``), and its
output split like the tokens (``y gather_0``).  Rank ``r`` with ``T_r`` tokens runs, for the
``S_r = T_r k`` pairs ``p = t k + j`` with global expert ``e_p = top_k_index[t, j]``:

1. **dispatch**: owner ``o_p = floor(e_p / E_l)``; the pairs sorted by ``e_p`` (stable: by owner, then
   by expert); ``send[q] = #{p : o_p = q}``; one all-to-all of the counts gives ``recv[q]``, the pairs
   rank ``q`` sends here; the rows ``x[t_p]`` (in the compute dtype, autocast's, as the GEMMs read
   them) and the local expert ids ``e_p - o_p E_l`` travel by one ``all_to_all_single`` with those
   split sizes.
2. **experts**: the ``R_r = sum_q recv[q]`` received rows run through their expert (two grouped
   GEMMs after an on-device sort by local expert, :func:`hidup.rules.grouped.route`); every row is
   valid, so no row is padded or masked.
3. **combine**: the outputs travel back by the reverse all-to-all (split sizes swapped) into pair
   order, are scaled by their routing weight and each token sums its ``k`` slots:
   ``y[t] = sum_j w[t, j] * expert_{e_p}(x[t])``, the math of the all-gather dispatcher and of the
   single device, exactly (the same products in the same order of each token's sum).

Autograd: each exchange is an autograd function whose backward is the exchange with the split sizes
swapped, so the gradients of ``x`` and ``w`` come back to the tokens' rank (exact for its slice,
``gather_0``), and the expert weights' gradients stay on their owner (exact for its slice).

Shapes, synchronization and capture: ``R_r`` depends on the routing, so the received sizes are
known only after the count exchange: one device-to-host copy (``.tolist()``) per MoE layer and
forward, reused by the backward.  The function is therefore opaque to ``torch.compile`` (a graph
break, :func:`torch.compiler.disable`: the rest of the step compiles around it) and a step that runs
it is not captured as one CUDA graph.  This is what Megatron-LM's and torchtitan's dropless
all-to-all dispatchers do; in exchange every rank sends and receives ``S_r`` rows, about ``k / N`` of
the all-gather dispatcher's ``(N-1) T_r`` (a quarter for top-2 of 8 ranks), and computes no padded
row.  Routing balance is the price's assumption (:mod:`hidup.search.experts_cost`); any routing is exact.

The process group: a rank program does not hold process groups (:mod:`hidup.codegen.mesh`); the
local call names its mesh axis (``mesh_axis``, None on a one-axis plan) and the code generator
installs the resolver (:func:`use_group_resolver`) that maps it to this rank's group at run time.
With no resolver or no group (one process, one rank) the function is the single-rank op: every
pair local.  A stand-in group (an object with ``size`` and ``exchange_rows(t, send, recv)``, as the
simulated-SPMD tests run ranks as threads of one process) takes the place of a process group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from hidup.rules.grouped import ACTIVATIONS, compute_dtype, grouped_mm, inverse_permutation, route

__all__ = [
    "routed_experts_all_to_all",
    "exchange_rows",
    "expert_rows",
    "use_group_resolver",
    "group_resolver",
    "host_synchronizes",
    "dispatch_axis",
    "NO_GROUP",
    "DISPATCHERS",
]

# the expert-parallel signatures' per-rank implementations (Signature.impl), one per token dispatcher
DISPATCHERS = {"local_experts": "all-gather", "all_to_all": "all-to-all"}

NO_GROUP = object()  # what a resolver answers where no rank program runs: the call is one rank's

_RESOLVER: list[Callable[[int | None], object] | None] = [None]


def use_group_resolver(resolver: Callable[[int | None], object] | None) -> None:
    """Install ``resolver(mesh_axis) -> process group`` (``mesh_axis`` None: the program's group on a
    one-axis plan; the group None: the default group; :data:`NO_GROUP`: no group, one rank)."""
    _RESOLVER[0] = resolver


def dispatch_axis(sig) -> int | None:
    """The index of the factor of ``sig`` that dispatches tokens by all-to-all (0 for a one-axis
    signature, the mesh axis on a mesh), None where no factor does."""
    factors = sig.axes or (sig,)
    return next((k for k, f in enumerate(factors) if f.impl == "all_to_all" and f.kind == "expert"), None)


def host_synchronizes(sig) -> bool:
    """Whether a node under ``sig`` reads split sizes on the host (:func:`dispatch_axis`), so that a
    step running it cannot be captured as one CUDA graph."""
    return dispatch_axis(sig) is not None


def group_resolver() -> Callable[[int | None], object] | None:
    """The resolver installed now (to put back after installing another for a while)."""
    return _RESOLVER[0]


def _group_of(mesh_axis: int | None):
    resolver = _RESOLVER[0]
    return resolver(mesh_axis) if resolver is not None else NO_GROUP


def _world(group) -> int:
    if hasattr(group, "exchange_rows"):  # a stand-in group (module docstring)
        return group.size
    if group is NO_GROUP or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _symbolic(t: Tensor) -> bool:
    """A tensor without values (meta, or fake as in a memory record): split sizes cannot be read."""
    return t.device.type == "meta" or isinstance(t, FakeTensor)


def _balanced(pairs: int, world: int) -> list[int]:
    """``pairs`` spread evenly over ``world`` ranks: the split sizes a run without values assumes."""
    return [pairs // world + (q < pairs % world) for q in range(world)]


def _is_fake(group) -> bool:
    """torch's fake process group (one device standing in for a rank): it writes no received data."""
    try:
        return dist.get_backend(group) == "fake"
    except (RuntimeError, ValueError):
        return False


def _exchange(t: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    """``all_to_all_single`` of the rows of ``t``: ``send[q]`` rows to rank ``q``, ``recv[q]`` from it."""
    t = t.contiguous()
    if hasattr(group, "exchange_rows"):
        return group.exchange_rows(t, send, recv)
    if _is_fake(group):  # nothing is received: keep plausible values (the fake counts make recv == send)
        return t.clone()
    out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t, recv, send, group=group)
    return out


class _ExchangeRows(torch.autograd.Function):
    """:func:`_exchange` whose backward sends the gradient rows back (split sizes swapped)."""

    @staticmethod
    def forward(ctx, rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_rows(rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    """The rows of ``rows`` exchanged by ``send`` / ``recv`` counts, differentiably."""
    return _ExchangeRows.apply(rows, send, recv, group)


def expert_rows(rows: Tensor, expert: Tensor, gate_up_proj: Tensor, down_proj: Tensor, act: str) -> Tensor:
    """``out[i] = expert_{expert[i]}(rows[i])`` for local expert ids ``expert`` in ``[0, E_l)``, in
    ``rows``' dtype: sorted by expert on the device, two grouped GEMMs, back in row order."""
    r = route(expert.unsqueeze(1), 0, gate_up_proj.shape[0])
    xs = rows[r.token]
    gate, up = grouped_mm(xs, gate_up_proj.to(rows.dtype).transpose(-2, -1), r.offsets).chunk(2, dim=-1)
    h = grouped_mm(ACTIVATIONS[act](gate) * up, down_proj.to(rows.dtype).transpose(-2, -1), r.offsets)
    return h[r.inverse]


@torch._disable_dynamo  # torch.compiler.disable, importing torch._dynamo (about a second) at the first call only
def routed_experts_all_to_all(
    x: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act: str,
    mesh_axis: int | None = None,
) -> Tensor:
    """This rank's tokens through the experts of every rank (module docstring), ``y`` like ``x``."""
    group = _group_of(mesh_axis)
    world = _world(group)
    tokens, k = top_k_index.shape
    local = gate_up_proj.shape[0]
    dtype = compute_dtype(x, gate_up_proj, down_proj)
    flat = top_k_index.reshape(-1)
    key, order = torch.sort(flat, stable=True)
    owner = torch.div(key, local, rounding_mode="floor")
    rows = x[torch.div(order, k, rounding_mode="floor")].to(dtype)
    expert = key - owner * local
    if world > 1 and _symbolic(flat):
        send = recv = _balanced(flat.numel(), world)
    elif world > 1:
        counts = torch.bincount(owner, minlength=world)
        both = torch.stack([counts, _exchange(counts, [1] * world, [1] * world, group)])
        send, recv = both.tolist()  # the one host synchronization
    if world > 1:
        rows = exchange_rows(rows, send, recv, group)
        expert = _exchange(expert, send, recv, group)
    out = expert_rows(rows, expert, gate_up_proj, down_proj, act)
    if world > 1:
        out = exchange_rows(out, recv, send, group)
    weighted = out[inverse_permutation(order)] * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, k, -1).sum(dim=1).to(x.dtype)
