"""BERT-SGMoE written with PyTorch's stock transformer modules ("bert-sgmoe-torch").

Same architecture and loss as :mod:`hidup.models.lm` (see there for the math), but the way users
commonly write it: dense layers are ``nn.TransformerEncoderLayer(batch_first=True,
norm_first=True, activation="gelu")`` run with a causal mask, and MoE layers use
``nn.MultiheadAttention(batch_first=True)`` followed by the MoE feed-forward.  A tracer keeps these
two standard modules as leaves.  The causal mask is a boolean buffer ``M[i,j] = j > i`` (``True`` =
not attended), passed together with ``is_causal=True``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.models.blocks import add_aux
from hidup.models.config import ModelConfig
from hidup.models.moe import MoEFFN


class TorchMoEBlock(nn.Module):
    """``x = x + MHA(LN1(x)); y, aux = MoE(LN2(x)); x = x + y``; returns ``(x, aux[B])``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.p = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, dropout=cfg.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.moe = MoEFFN(cfg.d_model, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.capacity)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        h = self.ln1(x)
        a = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        if self.p > 0.0:
            a = F.dropout(a, self.p, self.training)
        x = x + a
        y, aux = self.moe(self.ln2(x))
        if self.p > 0.0:
            y = F.dropout(y, self.p, self.training)
        return x + y, aux


class TorchStyleMoELM(nn.Module):
    """``forward(tokens[B,S] int64, targets[B,S] int64) -> summed loss (scalar)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.vocab, self.aux_weight = cfg.vocab, cfg.aux_weight
        S = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.empty(S, cfg.d_model))
        self.register_buffer("causal_mask", torch.ones(S, S, dtype=torch.bool).triu(1), persistent=False)
        self.moe_layer = [cfg.is_moe_layer(i) for i in range(cfg.layers)]
        self.layers = nn.ModuleList(
            TorchMoEBlock(cfg)
            if cfg.is_moe_layer(i)
            else nn.TransformerEncoderLayer(
                cfg.d_model,
                cfg.heads,
                dim_feedforward=cfg.ffn,
                dropout=cfg.dropout,
                activation="gelu",
                layer_norm_eps=cfg.layer_norm_eps,
                batch_first=True,
                norm_first=True,
            )
            for i in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos
        aux_sum = None
        for is_moe, layer in zip(self.moe_layer, self.layers):
            if is_moe:
                h, aux = layer(h, self.causal_mask)
                aux_sum = aux.sum() if aux_sum is None else aux_sum + aux.sum()
            else:
                h = layer(h, src_mask=self.causal_mask, is_causal=True)
        logits = self.decoder(self.norm(h))
        loss = F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), reduction="sum")
        return add_aux(loss, aux_sum, self.aux_weight)
