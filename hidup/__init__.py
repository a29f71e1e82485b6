"""hidup: automatic SPMD parallelism for PyTorch training.

Rooms (docs/design.md, "Map"): hidup.ir and hidup.rules, hidup.frontend, hidup.profiler (folder
profiler/), hidup.plan, hidup.search (search/), hidup.codegen (codegen/), hidup.runtime,
hidup.profiler.measure (profiler/measure/), hidup.cli.  Importing hidup is cheap: the names below
load their modules on first use.

import hidup
model, inputs = hidup.models.build("bert-sgmoe", world_size=4, layers=2)
graph = hidup.trace(model, inputs, world_size=4)
plan = hidup.search(graph, hidup.profiler.load("h200x4-nvlink"))
print(hidup.show(plan, graph))
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names, resolved on first use so that importing hidup stays cheap.
_LAZY = {
    "trace": ("hidup.frontend.trace", "trace"),
    "trace_module": ("hidup.frontend.trace", "trace_module"),
    "describe": ("hidup.frontend.describe", "describe"),
    "search": ("hidup.search", "search"),
    "Plan": ("hidup.plan", "Plan"),
    "show": ("hidup.plan", "summary"),
    "compile": ("hidup.codegen", "compile"),
    "clip_grad_norm_": ("hidup.codegen", "clip_grad_norm_"),
    "full_state_dict": ("hidup.codegen", "full_state_dict"),
    "graphed_step": ("hidup.codegen", "graphed_step"),
}
_SUBMODULES = {"models", "profiler", "rules", "ir", "frontend", "plan", "codegen", "runtime"}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"hidup.{name}")
    raise AttributeError(f"module 'hidup' has no attribute {name!r}")
