"""Causal language models: BERT-SGMoE, BERT-Switch (alternating dense/MoE layers) and GPT (dense).

For tokens ``t[B,S]`` and next-token targets ``y[B,S]``:

    h_0 = E_tok[t] + P                        (token embedding + learned positions P[S,D])
    h_L, aux = Trunk(h_0)                      (pre-LN causal blocks, final layer norm)
    logits = h_L W_dec + b_dec                 ([B,S,V])
    loss = sum_{b,s} -log softmax(logits[b,s])[y[b,s]] + aux_weight * sum_{layers,b} aux

Both terms are sums over sequences, each depending on its own sequence only, so
``loss(batch) = loss(first half) + loss(second half)`` exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.models.blocks import Trunk, add_aux
from hidup.models.config import ModelConfig


class CausalLM(nn.Module):
    """``forward(tokens[B,S] int64, targets[B,S] int64) -> summed loss (scalar)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.vocab, self.seq_len, self.aux_weight = cfg.vocab, cfg.seq_len, cfg.aux_weight
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model))
        self.trunk = Trunk(cfg, cfg.seq_len, causal=True)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos
        h, aux = self.trunk(h)
        logits = self.decoder(h)
        loss = F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), reduction="sum")
        return add_aux(loss, aux, self.aux_weight)


def lm_inputs(cfg: ModelConfig, generator: torch.Generator | None, meta: bool):
    """``(tokens, targets)`` for the global batch: a random token stream shifted by one."""
    B, S = cfg.global_batch, cfg.seq_len
    if meta:
        return (torch.empty(B, S, dtype=torch.long, device="meta"), torch.empty(B, S, dtype=torch.long, device="meta"))
    stream = torch.randint(0, cfg.vocab, (B, S + 1), generator=generator)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
