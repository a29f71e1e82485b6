"""Routed experts of third-party Mixture-of-Experts models as one custom op, and its rule.

The op
------
``hidup::routed_experts(x[T,D], top_k_index[T,k], top_k_weights[T,k], gate_up_proj[E_l,2F,D],
down_proj[E_l,D,F], expert_offset: int, act: str) -> y[T,D]`` is the dropless sum

    y[t] = sum_{j : e = idx[t,j] - expert_offset in [0, E_l)}  w[t,j] * expert_e(x[t])
    expert_e(h) = down_e @ (act(gate_e h) * (up_e h)),    [gate_e; up_e] = gate_up_proj[e]

over the experts ``[expert_offset, expert_offset + E_l)`` only: a token routed elsewhere gets no
contribution from them.  It is exactly the math of the eager experts of ``transformers`` 5.x
(``MixtralExperts`` and every class decorated with ``use_experts_implementation`` in the default
layout: concatenated ``[gate; up]``, not transposed, no bias, no post-expert norm, the default
``_apply_gate``): per expert, its tokens are gathered, run through both projections, scaled by
their routing weight and added into the output.  The op is a ``torch.library`` custom op with a
fake (meta) implementation, so ``torch.export`` records one node per MoE layer instead of the
data-dependent ``sort / histc / grouped_mm / index_put_`` of the grouped implementation, which no
rule can shard.  Its backward recomputes the forward with differentiable torch ops and takes
their gradients (memory: the op saves only its inputs).

While hidup exports a model, :func:`routed_experts_as_custom_op` registers a ``"hidup"`` experts
implementation in ``transformers``' ``ALL_EXPERTS_FUNCTIONS`` and points the configs of the
model's experts modules at it; afterwards the configs are restored.  An experts module whose
layout or activation hidup does not model keeps its previous implementation (replicated, with
the usual fallback warning).

Signatures (``E`` experts in total, ``N`` ranks)
-----------------------------------------------
* all ``full``;
* data: ``x, idx, w gather_0`` (tokens), expert weights ``full`` -> ``y gather_0``: each token's
  output depends on that token only;
* expert: ``x, idx, w full``, both expert weights ``gather_0`` (experts) -> ``y reduce``: rank r
  holds experts ``[r E/N, (r+1) E/N)`` and runs the op with ``expert_offset = r E/N`` on every
  token; the sum over ranks of these partial outputs is ``y`` because each (token, slot) pair is
  counted by the one rank owning its expert.  This is the all-gather token dispatcher of
  Megatron-LM (tokens all-gathered, outputs reduce-scattered): dropless, with no variable-size
  all-to-all.  Gradients follow the convention of :mod:`hidup.ir`: ``y``'s gradient is exact on
  every rank, so each rank's gradients of ``x`` and ``w`` are its experts' partial contributions
  (``full``), and its expert weights' gradients are exact for its slice (``gather_0``);
* expert, all-to-all dispatch (``impl`` ``all_to_all``): ``x, idx, w gather_0`` (tokens), both expert
  weights ``gather_0`` (experts) -> ``y gather_0``: each rank sends each of its (token, slot) pairs to
  the rank owning the pair's expert and gets the outputs back (:mod:`hidup.rules.dispatch`), moving
  ``T k / N`` rows each way instead of the all-gather's ``(N-1) T / N``, at the price of one host
  synchronization per layer (run-time split sizes).  Offered where the op covers every expert
  (``expert_offset`` 0); on a mesh, axes after it keep the op whole.

FLOPs: ``6 T k D F`` for the whole op (``2 T k D (2F)`` for ``[gate; up]``, ``2 T k F D`` for
``down``), ``/ N`` per rank in every sharded signature.

The router's ``topk(input, k, dim)`` is here too: any dim but ``dim`` may be sharded (the same
slice of both outputs), ``dim`` never (the top k of a slice are not the top k of the row).
FLOPs: ``numel(input)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hidup.ir import FULL, REDUCE, Signature, gather
from hidup.rules import grouped
from hidup.rules.base import LocalCall, RuleContext
from hidup.rules.dispatch import routed_experts_all_to_all
from hidup.rules.expert_rows import act_rows, combine_rows, gather_rows
from hidup.rules.grouped import ACTIVATIONS, compute_dtype, grouped_mm, route
from hidup.rules.notation import shard_signatures
from hidup.rules.registry import Unsupported, all_full, bind, register

__all__ = [
    "ACTIVATIONS",
    "routed_experts",
    "routed_experts_math",
    "routed_experts_as_custom_op",
    "set_experts_implementation",
    "experts_layout_activation",
    "unmodelled_layout",
    "UnmodelledExpertsWarning",
]


_NAMES = ["x", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "expert_offset", "act"]


def routed_experts_math(
    x: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    expert_offset: int,
    act: str,
) -> Tensor:
    """The op in differentiable torch (see module docstring), as grouped matmuls.

    The ``T k`` (token, slot) pairs are sorted by expert on the device (:func:`hidup.rules.grouped.route`),
    each expert's rows run through ``[gate; up]`` and ``down`` as two grouped matmuls in the compute
    dtype (autocast's, as ``F.linear``), and each token sums its ``k`` slots' outputs scaled by their
    routing weights.  The row-wise steps around the matmuls (:mod:`hidup.rules.expert_rows`: the gather
    of each pair's token, the activation, the weighted sum back to tokens) read the count of the rank's
    own rows on the device and skip the rest, so under the all-gather dispatcher a rank's row work
    follows its own ``T k / N`` pairs, not all ``T k``; no host synchronization, static shapes.  Autograd
    keeps what the matmuls need (the gathered rows, ``[gate; up]``'s output, the activation's), so the
    backward is two grouped matmuls per projection with no second forward."""
    tokens, k = top_k_index.shape
    rows = route(top_k_index, expert_offset, gate_up_proj.shape[0])
    dtype = compute_dtype(x, gate_up_proj, down_proj)
    count = rows.count
    xc = x.to(dtype)
    gate_up = gate_up_proj.to(dtype).transpose(-2, -1)
    # the masked grouped form multiplies every row (its weight gradients too): tails must be zero there
    zero_tail = not grouped.native_grouped_mm(xc, gate_up)
    xs = gather_rows(xc, rows.order, rows.inverse, count, k, zero_tail)
    hidden = act_rows(grouped_mm(xs, gate_up, rows.offsets), count, act, zero_tail)
    h = grouped_mm(hidden, down_proj.to(dtype).transpose(-2, -1), rows.offsets)
    return combine_rows(h, top_k_weights, rows.order, rows.inverse, count, k, x.dtype)


@torch.library.custom_op("hidup::routed_experts", mutates_args=())
def routed_experts(
    x: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    expert_offset: int,
    act: str,
) -> Tensor:
    """Dropless routed experts ``[expert_offset, expert_offset + E_local)`` (see module docstring)."""
    with torch.no_grad():
        return routed_experts_math(x, top_k_index, top_k_weights, gate_up_proj, down_proj, expert_offset, act)


@routed_experts.register_fake
def _routed_experts_fake(x, top_k_index, top_k_weights, gate_up_proj, down_proj, expert_offset, act):
    _check_shapes(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    return torch.empty_like(x)


def _check_shapes(x, idx, w, gate_up, down, act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"hidup::routed_experts: unknown activation {act!r}; expected one of {sorted(ACTIVATIONS)}")
    if x.dim() != 2 or idx.dim() != 2 or idx.shape != w.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"hidup::routed_experts: expected x[T,D], top_k_index[T,k], top_k_weights[T,k]; got "
            f"{tuple(x.shape)}, {tuple(idx.shape)}, {tuple(w.shape)}"
        )
    e, f2, d = gate_up.shape
    if d != x.shape[1] or f2 % 2 or tuple(down.shape) != (e, d, f2 // 2):
        raise ValueError(
            f"hidup::routed_experts: expected gate_up_proj[E,2F,D], down_proj[E,D,F] with D = "
            f"{x.shape[1]}; got {tuple(gate_up.shape)}, {tuple(down.shape)}"
        )


def _setup_context(ctx, inputs, output) -> None:
    x, idx, w, gate_up, down, offset, act = inputs
    ctx.save_for_backward(x, idx, w, gate_up, down)
    ctx.expert_offset, ctx.act = offset, act


def _backward(ctx, grad_y):
    x, idx, w, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in (x, w, gate_up, down)]
    with torch.enable_grad():
        y = routed_experts_math(leaves[0], idx, leaves[1], leaves[2], leaves[3], ctx.expert_offset, ctx.act)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(y, wanted, grad_y, allow_unused=True)) if y.requires_grad else None
    grads = []
    for t in leaves:
        g = next(got) if (got is not None and t.requires_grad) else None
        grads.append(torch.zeros_like(t) if g is None and t.requires_grad else g)
    gx, gw, g_gate_up, g_down = grads
    return gx, None, gw, g_gate_up, g_down, None, None


routed_experts.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- transformers integration
def experts_layout_activation(module: nn.Module) -> str | None:
    """The activation name of a ``transformers`` experts module whose layout the op models, else None."""
    if not is_transformers_experts(module) or unmodelled_layout(module) is not None:
        return None
    return _activation_name(module.act_fn)


def is_transformers_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of ``transformers``' experts interface."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "has_bias", "config", "act_fn"))


def unmodelled_layout(module: nn.Module) -> str | None:
    """Why the op does not model this ``transformers`` experts module's layout, None where it does."""
    layout = [
        (not module.has_gate, "it has no gate projection"),
        (module.is_transposed, "its weights are stored transposed"),
        (module.has_bias, "its projections have biases"),
        (getattr(module, "has_post_expert_norm", False), "it normalizes each expert's output"),
        (not getattr(module, "is_concatenated", True), "its gate and up projections are separate tensors"),
        (getattr(module, "_is_expert_parallel", False), "transformers already shards it (expert parallel)"),
    ]
    for bad, why in layout:
        if bad:
            return why
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or getattr(type(module), "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        return "it combines gate and up with its own function"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return "its weights are not [experts, 2 ffn, hidden] and [experts, hidden, ffn] tensors"
    e, f2, d = gate_up.shape
    if f2 % 2 or tuple(down.shape) != (e, d, f2 // 2) or getattr(module, "num_experts", e) != e:
        return f"its weights' shapes {tuple(gate_up.shape)} and {tuple(down.shape)} do not match"
    if _activation_name(module.act_fn) is None:
        return f"its activation {type(module.act_fn).__name__} is not one of {', '.join(ACTIVATIONS)}"
    return None


def _activation_name(act: nn.Module) -> str | None:
    acts = sys.modules.get("transformers.activations")
    cls = type(act)
    if cls in (nn.SiLU,) or (acts is not None and cls is getattr(acts, "SiLUActivation", None)):
        return "silu"
    if cls is nn.ReLU and not act.inplace:
        return "relu"
    if cls is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if acts is not None and cls is getattr(acts, "GELUActivation", None) and getattr(act, "act", None) is F.gelu:
        return "gelu"
    if acts is not None and cls is getattr(acts, "GELUTanh", None):
        inner = getattr(act, "act", None)
        if isinstance(inner, functools.partial) and inner.func is F.gelu and inner.keywords == {"approximate": "tanh"}:
            return "gelu_tanh"
    return None


_IMPLEMENTATION = "hidup"
_PREVIOUS: dict[int, str | None] = {}  # id(config) -> its experts implementation before the export


def _previous_forward(self: nn.Module):
    """The experts implementation the model had before hidup switched it (its layout is not modelled)."""
    moe = sys.modules["transformers.integrations.moe"]
    eager = getattr(type(self).forward, "__wrapped__", None)
    previous = _PREVIOUS.get(id(self.config))
    return moe.ALL_EXPERTS_FUNCTIONS.get_interface(previous, eager) if previous else eager


def _experts_forward(run: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A ``transformers`` experts forward that runs ``run`` (the op, or its math) with the signature of
    :func:`routed_experts` on a layout the op models, and the model's previous implementation on any other."""

    def forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        act = experts_layout_activation(self)
        if act is None:
            return _previous_forward(self)(self, hidden_states, top_k_index, top_k_weights)
        return run(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, 0, act)

    return forward


# name in transformers' experts interface -> forward: the opaque op hidup exports, and the math a
# rank runs (what a single device runs with hidup's kernels, for comparing a rank against it)
IMPLEMENTATIONS = {
    _IMPLEMENTATION: _experts_forward(torch.ops.hidup.routed_experts),
    "hidup_grouped": _experts_forward(routed_experts_math),
}


def _register_implementations() -> bool:
    """Register :data:`IMPLEMENTATIONS` in ``transformers``; False where it is not imported."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None:
        return False
    for name, fn in IMPLEMENTATIONS.items():
        if name not in moe.ALL_EXPERTS_FUNCTIONS:
            moe.ExpertsInterface.register(name, fn)
    return True


def _implementation_attr(config) -> str:
    """The attribute behind the config's experts-implementation property (its setter would also
    overwrite sub-configs)."""
    internal = "_experts_implementation_internal"
    return internal if hasattr(config, internal) else "_experts_implementation"


def _modelled(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model`` whose layout the op models."""
    return [m for m in model.modules() if experts_layout_activation(m) is not None]


def _configs(modules: list[nn.Module]) -> dict:
    """``{id(config): config}`` of ``modules`` (modules may share a config)."""
    return {id(m.config): m.config for m in modules}


def set_experts_implementation(model: nn.Module, name: str) -> int:
    """Run the modelled experts modules of ``model`` with ``transformers``' experts implementation
    ``name`` (one of its own, or of :data:`IMPLEMENTATIONS`) from now on; how many configs changed."""
    if not _register_implementations():
        return 0
    configs = _configs(_modelled(model))
    for config in configs.values():
        setattr(config, _implementation_attr(config), name)
    return len(configs)


class UnmodelledExpertsWarning(UserWarning):
    """A ``transformers`` experts module keeps its own implementation and runs replicated."""


def _say_unmodelled(model: nn.Module) -> None:
    """One line per experts module the op does not model: which module, why, what happens."""
    for name, m in model.named_modules():
        if is_transformers_experts(m):
            why = unmodelled_layout(m)
            if why is not None:
                warnings.warn(
                    f"hidup: experts module {name or type(m).__name__} runs replicated on every rank, "
                    f"with transformers' own implementation: {why}",
                    UnmodelledExpertsWarning,
                    stacklevel=3,
                )


@contextlib.contextmanager
def routed_experts_as_custom_op(model: nn.Module) -> Iterator[int]:
    """While active, the ``transformers`` experts modules of ``model`` run :func:`routed_experts`.

    Yields how many experts modules were switched; restores each config's implementation on exit.
    A model without ``transformers`` experts is left untouched.
    """
    if not _register_implementations():
        yield 0
        return
    modelled = _modelled(model)
    _say_unmodelled(model)
    configs = _configs(modelled)
    saved = {}
    try:
        for key, config in configs.items():
            attr = _implementation_attr(config)
            saved[key] = (attr, getattr(config, attr))
            _PREVIOUS[key] = config._experts_implementation
            setattr(config, attr, _IMPLEMENTATION)
        yield len(modelled)
    finally:
        for key, config in configs.items():
            if key in saved:
                setattr(config, *saved[key])
            _PREVIOUS.pop(key, None)


# --------------------------------------------------------------------------- rules
def _bound(ctx: RuleContext) -> dict:
    b = bind(ctx.args, ctx.kwargs, _NAMES, where="routed_experts")
    if len(ctx.inputs) != 5 or not isinstance(b.get("expert_offset"), int) or b.get("act") not in ACTIVATIONS:
        raise Unsupported("routed_experts: expected five tensors, an int expert_offset and a known activation")
    return b


def _experts_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    b = _bound(ctx)
    if sig.impl == "all_to_all":  # mesh_axis: set by localize_mesh on a mesh (hidup.rules.dispatch)
        args = tuple(b[n] for n in _NAMES[:5]) + (b["act"],)
        return LocalCall(routed_experts_all_to_all, args, {"mesh_axis": None})
    offset = b["expert_offset"]
    if sig.inputs[3].is_gather:  # expert signature: rank r holds experts [r E/N, (r+1) E/N)
        offset += rank * (ctx.inputs[3].shape[0] // ctx.world)
    return LocalCall(torch.ops.hidup.routed_experts.default, tuple(b[n] for n in _NAMES[:5]) + (offset, b["act"]), {})


def _experts_typical(ctx: RuleContext, tensors: list) -> list:
    """Balanced routing for timing: slot ``j`` of token ``t`` goes to expert ``(t k + j) mod E`` (all
    ``E`` experts of the layer), so every expert gets ``T k / E`` rows and a token's slots differ."""
    x, idx, w, gate_up, down = tensors
    experts = ctx.inputs[3].shape[0]
    flat = torch.arange(idx.numel(), device=idx.device, dtype=idx.dtype) % experts
    return [x, flat.view(idx.shape), w, gate_up, down]


@register(
    torch.ops.hidup.routed_experts.default,
    routed_experts,
    name="routed_experts",
    localize=_experts_localize,
    typical=_experts_typical,
    # ranks run the differentiable grouped math, not the opaque op: inductor compiles it with the
    # step and autograd keeps its activations instead of running the forward again
    kernel=routed_experts_math,
)
def _routed_experts_rule(ctx: RuleContext) -> list[Signature]:
    b = _bound(ctx)
    x, idx, _, gate_up, down = ctx.inputs
    tokens, hidden = x.shape
    k = idx.shape[1]
    experts, ffn = gate_up.shape[0], down.shape[2]
    n = ctx.world
    flops = 6.0 * tokens * k * hidden * ffn
    sigs = [all_full(ctx, flops)]
    if tokens % n == 0:
        g = gather(0)
        sigs.append(Signature((g, g, g, FULL, FULL), (g,), flops / n, "data"))
    if experts % n == 0:
        g = gather(0)
        sigs.append(Signature((FULL, FULL, FULL, g, g), (REDUCE,), flops / n, "expert", "local_experts"))
        if tokens % n == 0 and b["expert_offset"] == 0:
            sigs.append(Signature((g,) * 5, (g,), flops / n, "expert", "all_to_all"))
    return sigs


@register(torch.topk, "topk", name="topk")
def _topk(ctx: RuleContext) -> list[Signature]:
    b = bind(ctx.args, ctx.kwargs, ["input", "k", "dim", "largest", "sorted"], {"dim": -1}, where="topk")
    x = ctx.inputs[0]
    nd = len(x.shape)
    if nd == 0 or len(ctx.inputs) != 1 or len(ctx.outputs) != 2:
        raise Unsupported("topk: expected one tensor of at least one dim and (values, indices)")
    d = b["dim"] % nd
    tin = [f"d{i}" for i in range(nd)]
    tout = list(tin)
    tout[d] = "k"
    return shard_signatures(
        [tin],
        [tout, tout],
        ctx.inputs,
        ctx.outputs,
        ctx.world,
        float(math.prod(x.shape)),
        fixed={tin[d], "k"},
        where="topk",
    )
