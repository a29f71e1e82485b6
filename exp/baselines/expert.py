"""Hand-written expert parallelism (DeepSpeed-MoE style) for the zoo's MoE models.

With ``N`` ranks and ``E = N * E_l`` experts, rank ``r`` keeps experts ``r E_l .. (r+1) E_l - 1``
(the slices ``w1[rE_l:(r+1)E_l]`` etc. of the stacked ``[E, ...]`` parameters) and every other
parameter whole.  Each rank runs its own ``g`` groups (sequences/images) of the batch:

    combine, dispatch = gating(router(x))                  [g,S,E,C]    local, full E
    xe  = einsum(gsec,gsd->egcd, dispatch, x)              [E,g,C,D]    rows of expert e
    xe' = all_to_all(xe)  viewed [N,E_l,g,C,D] -> [E_l,N g,C,D]   (my experts, every rank's groups)
    ye' = expert FFN of my E_l experts on xe'              [E_l,N g,C,D]
    ye  = all_to_all([N,E_l,g,C,D] view of ye')  -> [E,g,C,D]     (every expert, my groups)
    y   = einsum(gsec,egcd->gsd, combine, ye)              [g,S,D]

``all_to_all`` sends chunk ``j`` of dim 0 to rank ``j`` and stores what rank ``i`` sent as chunk
``i``; it is linear and its adjoint is the same exchange, so its backward is ``all_to_all`` of the
output gradient.  Gradients: an expert's gradient is summed over every rank's tokens by the
backward all-to-alls (exact); the dense parameters (attention, norms, router, embeddings) are
replicated and their gradients summed with bucketed all-reduces that overlap the backward
(hidup.codegen.GradBucketer, as DDP and DeepSpeed do).  Routing is per group, so with the
rank weights ``w_r`` of baseline_util (1 for the zoo's summed loss) ``sum_r w_r loss_r`` equals the
single-device loss of the whole batch, and the summed gradients of ``w_r loss_r`` equal its gradients.

``compile`` compiles the whole converted model (TorchDynamo traces the all-to-alls or breaks the
graph around them); the gradient buckets' hooks run after each gradient is accumulated, outside the
compiled backward, exactly as in eager mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from exp.baselines.baseline_util import BUCKET_BYTES, EAGER, Options, Prepared, compile_module
from hidup.codegen import GradBucketer
from hidup.models import MoEFFN, moe_gating


class _AllToAll(torch.autograd.Function):
    """``out[i] = x_from_rank_i[me]`` over dim-0 chunks; the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """Autograd-aware all-to-all over equal chunks of dim 0 (one chunk per rank)."""
    return _AllToAll.apply(x, group)


class ExpertParallelMoE(nn.Module):
    """The local-experts replacement of one :class:`hidup.models.MoEFFN` (see the module docstring)."""

    def __init__(self, moe: MoEFFN, rank: int, world: int, group=None):
        super().__init__()
        E = moe.num_experts
        if E % world:
            raise ValueError(
                f"expert parallelism needs the number of experts ({E}) divisible by the "
                f"world size ({world}); build the model with experts_per_gpu * world experts"
            )
        self.d_model, self.ffn, self.num_experts = moe.d_model, moe.ffn, E
        self.k, self.capacity = moe.k, moe.capacity
        self.world, self.group = world, group
        self.local_experts = E // world
        lo, hi = rank * self.local_experts, (rank + 1) * self.local_experts
        self.router = moe.router
        self.w1 = nn.Parameter(moe.w1.detach()[lo:hi].clone())
        self.b1 = nn.Parameter(moe.b1.detach()[lo:hi].clone())
        self.w2 = nn.Parameter(moe.w2.detach()[lo:hi].clone())
        self.b2 = nn.Parameter(moe.b2.detach()[lo:hi].clone())
        for p in (self.w1, self.b1, self.w2, self.b2):
            p.expert = True  # marks parameters whose gradient is not all-reduced

    def forward(self, x: torch.Tensor):
        N, El, F_, D, C = self.world, self.local_experts, self.ffn, self.d_model, self.capacity
        combine, dispatch, aux = moe_gating(self.router(x), self.k, self.capacity)
        g = x.shape[0]
        xe = torch.einsum("gsec,gsd->egcd", dispatch, x)  # [E,g,C,D]
        xe = all_to_all(xe, self.group)  # [N*El,g,C,D], chunk i from rank i
        xe = xe.view(N, El, g, C, D).transpose(0, 1).reshape(El, N * g, C, D)
        h = torch.einsum("egcd,edf->egcf", xe, self.w1) + self.b1.view(El, 1, 1, F_)
        h = F.gelu(h)
        ye = torch.einsum("egcf,efd->egcd", h, self.w2) + self.b2.view(El, 1, 1, D)
        ye = ye.view(El, N, g, C, D).transpose(0, 1).reshape(N * El, g, C, D)  # chunk i -> rank i
        ye = all_to_all(ye, self.group)  # [E,g,C,D], chunk j = experts of rank j
        y = torch.einsum("gsec,egcd->gsd", combine, ye)
        return y, aux


def convert(model: nn.Module, rank: int, world: int, group=None) -> int:
    """Replace every :class:`MoEFFN` in ``model`` by its :class:`ExpertParallelMoE`; returns how many."""
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoEFFN):
                setattr(module, child_name, ExpertParallelMoE(child, rank, world, group))
                count += 1
    return count


def prepare(model: nn.Module, rank: int, world: int, device: torch.device, opts: Options = EAGER) -> Prepared:
    """Expert-parallel ``model``: local experts, replicated dense parameters (summed gradients)."""
    n = convert(model, rank, world)
    if n == 0:
        raise ValueError(
            f"the expert baseline needs a model with MoE layers (hidup.models.MoEFFN); "
            f"{type(model).__name__} has none -- use the ddp or fsdp baseline"
        )
    model.to(device)
    dense = [p for p in model.parameters() if not getattr(p, "expert", False)]
    # summed during the backward and waited for at its end (an autograd-engine callback); the
    # parameters' gradient hooks keep the bucketer alive
    GradBucketer(dense, bucket_mb=BUCKET_BYTES / 2**20)
    return Prepared(
        compile_module(model, opts),
        info={
            "moe_layers": n,
            "local_experts": model_local_experts(model),
            "compile": "whole model" if opts.compile else None,
        },
    )


def model_local_experts(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            return m.local_experts
    return 0
