"""A plain multi-layer perceptron classifier.

For ``x[B,D]`` and labels ``y[B]``, with ``L`` hidden layers of width ``F``:

    h_0 = x;  h_i = gelu(h_{i-1} W_i + b_i)  (i = 1..L)
    loss = sum_b -log softmax(h_L W_out + b_out)[y_b]

The loss is a sum over samples, so it splits exactly across half-batches.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.models.config import ModelConfig


class MLP(nn.Module):
    """``forward(x[B,D], labels[B] int64) -> summed cross-entropy (scalar)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        widths = [cfg.d_model] + [cfg.ffn] * cfg.layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(cfg.ffn, cfg.num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return F.cross_entropy(self.out(x), labels, reduction="sum")


def mlp_inputs(cfg: ModelConfig, generator: torch.Generator | None, meta: bool):
    """``(x[B,D], labels[B])`` for the global batch."""
    B = cfg.global_batch
    if meta:
        return (torch.empty(B, cfg.d_model, device="meta"), torch.empty(B, dtype=torch.long, device="meta"))
    x = torch.randn(B, cfg.d_model, generator=generator)
    labels = torch.randint(0, cfg.num_classes, (B,), generator=generator)
    return x, labels
