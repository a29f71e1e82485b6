"""Model configurations of the zoo: defaults, overrides, validation and derived sizes.

A :class:`ModelConfig` is fully resolved: every size the model code needs is a plain ``int`` so the
models can build views and reshapes from config ints (never from ``x.shape``), which keeps a trace
valid when the batch is split.

Derived quantities
------------------
* experts ``E = experts_per_gpu * world_size``; global batch ``B = batch_per_gpu * world_size``.
* tokens per routing group ``S_g``: ``seq_len`` for language models, ``seq_len + 1`` for ViT
  (patches plus the class token).
* expert capacity per group ``C = min(S_g, max(1, ceil(k * capacity_factor * S_g / E)))`` with
  ``k`` the number of experts each token picks (2 for SGMoE, 1 for Switch).  Capping at ``S_g``
  changes nothing numerically: an expert can receive at most one slot per token of a group.
* ViT image side ``= sqrt(seq_len) * patch_size`` (``seq_len`` must be a perfect square).

Parameter counts (``ModelConfig.num_parameters``), with ``D`` = d_model, ``F`` = ffn, ``V`` = vocab:
attention ``4(D^2 + D)``; layer norm ``2D``; dense block ``2*2D + 4(D^2+D) + 2DF + F + D``;
MoE block ``2*2D + 4(D^2+D) + DE + E(2DF + F + D)``; LM adds ``VD + S D + 2D + DV + V``; ViT adds
``3 p^2 D + D (conv) + D (class token) + (S+1) D + 2D + D n_c + n_c``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# name -> (family, experts chosen per token; 0 = dense)
ZOO: dict[str, tuple[str, int]] = {
    "bert-sgmoe": ("lm", 2),
    "bert-switch": ("lm", 1),
    "vit-sgmoe": ("vit", 2),
    "vit-switch": ("vit", 1),
    "gpt": ("lm", 0),
    "mlp": ("mlp", 0),
    "bert-sgmoe-torch": ("lm-torch", 2),
}

# Per-family defaults that differ from the dataclass defaults (the paper's settings otherwise).
_FAMILY_DEFAULTS: dict[str, dict] = {
    "lm": {},
    "lm-torch": {},
    "vit": {"seq_len": 64},
    "mlp": {"layers": 4},
}

# Overridable fields and their kinds: "pos_int" (>= 1), "pos_float" (> 0), "prob" ([0, 1)),
# "nonneg_float" (>= 0).
OVERRIDES: dict[str, str] = {
    "layers": "pos_int",
    "d_model": "pos_int",
    "heads": "pos_int",
    "ffn": "pos_int",
    "experts_per_gpu": "pos_int",
    "capacity_factor": "pos_float",
    "seq_len": "pos_int",
    "batch_per_gpu": "pos_int",
    "vocab": "pos_int",
    "num_classes": "pos_int",
    "dropout": "prob",
    "aux_weight": "nonneg_float",
    "patch_size": "pos_int",
    "layer_norm_eps": "pos_float",
}


@dataclass(frozen=True)
class ModelConfig:
    """A resolved zoo configuration (see the module docstring for the derived quantities)."""

    name: str
    family: str
    top_k: int  # experts per token in MoE layers; 0 for dense models
    world_size: int = 1
    layers: int = 8
    d_model: int = 768
    heads: int = 12
    ffn: int = 3072
    experts_per_gpu: int = 2
    capacity_factor: float = 1.25
    seq_len: int = 128
    batch_per_gpu: int = 32
    vocab: int = 30522
    num_classes: int = 10
    dropout: float = 0.0
    aux_weight: float = 0.01
    patch_size: int = 4
    layer_norm_eps: float = 1e-5

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.top_k > 0

    @property
    def num_experts(self) -> int:
        return self.experts_per_gpu * self.world_size

    @property
    def global_batch(self) -> int:
        return self.batch_per_gpu * self.world_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def tokens_per_group(self) -> int:
        """Tokens routed together by the MoE gate: one sequence (LM) or one image (ViT)."""
        return self.seq_len + 1 if self.family == "vit" else self.seq_len

    @property
    def capacity(self) -> int:
        """Expert capacity per group: ``min(S_g, max(1, ceil(k * capacity_factor * S_g / E)))``."""
        if not self.is_moe:
            return 0
        s = self.tokens_per_group
        raw = self.top_k * self.capacity_factor * s / self.num_experts
        return min(s, max(1, math.ceil(round(raw, 9))))

    @property
    def image_size(self) -> int:
        return math.isqrt(self.seq_len) * self.patch_size

    def is_moe_layer(self, index: int) -> bool:
        """Layers alternate dense (even index) and MoE (odd index) in MoE models."""
        return self.is_moe and index % 2 == 1

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(
            num_experts=self.num_experts,
            global_batch=self.global_batch,
            capacity=self.capacity,
            num_parameters=self.num_parameters(),
        )
        return d

    # ---- parameter count -----------------------------------------------------------------
    def num_parameters(self) -> int:
        """Exact parameter count of the model this config builds (formulas in the module doc)."""
        D, F, E = self.d_model, self.ffn, self.num_experts
        if self.family == "mlp":
            return (D * F + F) + (self.layers - 1) * (F * F + F) + (F * self.num_classes + self.num_classes)
        attn = 4 * (D * D + D)
        dense = 2 * 2 * D + attn + 2 * D * F + F + D
        moe = 2 * 2 * D + attn + D * E + E * (2 * D * F + F + D)
        blocks = sum(moe if self.is_moe_layer(i) else dense for i in range(self.layers))
        if self.family == "vit":
            p = self.patch_size
            stem = 3 * p * p * D + D + D + (self.seq_len + 1) * D
            return stem + blocks + 2 * D + D * self.num_classes + self.num_classes
        V = self.vocab
        return V * D + self.seq_len * D + blocks + 2 * D + D * V + V


def _check_value(name: str, kind: str, value, where: str):
    if kind == "pos_int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: override {name}={value!r} must be an integer >= 1")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: override {name}={value!r} must be a finite number")
    value = float(value)
    if kind == "pos_float" and value <= 0:
        raise ValueError(f"{where}: override {name}={value!r} must be > 0")
    if kind == "prob" and not 0.0 <= value < 1.0:
        raise ValueError(f"{where}: override {name}={value!r} must be in [0, 1)")
    if kind == "nonneg_float" and value < 0:
        raise ValueError(f"{where}: override {name}={value!r} must be >= 0")
    return value


def resolve(name: str, world_size: int = 1, **overrides) -> ModelConfig:
    """Resolve ``name`` + ``overrides`` into a validated :class:`ModelConfig`.

    Raises ``ValueError`` for an unknown model name, an unknown override (listing the valid ones),
    or a value out of range (naming the constraint)."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has: {', '.join(ZOO)}")
    where = f"hidup.models config {name!r}"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}: world_size={world_size!r} must be an integer >= 1")
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ValueError(
            f"{where}: unknown override(s) {', '.join(unknown)}; valid overrides are: {', '.join(OVERRIDES)}"
        )
    family, top_k = ZOO[name]
    values = dict(_FAMILY_DEFAULTS[family])
    for key, value in overrides.items():
        values[key] = _check_value(key, OVERRIDES[key], value, where)
    cfg = ModelConfig(name=name, family=family, top_k=top_k, world_size=world_size, **values)
    if family != "mlp" and cfg.d_model % cfg.heads:
        raise ValueError(
            f"{where}: d_model={cfg.d_model} is not divisible by heads={cfg.heads}; choose heads dividing d_model"
        )
    if family == "vit" and math.isqrt(cfg.seq_len) ** 2 != cfg.seq_len:
        raise ValueError(
            f"{where}: seq_len={cfg.seq_len} is the number of image patches and must "
            f"be a perfect square (e.g. 16, 64, 256)"
        )
    if cfg.is_moe and cfg.top_k > cfg.num_experts:
        raise ValueError(
            f"{where}: top-{cfg.top_k} routing needs at least {cfg.top_k} experts, "
            f"got experts_per_gpu*world_size={cfg.num_experts}; raise experts_per_gpu"
        )
    return cfg
