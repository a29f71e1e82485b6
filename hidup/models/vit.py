"""Vision transformers: ViT-SGMoE and ViT-Switch (alternating dense/MoE layers, non-causal).

For images ``x[B,3,H,W]`` (``H = W = sqrt(P) * p`` for ``P`` patches of side ``p``) and labels
``y[B]``:

    z = conv2d(x, W_patch, stride p)               ([B,D,H/p,W/p] -> view [B,D,P] -> [B,P,D])
    h_0 = cat([cls, z], dim=1) + Pos               (class token, learned positions Pos[P+1,D])
    h_L, aux = Trunk(h_0)                          (pre-LN blocks, final layer norm)
    loss = sum_b -log softmax(h_L[b,0] W_head + b_head)[y_b] + aux_weight * sum_{layers,b} aux

The class token row is built as ``z[:, :1] * 0 + cls``: a batch-shaped copy of the parameter that
reads no tensor shape, so the trace stays valid for any per-rank batch.  Each image is its own MoE
routing group, so the loss is a sum over images and splits exactly across half-batches.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hidup.models.blocks import Trunk, add_aux
from hidup.models.config import ModelConfig

IN_CHANNELS = 3


class ViT(nn.Module):
    """``forward(images[B,3,H,W], labels[B] int64) -> summed loss (scalar)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model, self.patches, self.aux_weight = cfg.d_model, cfg.seq_len, cfg.aux_weight
        self.patch = nn.Conv2d(IN_CHANNELS, cfg.d_model, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.empty(1, 1, cfg.d_model))
        self.pos = nn.Parameter(torch.empty(cfg.seq_len + 1, cfg.d_model))
        self.trunk = Trunk(cfg, cfg.seq_len + 1, causal=False)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z = self.patch(images).view(-1, self.d_model, self.patches).transpose(1, 2)
        cls = z[:, :1, :] * 0.0 + self.cls
        h = torch.cat([cls, z], dim=1) + self.pos
        h, aux = self.trunk(h)
        logits = self.head(h[:, 0, :])
        loss = F.cross_entropy(logits, labels, reduction="sum")
        return add_aux(loss, aux, self.aux_weight)


def vit_inputs(cfg: ModelConfig, generator: torch.Generator | None, meta: bool):
    """``(images[B,3,H,W], labels[B])`` for the global batch."""
    B, side = cfg.global_batch, cfg.image_size
    if meta:
        return (torch.empty(B, IN_CHANNELS, side, side, device="meta"), torch.empty(B, dtype=torch.long, device="meta"))
    images = torch.randn(B, IN_CHANNELS, side, side, generator=generator)
    labels = torch.randint(0, cfg.num_classes, (B,), generator=generator)
    return images, labels
