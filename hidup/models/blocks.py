"""Transformer building blocks of the zoo, written for ``torch.export`` and for sharding rules.

Pre-LN blocks over ``x[B,S,D]`` with ``H`` heads of size ``Dh = D/H``:

* attention: ``q,k,v = x W_q + b_q, ...`` viewed ``[B,S,H,Dh]`` and transposed to ``[B,H,S,Dh]``;
  ``a = softmax(q k^T / sqrt(Dh) + causal mask) v`` via ``F.scaled_dot_product_attention``;
  transposed back, reshaped ``[B,S,D]``, output projection ``W_o``.
* dense block: ``x = x + Attn(LN1(x)); x = x + W_2 gelu(W_1 LN2(x) + b_1) + b_2``.
* MoE block: ``x = x + Attn(LN1(x)); y, aux = MoE(LN2(x)); x = x + y``.

Every reshape uses config ints or ``-1`` for the batch, never ``x.shape``, so a trace stays valid
when the batch is split across ranks.  Dropout (after attention and after the FFN, as in BERT) is
emitted only when its probability is positive.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.models.config import ModelConfig
from hidup.models.moe import MoEFFN


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (column-parallel friendly)."""

    def __init__(self, d_model: int, heads: int, seq_len: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.heads, self.seq_len = d_model, heads, seq_len
        self.head_dim = d_model // heads
        self.causal, self.dropout = causal, dropout
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, self.seq_len, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        a = a.transpose(1, 2).reshape(-1, self.seq_len, self.d_model)
        return self.o(a)


class FeedForward(nn.Module):
    """``W_2 gelu(W_1 x + b_1) + b_2``."""

    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _maybe_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p > 0.0 else x


class _PreLNAttention(nn.Module):
    """The attention half shared by both blocks: ``x + attn(ln1(x))``; ``ln2`` feeds the FFN half."""

    def __init__(self, cfg: ModelConfig, seq_len: int, causal: bool):
        super().__init__()
        self.p = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg.d_model, cfg.heads, seq_len, causal, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        return x + _maybe_dropout(self.attn(self.ln1(x)), self.p, self.training)


class DenseBlock(_PreLNAttention):
    """Pre-LN transformer block; ``forward(x) -> x``."""

    def __init__(self, cfg: ModelConfig, seq_len: int, causal: bool):
        super().__init__(cfg, seq_len, causal)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + _maybe_dropout(self.ffn(self.ln2(x)), self.p, self.training)


class MoEBlock(_PreLNAttention):
    """Pre-LN block with an MoE feed-forward; ``forward(x) -> (x, aux[B])``."""

    def __init__(self, cfg: ModelConfig, seq_len: int, causal: bool):
        super().__init__(cfg, seq_len, causal)
        self.moe = MoEFFN(cfg.d_model, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.capacity)

    def forward(self, x: torch.Tensor):
        x = self.attend(x)
        y, aux = self.moe(self.ln2(x))
        return x + _maybe_dropout(y, self.p, self.training), aux


class Trunk(nn.Module):
    """The stack of layers (dense at even indices, MoE at odd ones for MoE configs) and the final
    layer norm.  ``forward(x) -> (x, aux_sum)`` where ``aux_sum`` is the load-balancing loss summed
    over groups and MoE layers (``None`` when there is no MoE layer)."""

    def __init__(self, cfg: ModelConfig, seq_len: int, causal: bool):
        super().__init__()
        self.layers = nn.ModuleList(
            MoEBlock(cfg, seq_len, causal) if cfg.is_moe_layer(i) else DenseBlock(cfg, seq_len, causal)
            for i in range(cfg.layers)
        )
        self.moe_layer = [cfg.is_moe_layer(i) for i in range(cfg.layers)]
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor):
        aux_sum = None
        for is_moe, layer in zip(self.moe_layer, self.layers):
            if is_moe:
                x, aux = layer(x)
                aux_sum = aux.sum() if aux_sum is None else aux_sum + aux.sum()
            else:
                x = layer(x)
        return self.norm(x), aux_sum


def add_aux(loss: torch.Tensor, aux_sum, weight: float) -> torch.Tensor:
    """``loss + weight * aux_sum`` (``aux_sum`` may be ``None`` for models without MoE layers)."""
    if aux_sum is None or weight == 0.0:
        return loss
    return loss + aux_sum * weight
