"""Random ops drawn as on one device, whatever the plan: counter-based dropout.

A stateful generator cannot give a rank the single device's random values for the slice it holds:
the values a slice gets depend on every draw before it, on every rank.  hidup's random ops are
therefore *counter-based* (as Philox, or JAX's partitionable threefry): the value at element ``i``
of a random op's single-device (global) tensor is a pure function of where it is,

    u(i) = H(seed, step, op, L(i)) / 2^24  in [0, 1),
    dropout(x, p)_i = x_i * [u(i) >= p] / (1 - p),

with ``L(i)`` the row-major linear index of ``i`` in the global tensor, ``op`` the op's position
among the step's random ops (the trace's order, which is the order they run), ``step`` the training
step and ``seed`` the job's seed.  ``H`` is a 24-bit hash built from the 32-bit integer mixer
``lowbias32`` (C. Wellons), applied to the key words in turn and evaluated in int64 arithmetic that
never overflows, so it gives the same bits on every device and under ``torch.compile``.

Consequences, each exact:

* a rank holding a block of the tensor (a ``gather_d`` form on any mesh axis) computes ``L`` of its
  block from the block's offset in the global tensor (``offset``, which each mesh axis's localize
  advances by ``rank * local size``), so it holds the single device's values of that block;
* ranks holding the same block (``full``/``replicate``) draw the same values;
* a ``reduce`` input (partial sums) stays ``reduce``: the mask multiplies every part alike;
* duplication's copy ``c`` holds, of a tensor its copy axis splits on dim ``d`` (``copy_dim``), the
  rows ``b * 2h + c * h + j`` of the whole step's dim (``h = shape[d] / blocks``, ``blocks`` the world
  size, :mod:`hidup.codegen.duplicate`), so its index on ``d`` is mapped to that row first; the copy
  number is the third word of the run-time key;
* recomputation in the backward draws the same values (the key does not change within a step).

The run-time key is an int64 tensor ``[seed, step, copy]`` (:func:`make_key`); code generation
passes it to every random op of a program (``rng_key``) and the op's number (``op``).  The single-device
reference is the model run under :func:`single_device`, which draws every dropout of the model from
the same function over its whole tensor: ``hidup verify`` compares the plan with it.

Which random ops a plan may hold: dropout (``aten.dropout``, ``F.dropout``, ``torch.dropout``) and
attention dropout (:func:`attention`).  Any other op that draws random numbers
(``torch.Tag.nondeterministic_seeded``: ``bernoulli``, ``rand_like``, ``feature_dropout``, ...) is
refused by the trace (:func:`refusal`): its values would differ between the ranks and from the
single device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hidup.ir import Signature
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.elementwise import elementwise_signatures
from hidup.rules.registry import bind, register

__all__ = [
    "dropout",
    "attention",
    "make_key",
    "single_device",
    "refusal",
    "bind_program",
    "is_random_call",
    "DROPOUT_TARGETS",
]

_M32 = 0xFFFFFFFF
_BITS = 24  # the uniform's resolution: u = h >> 8 of a 32-bit hash


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for ``0 <= x < 2^32`` in int64 without overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32``: a 32-bit integer hash with low bias."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def make_key(seed: int, step: int, copy: int = 0, device=None) -> torch.Tensor:
    """The run-time key ``[seed, step, copy]`` of one program run (see module docstring)."""
    return torch.tensor([seed & _M32, step & _M32, copy], dtype=torch.int64, device=device)


def _stream(key: torch.Tensor, op: int) -> torch.Tensor:
    """The 32-bit state of random op ``op`` at the key's seed and step (a 0-d tensor)."""
    s = _mix32(key[0] ^ 0x9E3779B9)
    s = _mix32(s ^ key[1])
    return _mix32(s ^ (op & _M32))


def _global_index(
    local: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...], copy_dim, blocks: int, key, device
) -> torch.Tensor:
    """``L(i)`` for each element of a local block (shape ``local``) at ``offset`` in a tensor of
    ``shape``, read on the whole step's tensor when ``copy_dim`` is a copy-split dim."""
    full = list(shape)
    if copy_dim is not None:
        full[copy_dim] *= 2
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(local))):
        q = torch.arange(local[d], dtype=torch.int64, device=device) + offset[d]
        if d == copy_dim:
            h = shape[d] // blocks
            q = (q // h) * (2 * h) + key[2] * h + q % h
        index = index + (q * stride).reshape((-1,) + (1,) * (len(local) - 1 - d))
        stride *= full[d]
    return index


def uniform_bits(
    local: tuple[int, ...],
    *,
    shape=None,
    offset=None,
    copy_dim=None,
    blocks: int = 1,
    op: int = 0,
    rng_key=None,
    device=None,
) -> torch.Tensor:
    """The 24-bit uniforms (int64 in ``[0, 2^24)``) of the block of shape ``local`` at ``offset`` of
    random op ``op``'s tensor of ``shape`` (default: the block is the whole tensor), drawn with the
    run-time key ``rng_key`` (default ``[0, 0, 0]``); ``copy_dim`` and ``blocks``: module docstring."""
    shape = tuple(local) if shape is None else tuple(shape)
    offset = (0,) * len(local) if offset is None else tuple(offset)
    key = make_key(0, 0, device=device) if rng_key is None else rng_key.to(device)
    index = _global_index(tuple(local), shape, offset, copy_dim, blocks, key, device)
    h = _mix32(_mix32(_stream(key, op) ^ (index >> 32)) ^ (index & _M32))
    return h >> (32 - _BITS)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, **block) -> torch.Tensor:
    """Counter-based dropout of the block ``x`` of a global tensor (module docstring); ``block`` places
    it and keys the draw (:func:`uniform_bits`'s keywords).  ``inplace`` is accepted and ignored (the
    result is a new tensor, as autograd of an activation wants)."""
    if not _draws(p, training):
        return x
    if p == 1.0:
        return x * 0.0
    keep = uniform_bits(tuple(x.shape), **block, device=x.device) >= round(p * (1 << _BITS))
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _draws(p: float, training: bool) -> bool:
    return bool(training) and p != 0.0


# -- the rule ---------------------------------------------------------------------------------------

_DROPOUT_NAMES = ["input", "p", "training", "inplace"]
SDPA_NAMES = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
# where a block sits in the global tensor, and what code generation binds per program (bind_program)
PROGRAM_KWARGS = ("shape", "offset", "copy_dim", "blocks", "op", "rng_key")
DROPOUT_TARGETS = (F.dropout, torch.dropout, dropout)


def _bound_dropout(ctx: RuleContext) -> dict:
    return bind(
        ctx.args,
        ctx.kwargs,
        _DROPOUT_NAMES + list(PROGRAM_KWARGS),
        {"p": 0.5, "training": True, "inplace": False},
        where="dropout",
    )


def advanced(offset, local_shape, form, rank: int, world: int) -> tuple[int, ...]:
    """``offset`` moved to ``rank``'s block of a ``local_shape`` tensor cut by ``form`` on ``world`` ranks."""
    offset = list(offset)
    if form.is_gather:
        offset[form.dim] += rank * (local_shape[form.dim] // world)
    return tuple(offset)


def _localize_dropout(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    b = _bound_dropout(ctx)
    here = ctx.outputs[0].shape
    shape = tuple(b.get("shape") or here)
    offset = advanced(b.get("offset") or (0,) * len(here), here, sig.outputs[0], rank, ctx.world)
    kwargs = {"p": b["p"], "training": b["training"], "shape": shape, "offset": offset}
    kwargs.update({k: b[k] for k in PROGRAM_KWARGS[2:] if k in b})
    return LocalCall(dropout, (b["input"],), kwargs)


@register(*DROPOUT_TARGETS, name="dropout", localize=_localize_dropout)
def _dropout_rule(ctx: RuleContext) -> list[Signature]:
    """Elementwise, and linear in ``x`` (the mask multiplies every part of a sum alike)."""
    return elementwise_signatures(ctx, linear=[(0,)])


# -- code generation's part -------------------------------------------------------------------------


def is_random_call(call: LocalCall) -> bool:
    """Whether a local call draws random numbers (and so takes a key and an op number)."""
    if call.target is dropout:
        return _draws(call.kwargs.get("p", 0.5), call.kwargs.get("training", True))
    if call.target is attention:
        return _draws(call.kwargs.get("dropout_p", 0.0), True)
    return False


def bind_program(call: LocalCall, *, op: int, key, copy_dim: int | None, blocks: int) -> LocalCall:
    """``call`` (:func:`is_random_call`) as one program runs it: random op number ``op`` of the step,
    the run-time ``key`` (an fx node), and for a duplicated copy the dim its copy axis splits."""
    kwargs = dict(call.kwargs, op=op, rng_key=key, copy_dim=copy_dim, blocks=blocks)
    return LocalCall(call.target, tuple(call.args), kwargs)


# -- attention with dropout -------------------------------------------------------------------------


def attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale=None,
    enable_gqa: bool = False,
    **block,
):
    """``F.scaled_dot_product_attention`` with counter-based dropout of its attention weights
    ``[..., H, S, L]``, written out: the fused kernels draw their own masks.  ``block`` places the
    weights' block and keys the draw (:func:`dropout`'s keyword arguments).  Without dropout it is the
    fused op."""
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    s, l_ = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(s, l_, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    weights = dropout(weights, dropout_p, True, **block)
    return weights @ value


# -- the single-device reference and the trace's refusals -------------------------------------------


class single_device(TorchFunctionMode):
    """Run a model's dropout as hidup's programs do (module docstring): ``with single_device(seed,
    step): loss = model(*batch)``.  Numbers the random ops in the order they run."""

    def __init__(self, seed: int = 0, step: int = 0):
        super().__init__()
        self.seed, self.step, self.ops = seed, step, 0

    def _next(self, device) -> tuple[int, torch.Tensor]:
        op, self.ops = self.ops, self.ops + 1
        return op, make_key(self.seed, self.step, device=device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout):
            b = bind(args, kwargs, _DROPOUT_NAMES, {"p": 0.5, "training": True, "inplace": False}, "dropout")
            if not _draws(b["p"], b["training"]):
                return b["input"]
            op, key = self._next(b["input"].device)
            return dropout(b["input"], b["p"], b["training"], op=op, rng_key=key)
        if func is F.scaled_dot_product_attention:
            b = bind(args, kwargs, SDPA_NAMES, {"dropout_p": 0.0}, "scaled_dot_product_attention")
            if b["dropout_p"]:
                op, key = self._next(b["query"].device)
                return attention(**b, op=op, rng_key=key)
        return func(*args, **kwargs)


_DRAWN = (torch.ops.aten.dropout.default, torch.ops.aten.scaled_dot_product_attention.default, *DROPOUT_TARGETS)


def refusal(target) -> str:
    """Why a traced call cannot run exactly under a plan (a random op hidup does not draw itself),
    or ``""``."""
    if target in _DRAWN:
        return ""
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return (
            f"{target} draws random numbers, which hidup cannot make equal to the single device's on every "
            "rank (it draws dropout itself: F.dropout, nn.Dropout, attention dropout). Fix: replace it by "
            "F.dropout, or remove it from the training step"
        )
    return ""
