"""Walking the values of a torch.fx trace: nested containers, meta copies, where a node came from."""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import torch
import torch.fx

__all__ = ["map_value", "value_leaves", "dtype_name", "to_meta", "module_of", "source_of", "target_name", "TORCH_DIR"]

TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


def map_value(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every leaf of nested tuple/list/dict/slice ``value`` (fx's visiting order),
    keeping tuple subclasses (named tuples, ``torch.return_types``) intact."""
    if isinstance(value, tuple):
        items = tuple(map_value(v, fn) for v in value)
        if hasattr(type(value), "n_fields"):  # torch.return_types.* (struct sequences)
            return type(value)(items)
        if hasattr(value, "_fields"):
            return type(value)(*items)
        return items
    if isinstance(value, list):
        return [map_value(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_value(v, fn) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(map_value(value.start, fn), map_value(value.stop, fn), map_value(value.step, fn))
    return fn(value)


def value_leaves(value: Any, kind: type) -> list:
    found: list = []
    map_value(value, lambda v: found.append(v) if isinstance(v, kind) else None)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_meta(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        return t
    m = torch.empty_like(t, device="meta")
    return m.requires_grad_(True) if t.requires_grad else m


def module_of(n: torch.fx.Node) -> str:
    stack = n.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def source_of(n: torch.fx.Node) -> str:
    """The innermost user (non-torch) frame of the node's recorded stack, as file:line."""
    frames = [f for f in _FRAME_RE.findall(n.stack_trace or "") if not f[0].startswith(TORCH_DIR)]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def target_name(n: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if n.op == "call_method":
        return str(n.target)
    if isinstance(n.target, torch._ops.OpOverload):  # aten.add.Tensor -> "add.Tensor", aten.linear.default -> "linear"
        return n.target.__name__.removesuffix(".default")
    return getattr(n.target, "__name__", None) or str(n.target)
