"""Rule registry and argument helpers shared by every op family.

Targets are looked up by identity: a function (``torch.nn.functional.linear``, ``operator.add``),
a method name (``"view"`` for fx ``call_method`` nodes, also reachable as ``torch.Tensor.view``) or,
for ``call_module`` leaves, the module's class (searched along its MRO).

Tensor inputs of a node are the :class:`TensorMeta` values of ``(ctx.args, ctx.kwargs)`` in the
order ``torch.fx.node.map_aggregate`` visits them: positional args first (lists/tuples element by
element), then keyword args in insertion order.  :func:`tensor_slots` reproduces that order in terms
of parameter names so that a rule can say which role each ``ctx.inputs[i]`` plays.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from hidup.ir import FULL, Signature
from hidup.rules.base import LocalCall, Rule, RuleContext, TensorMeta

__all__ = [
    "Unsupported",
    "register",
    "register_module",
    "lookup",
    "lookup_module",
    "callable_of",
    "bind",
    "tensor_slots",
    "is_tensor_value",
    "default_localize",
    "all_full",
    "FLOAT_DTYPES",
]

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")

_RULES: dict[Any, Rule] = {}
_MODULE_RULES: dict[type, Rule] = {}


class Unsupported(Exception):
    """A rule cannot handle this particular call (an argument pattern it does not model).

    :func:`hidup.rules.signatures` turns it into ``None``: the op is replicated with a warning.
    """


def register(
    *targets: Any,
    name: str | None = None,
    localize: Callable[[RuleContext, Signature, int], LocalCall] | None = None,
    variant: Callable[[RuleContext], str] | None = None,
    typical: Callable[[RuleContext, list], list] | None = None,
    kernel: Callable | None = None,
):
    """Decorator: register ``fn(ctx) -> list[Signature]`` as the rule of every target (``localize``,
    ``variant``, ``typical`` and ``kernel``: :class:`~hidup.rules.base.Rule`).

    A string target ``"view"`` also registers ``torch.Tensor.view`` (a ``call_function`` on the
    unbound method behaves like the ``call_method``).
    """

    def deco(fn):
        rule = Rule(name or fn.__name__, fn, localize, variant, typical, kernel)
        for t in targets:
            _RULES[t] = rule
            if isinstance(t, str) and hasattr(torch.Tensor, t):
                _RULES[getattr(torch.Tensor, t)] = rule
        return fn

    return deco


def register_module(cls: type, rule: Rule) -> None:
    _MODULE_RULES[cls] = rule


def lookup(target: Any) -> Rule | None:
    try:
        return _RULES.get(target)
    except TypeError:  # unhashable target
        return None


def lookup_module(module: Any) -> Rule | None:
    cls = module if isinstance(module, type) else type(module)
    for c in cls.__mro__:
        if c in _MODULE_RULES:
            return _MODULE_RULES[c]
    return None


def callable_of(target: Any) -> Callable:
    """The plain callable for an fx target: a method name becomes the unbound ``torch.Tensor`` method."""
    if isinstance(target, str):
        fn = getattr(torch.Tensor, target, None)
        if fn is None:
            raise ValueError(f"torch.Tensor has no method {target!r}; cannot build a local call for it")
        return fn
    return target


def default_localize(ctx: RuleContext, sig: Signature, rank: int) -> LocalCall:
    """Run the original op unchanged on the local pieces."""
    if ctx.module is not None:
        return LocalCall(ctx.module, tuple(ctx.args), dict(ctx.kwargs))
    return LocalCall(callable_of(ctx.target), tuple(ctx.args), dict(ctx.kwargs))


def is_tensor_value(v: Any) -> bool:
    """A tensor slot: TensorMeta while planning, a real tensor or an fx Node while localizing."""
    if isinstance(v, (TensorMeta, torch.Tensor)):
        return True
    return type(v).__name__ == "Node" and type(v).__module__.startswith("torch.fx")


def bind(args: Iterable, kwargs: dict, names: list[str], defaults: dict | None = None, where: str = "") -> dict:
    """Map positional and keyword arguments onto parameter ``names``; unknown ones raise Unsupported."""
    args = tuple(args)
    out = dict(defaults or {})
    if len(args) > len(names):
        raise Unsupported(f"{where}: {len(args)} positional arguments, expected at most {len(names)} ({names})")
    for n, v in zip(names, args):
        out[n] = v
    for k, v in kwargs.items():
        if k not in names:
            raise Unsupported(f"{where}: unexpected keyword argument {k!r}")
        out[k] = v
    return out


def tensor_slots(args: Iterable, kwargs: dict, names: list[str], rest: str = "*") -> list[tuple[str, int | None]]:
    """(parameter name, element index or None) of every TensorMeta, in map_aggregate order.

    Positional args beyond ``names`` are named ``rest``; their element index is their position
    among those extra args.
    """
    slots: list[tuple[str, int | None]] = []
    args = tuple(args)

    def visit(name, v, idx):
        if isinstance(v, TensorMeta):
            slots.append((name, idx))
        elif isinstance(v, (list, tuple)):
            for j, e in enumerate(v):
                if isinstance(e, TensorMeta):
                    slots.append((name, j))
                elif isinstance(e, (list, tuple, dict)):
                    raise Unsupported(f"nested tensor containers in argument {name!r}")

    for i, a in enumerate(args):
        if i < len(names):
            visit(names[i], a, None)
        else:
            visit(rest, a, i - len(names))
    for k, v in kwargs.items():
        visit(k, v, None)
    return slots


def all_full(ctx: RuleContext, flops: float) -> Signature:
    return Signature(tuple(FULL for _ in ctx.inputs), tuple(FULL for _ in ctx.outputs), float(flops), "replicated")
