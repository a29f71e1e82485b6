"""GShard-style Mixture-of-Experts with per-group capacity.

A *group* is one sequence (or one image): routing, capacity and the load-balancing loss are
computed inside each group only, so the MoE output for one group never depends on another.  Hence
splitting the batch across ranks, or into two half-batches, gives exactly the same numbers.

Gating (``moe_gating``), for logits ``x[g,s,e]`` with ``E`` experts, top-``k``, capacity ``C``:

* ``p[g,s,e] = softmax_e(x[g,s,e])`` (computed in float32).
* choice ``i = 1..k``: ``e_i(g,s) = argmax_e`` of ``p`` with the earlier choices removed; the 0/1
  mask ``m_i[g,s,e] = [e = e_i(g,s)]``; the gate ``w_i(g,s) = p[g,s,e_i]``, normalized over the
  chosen experts ``w_i / sum_j w_j`` when ``k > 1`` (GShard).  For ``k = 1`` the raw probability is
  kept (Switch Transformer): normalizing would make every gate 1 and cut the router off from the
  task loss.
* positions in the expert's queue, first choices before second choices (GShard order):
  ``pos_i[g,s,e] = (cumsum_s m_i[g,s,e] - 1 + sum_{j<i} sum_s keep_j[g,s,e]) * m_i[g,s,e]``,
  ``keep_i = m_i * [pos_i < C]``: tokens past capacity are dropped (zero combine weight).
* ``dispatch[g,s,e,c] = keep[g,s,e] * [pos[g,s,e] = c]`` summed over choices (0/1),
  ``combine[g,s,e,c] = sum_i w_i(g,s) * dispatch_i[g,s,e,c]``.
* load-balancing loss per group ``aux[g] = E * sum_e mean_s(m_1[g,s,e]) * mean_s(p[g,s,e])``
  (``m_1`` is the first choice before capacity; its value is 1 for a uniform router).

Experts (``MoEFFN``) hold stacked parameters ``w1[E,D,F], b1[E,F], w2[E,F,D], b2[E,D]``:
``xe = einsum(gsec,gsd->egcd, dispatch, x)``; ``h = gelu(einsum(egcd,edf->egcf, xe, w1) + b1)``;
``ye = einsum(egcf,efd->egcd, h, w2) + b2``; ``y = einsum(gsec,egcd->gsd, combine, ye)``.
With ``E`` sharded the dispatch einsum's output change from batch-sharded to expert-sharded is the
all-to-all of expert parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import hidup.rules as rules


def moe_gating(logits: torch.Tensor, k: int, capacity: int, normalize: bool | None = None):
    """Route each token of each group to its top-``k`` experts (see the module docstring).

    ``logits[G,S,E]`` -> ``(combine[G,S,E,C], dispatch[G,S,E,C], aux[G])``, all in
    ``logits.dtype``.  ``normalize`` (default ``k > 1``) normalizes the gates over the chosen
    experts.  The work is the custom op ``torch.ops.hidup.moe_gating`` (one node of an exported
    graph, with a fake implementation for meta and fake tensors and its own autograd); this
    function checks the arguments first."""
    if logits.dim() != 3:
        raise ValueError(
            f"moe_gating: logits must be [groups, tokens, experts], got a "
            f"{logits.dim()}-d tensor of shape {tuple(logits.shape)}"
        )
    num_experts = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"moe_gating: k={k!r} must be an int in [1, {num_experts}] (the number of experts)")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"moe_gating: capacity={capacity!r} must be an int >= 1")
    return tuple(_gating_op(logits, k, capacity, bool(k > 1 if normalize is None else normalize)))


def _gating(logits: torch.Tensor, k: int, capacity: int, normalize: bool):
    """The routing math of the module docstring, differentiable in ``logits`` through ``probs``."""
    num_experts = logits.shape[-1]
    out_dtype = logits.dtype
    device = logits.device
    probs = torch.softmax(logits.float(), dim=-1)  # [G,S,E]
    experts = torch.arange(num_experts, device=device)
    slots = torch.arange(capacity, device=device, dtype=torch.float32)

    remaining = probs.detach()
    masks, gates = [], []
    for _ in range(k):
        choice = remaining.argmax(dim=-1, keepdim=True)  # [G,S,1]; ties -> lowest index
        mask = (choice == experts).to(torch.float32)  # [G,S,E]
        masks.append(mask)
        gates.append((probs * mask).sum(dim=-1))  # [G,S]
        remaining = remaining.masked_fill(mask.bool(), -1.0)
    if normalize:
        denom = torch.stack(gates, dim=0).sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
        gates = [g / denom for g in gates]

    combine = dispatch = None
    taken = torch.zeros_like(masks[0][:, :1, :])  # [G,1,E] slots used by earlier choices
    for mask, gate in zip(masks, gates):
        pos = (torch.cumsum(mask, dim=1) - 1.0 + taken) * mask  # [G,S,E]
        keep = mask * (pos < capacity).to(torch.float32)
        taken = taken + keep.sum(dim=1, keepdim=True)
        token_pos = (pos * keep).sum(dim=-1, keepdim=True)  # [G,S,1]
        slot = (token_pos == slots).to(torch.float32)  # [G,S,C]
        d = keep.unsqueeze(-1) * slot.unsqueeze(2)  # [G,S,E,C]
        c = gate.unsqueeze(-1).unsqueeze(-1) * d
        dispatch = d if dispatch is None else dispatch + d
        combine = c if combine is None else combine + c

    aux = num_experts * (masks[0].mean(dim=1) * probs.mean(dim=1)).sum(dim=-1)  # [G]
    return combine.to(out_dtype), dispatch.to(out_dtype), aux.to(out_dtype)


# ``hidup::moe_gating``: the routing as one opaque op.  Its output shapes depend only on the input
# shape and the two ints, so the fake implementation runs on meta and fake tensors; the gradient of
# ``logits`` is the autograd of ``_gating`` itself (re-run under autograd in the backward), so forward
# and backward are the ops of the plain function, bit for bit.


@torch.library.custom_op("hidup::moe_gating", mutates_args=())
def _gating_op(
    logits: torch.Tensor, k: int, capacity: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return _gating(logits, k, capacity, normalize)


@_gating_op.register_fake
def _(logits, k, capacity, normalize):
    G, S, E = logits.shape
    return (logits.new_empty(G, S, E, capacity), logits.new_empty(G, S, E, capacity), logits.new_empty(G))


def _setup_context(ctx, inputs, output) -> None:
    logits, ctx.k, ctx.capacity, ctx.normalize = inputs
    ctx.save_for_backward(logits)


def _backward(ctx, grad_combine, grad_dispatch, grad_aux):
    (logits,) = ctx.saved_tensors
    with torch.enable_grad():
        x = logits.detach().requires_grad_(True)
        combine, _, aux = _gating(x, ctx.k, ctx.capacity, ctx.normalize)  # dispatch is constant (0/1)
        pairs = [(o, g) for o, g in ((combine, grad_combine), (aux, grad_aux)) if g is not None]
        (grad,) = torch.autograd.grad([o for o, _ in pairs], [x], [g for _, g in pairs], allow_unused=True)
    return (grad if grad is not None else torch.zeros_like(logits)), None, None, None


_gating_op.register_autograd(_backward, setup_context=_setup_context)


def _declare_gating_rule() -> None:
    """``hidup::moe_gating`` treats groups independently: sharded along the group dim 0."""
    rules.declare_batch_op(torch.ops.hidup.moe_gating.default)


_declare_gating_rule()


class MoEFFN(nn.Module):
    """Top-``k`` MoE feed-forward layer over groups ``x[G,S,D]``.

    Returns ``(y[G,S,D], aux[G])``.  ``capacity`` is the per-group expert capacity (an int from the
    config), so the module never reads a tensor shape."""

    def __init__(self, d_model: int, ffn: int, num_experts: int, k: int, capacity: int):
        super().__init__()
        self.d_model, self.ffn, self.num_experts = d_model, ffn, num_experts
        self.k, self.capacity = k, capacity
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, ffn))
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, d_model))
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert is initialized like an ``nn.Linear``: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for w, b, fan_in in ((self.w1, self.b1, self.d_model), (self.w2, self.b2, self.ffn)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def forward(self, x: torch.Tensor):
        E, F_, D = self.num_experts, self.ffn, self.d_model
        gating = moe_gating(self.router(x), self.k, self.capacity)
        combine, dispatch, aux = gating[0], gating[1], gating[2]
        xe = torch.einsum("gsec,gsd->egcd", dispatch, x)
        h = torch.einsum("egcd,edf->egcf", xe, self.w1) + self.b1.view(E, 1, 1, F_)
        h = F.gelu(h)
        ye = torch.einsum("egcf,efd->egcd", h, self.w2) + self.b2.view(E, 1, 1, D)
        y = torch.einsum("gsec,egcd->gsd", combine, ye)
        return y, aux

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, ffn={self.ffn}, experts={self.num_experts}, "
            f"top_k={self.k}, capacity={self.capacity}"
        )
