"""Code generation: autograd-aware collectives, the per-rank program, duplication, gradient sync.

Folder codegen/, imported as ``hidup.codegen``; layer ``codegen`` (reads plans, below the runtime;
docs/design.md, "Map").

module = hidup.compile(model, plan, rank, world_size, example_inputs)
hidup.clip_grad_norm_(module, 1.0)
state = hidup.full_state_dict(module)      # logical (unsharded) parameters, on every rank
step = hidup.graphed_step(module, batch)   # forward + backward as one CUDA graph (eager on CPU)
module, info = hidup.codegen.choose_duplication(model, plan, rank, world_size, batch)  # faster mode, timed
"""

from hidup.codegen.grads import GradBucketer, clip_grad_norm_
from hidup.codegen.graphs import GraphCaptureError, GraphedStep, graphed_step
from hidup.codegen.params import ParamShard, full_state_dict, load_full_state_dict
from hidup.codegen.rewrite import CompileError, CompileOptions, HidupModule, compile
from hidup.codegen.trial import choose_duplication

__all__ = [
    "compile",
    "CompileOptions",
    "HidupModule",
    "CompileError",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "ParamShard",
    "GradBucketer",
    "GraphedStep",
    "graphed_step",
    "GraphCaptureError",
    "choose_duplication",
]
