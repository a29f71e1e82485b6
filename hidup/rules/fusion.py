"""What a compiler makes of each traced op: no kernel, part of a fused kernel, or a kernel of its own.

When the rank program runs through inductor (``torch.compile``), the traced ops do not each launch
a kernel.  Three kinds:

* ``view``: a reshape of the same storage (``view``, ``transpose``, ``slice`` ...).  Inductor folds it
  into the indexing of whoever reads the tensor: no kernel, no bytes.
* ``fused``: pointwise ops, casts, normalizations and reductions.  Inductor fuses chains of them into
  one generated kernel, which reads the tensors that come from outside the chain and writes only the
  ones that leave it; what passes between two fused ops stays in registers.
* ``kernel``: everything else -- matmuls, attention, convolutions, and opaque custom ops -- runs its
  own library kernel (cuBLAS, flash attention, cuDNN, the op's implementation), reading its inputs
  from memory and writing its outputs to it.

:func:`fusion_kind` names the kind of a node's ``target`` (the IR's op name, ATen overload suffix
ignored); an op not listed here is a ``kernel``, which prices it like an eager op (never cheaper than
it can be).  The cost model (:mod:`hidup.search.cost`, "Compiled programs") turns the kinds into
the bytes a compiled program moves.
"""

from __future__ import annotations

__all__ = ["VIEW_OPS", "FUSED_OPS", "fusion_kind"]

# Reshapes and aliases of one storage (no data moves in a compiled program).
VIEW_OPS = frozenset(
    {
        "alias", "detach", "detach_", "expand", "expand_as", "flatten", "movedim", "moveaxis", "narrow",
        "permute", "reshape", "select", "slice", "split", "split_with_sizes", "chunk", "squeeze", "swapaxes",
        "swapdims", "t", "transpose", "unbind", "unflatten", "unsqueeze", "view", "view_as", "getitem",
    }
)  # fmt: skip

# Pointwise, cast, normalization and reduction ops that inductor generates fused kernels for.
FUSED_OPS = frozenset(
    {
        # pointwise arithmetic and activations
        "abs", "add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "log1p",
        "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "leaky_relu", "erf", "reciprocal", "square",
        "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "where", "masked_fill", "dropout", "tril",
        "triu", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not", "bitwise_not",
        # casts, copies and factories (a copy of a strided tensor is a fused read-then-write)
        "to", "type_as", "float", "half", "bfloat16", "clone", "contiguous", "cat", "pad", "arange", "zeros",
        "ones", "full", "zeros_like", "ones_like", "full_like", "empty", "empty_like",
        # normalizations, reductions, scans and the losses built from them
        "layer_norm", "rms_norm", "group_norm", "softmax", "log_softmax", "sum", "mean", "amax", "amin",
        "max", "min", "var", "std", "norm", "cumsum", "cross_entropy_loss", "nll_loss",
        # an embedding lookup is an indexed load, fused into its consumer
        "embedding",
    }
)  # fmt: skip


def fusion_kind(target: str) -> str:
    """``"view"``, ``"fused"`` or ``"kernel"`` for an IR op name (``add.Tensor`` -> ``add``'s kind)."""
    base = target.split(".", 1)[0]
    base = base if base in VIEW_OPS or base in FUSED_OPS else base.rstrip("_")  # in-place forms: div_
    if base in VIEW_OPS:
        return "view"
    if base in FUSED_OPS:
        return "fused"
    return "kernel"
