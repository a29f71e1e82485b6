"""The model zoo: HiDup's four MoE models plus a dense GPT, an MLP and a stock-PyTorch BERT-SGMoE;
and the user's own models, built by a factory function named ``package.module:function``.

    model, inputs = hidup.models.build("bert-sgmoe", world_size=4, layers=2)
    loss = model(*inputs)            # a scalar: summed NLL + aux_weight * summed balance loss
    model, inputs = hidup.models.build("mymodels:build_llama", world_size=4, layers=2)

:func:`build` is the one place every entry point (``hidup search/describe/show/verify/train``,
``hidup profile --ops-model``, ``exp/*.py``) turns a model spec and its arguments into a model;
factories are resolved by :mod:`hidup.models.source`, which states their calling convention.

Every model returns a loss that is a *sum over independent groups* (sequences or images), so
``loss(batch) == loss(first half) + loss(second half)``: data parallelism and duplication can be
checked by exact parity.  ``example_inputs`` always hold the global batch
``batch_per_gpu * world_size``; MoE models have ``experts_per_gpu * world_size`` experts.

``device="meta"`` builds parameters and inputs without memory (instant even at tens of billions
of parameters).  Real devices build on the CPU under ``seed`` (so the numbers do not depend on the
device) and are then moved; the global RNG state is left untouched.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hidup.models.config import OVERRIDES, ZOO, ModelConfig, resolve
from hidup.models.lm import CausalLM, lm_inputs
from hidup.models.mlp import MLP, mlp_inputs
from hidup.models.moe import MoEFFN, moe_gating
from hidup.models.source import ModelSourceError, build_factory, is_factory, recorded_source
from hidup.models.torch_style import TorchStyleMoELM
from hidup.models.vit import ViT, vit_inputs

__all__ = [
    "build",
    "names",
    "config",
    "count_parameters",
    "ModelConfig",
    "moe_gating",
    "MoEFFN",
    "OVERRIDES",
    "ModelSourceError",
    "is_factory",
    "recorded_source",
]

_FAMILIES = {
    "lm": (CausalLM, lm_inputs),
    "lm-torch": (TorchStyleMoELM, lm_inputs),
    "vit": (ViT, vit_inputs),
    "mlp": (MLP, mlp_inputs),
}


def names() -> list[str]:
    """The models of the zoo."""
    return list(ZOO)


def config(name: str, world_size: int = 1, *, dtype=None, **overrides) -> ModelConfig:
    """The resolved, validated configuration of ``name`` (a frozen dataclass).  ``dtype`` is accepted
    and ignored, as :func:`build` takes it beside the overrides (the parameters' dtype is not part of
    the architecture), so that one set of model arguments serves both."""
    return resolve(name, world_size, **overrides)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on meta models)."""
    return sum(p.numel() for p in model.parameters())


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(
        f"hidup.models.build: dtype={dtype!r} is not a torch dtype; pass e.g. "
        f"torch.float32, torch.bfloat16 or 'bfloat16'"
    )


def build(
    name: str, /, world_size: int = 1, *, device=None, dtype=None, seed: int = 0, **overrides
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build model ``name`` -- a zoo name or ``package.module:function`` -- and example inputs for the
    global batch.

    Returns ``(model, example_inputs)`` with ``model(*example_inputs)`` a scalar loss.  ``dtype``
    applies to parameters and floating-point inputs.  For a zoo model ``overrides`` are validated
    against ``hidup.models.OVERRIDES`` (an unknown model, unknown names or bad values raise
    :class:`ModelSourceError`, a ``ValueError``); for a factory they are its keyword arguments
    (:mod:`hidup.models.source`; failures raise :class:`ModelSourceError`)."""
    dtype = _as_dtype(dtype)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"hidup.models.build: dtype={dtype} must be a floating-point dtype")
    if is_factory(name):
        model, inputs = build_factory(name, world_size, device=device, seed=seed, **overrides)
        if dtype is not None:
            model = model.to(dtype=dtype)
            inputs = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
        return model, inputs
    try:
        cfg = resolve(name, world_size, **overrides)
    except ValueError as e:  # a user's model name or size: one message wherever the model is built
        raise ModelSourceError(str(e)) from None
    device = torch.device(device) if device is not None else torch.device("cpu")
    model_cls, make_inputs = _FAMILIES[cfg.family]
    meta = device.type == "meta"
    if meta:
        with torch.device("meta"):
            model = model_cls(cfg)
        inputs = make_inputs(cfg, None, meta=True)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device("cpu"):
                model = model_cls(cfg)
        generator = torch.Generator().manual_seed(seed + 1)
        inputs = make_inputs(cfg, generator, meta=False)
    model.config = cfg
    if dtype is not None:
        model = model.to(dtype=dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    if not meta and device.type != "cpu":
        model = model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
    return model, tuple(inputs)
