"""Whole-step CUDA-graph capture of a training step's forward and backward.

A compiled rank program is many small ops, each dispatched from Python (form conversions, localized
ops, gradient-bucket hooks, and with duplication a two-stream stage runner).  On fast GPUs and a
fast network that host work, not the GPU, sets the iteration time.  :class:`GraphedStep` records
the whole forward + backward of one step -- every kernel, every NCCL collective, the gradient
buckets and both duplication streams -- into one CUDA graph and replays it, so a step costs one
graph launch on the host:

    step = hidup.graphed_step(module, example_inputs)     # warm-up and capture happen here
    for batch in data:
        loss = step(*batch)        # this step's loss (detached); p.grad holds this step's gradients
        optimizer.step()           # any optimizer, eager (or clip first: hidup.clip_grad_norm_)

Semantics of one call: every parameter gradient is *overwritten* with this step's gradient (as if
``zero_grad()`` had been called before ``loss.backward()``); gradient accumulation across calls is
not supported (accumulate in the optimizer step, or run eagerly).  ``zero_grad(set_to_none=True)``
between steps is harmless: the gradients are re-attached after each replay.  Inputs are copied
into static buffers, so each call's inputs must have the shapes and dtypes of the example inputs
(a clear error says otherwise).

Requirements for capture (checked or documented): CUDA, static shapes (the zoo's models and every
plan hidup compiles have them: the tracer refuses data-dependent shapes), no host synchronization in
the step, and every process group used in the step already initialized (the warm-up runs each
collective once before capture).  ``autocast`` runs with its weight-cast cache disabled, which
graph capture requires.  On a CPU, or with ``enabled=False``, the same object runs the step eagerly
with the same semantics, so training code does not branch.

With ``optimizer=`` the optimizer step joins the step (and the graph): each call runs forward,
backward and ``optimizer.step()``, warm-up steps included (they are real updates).  The optimizer
must be capturable on CUDA (``torch.optim.Adam(..., fused=True, capturable=True)``).

A ``torch.compile``'d module (:mod:`hidup.codegen.compiled`) is captured the same way: its first
warm-up step compiles it, and the capture replays the compiled kernels.

Release: :meth:`GraphedStep.release` frees the graph; it must run before any process group the
step uses is destroyed (NCCL forbids destroying a communicator that a live graph still uses).

Cost and memory: the graph keeps the step's activations and gradients in a private memory pool
(they are reused by every replay, so peak memory is that of one eager step), and capture costs
``warmup + 1`` eager steps once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hidup.codegen.rewrite import device_of
from hidup.codegen.timing import max_over_ranks, median_seconds
from hidup.errors import UserError

__all__ = ["GraphedStep", "graphed_step", "GraphCaptureError"]


class GraphCaptureError(UserError, RuntimeError):
    """The step could not be captured as a CUDA graph (names the cause and the fallback)."""


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


class GraphedStep:
    """Forward + backward of ``module`` (which returns a scalar loss) as one replayable CUDA graph.

    ``module(*inputs)`` must return the loss to differentiate (a :class:`hidup.codegen.HidupModule`
    returns this rank's part of the loss).  ``autocast_dtype`` (``torch.bfloat16``/``float16``)
    runs the forward under autocast.  ``warmup`` eager steps precede the capture (NCCL communicators
    and autograd state are created there).  ``enabled=None`` captures on CUDA and runs eagerly
    elsewhere.  ``choose=True`` times ``trials`` eager steps before the capture (so that an eager
    step never runs beside the graph's reserved memory) against as many replays after it and keeps
    the faster mode (agreed over ``group``, the default group when ``None``):
    a graph removes host dispatch, but over a slow network a replayed graph can interleave two
    duplicated copies less well than eager launches do, so neither mode always wins.

    ``optimizer`` (capturable, e.g. :func:`fused_adam`) joins the step: every call then also updates
    the parameters, and the graph holds the update too.  The warm-up and trial steps, which step it,
    leave the parameters and the optimizer's state as they found them: both are copied before and
    written back in place afterwards (the graph keeps their addresses); state the warm-up created is
    zeroed, which is the fresh state of Adam and AdamW (moments and step count zero)."""

    def __init__(
        self,
        module: nn.Module,
        example_inputs,
        *,
        autocast_dtype=None,
        warmup: int = 3,
        enabled: bool | None = None,
        capture_error_mode: str = "thread_local",
        choose: bool = False,
        trials: int = 5,
        group=None,
        optimizer=None,
    ):
        self.module = module
        self.optimizer = optimizer

        self.device = device_of(module)
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in module.parameters() if p.requires_grad]
        examples = tuple(example_inputs)
        self._specs = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in examples]
        self.enabled = (self.device.type == "cuda") if enabled is None else bool(enabled)
        if self.enabled and self.device.type != "cuda":
            raise GraphCaptureError(
                f"CUDA-graph capture needs the module on a CUDA device, it is on {self.device}; "
                f"pass enabled=False (or None) to run the step eagerly"
            )
        self.graph = None
        self._static_inputs: list = []
        self._static_loss: torch.Tensor | None = None
        self._static_grads: list = []
        self.grads_at_capture = "not captured"  # "none": autograd allocates them inside the capture
        self.timings: dict[str, float] = {}
        if self.enabled:
            before = self._snapshot()
            # eager steps are timed before the capture: once captured, the graph's memory pool stays
            # reserved, and an eager step beside it would need a second step's activations
            eager_s = self._time_eager(examples, max(1, int(warmup)), max(1, int(trials))) if choose else None
            self._capture(examples, max(1, int(warmup)), capture_error_mode)
            if choose:
                self._choose(examples, max(1, int(trials)), group, eager_s)
            self._restore(before)

    def _snapshot(self):
        """Copies of the parameters and of the optimizer's tensor state (None without an optimizer)."""
        if self.optimizer is None:
            return None
        state = {
            id(p): {k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
            for p, st in self.optimizer.state.items()
        }
        return [p.detach().clone() for p in self.params], state

    def _restore(self, before) -> None:
        """Write :meth:`_snapshot`'s copies back in place; zero optimizer state created since."""
        if before is None:
            return
        params, state = before
        with torch.no_grad():
            for p, saved in zip(self.params, params):
                p.copy_(saved)
            for p, st in self.optimizer.state.items():
                old = state.get(id(p), {})
                for k, v in st.items():
                    if torch.is_tensor(v):
                        v.copy_(old[k]) if k in old else v.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- eager path (CPU, or capture disabled): the same semantics
    def _eager(self, inputs) -> torch.Tensor:
        for p in self.params:
            p.grad = None
        with _autocast(self.device, self.autocast_dtype):
            loss = self.module(*inputs)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()

    def _capture(self, examples, warmup: int, mode: str) -> None:
        self._static_inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in examples]
        for x in self._static_inputs:
            if isinstance(x, torch.Tensor) and x.device != self.device:
                raise GraphCaptureError(
                    f"example input on {x.device} but the module is on {self.device}; move the inputs to {self.device}"
                )
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._eager(self._static_inputs)
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)
        for p in self.params:
            p.grad = None
        self.grads_at_capture = "none"
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode=mode):
                with _autocast(self.device, self.autocast_dtype):
                    loss = self.module(*self._static_inputs)
                loss.backward()
                if self.optimizer is not None:
                    self.optimizer.step()
        except Exception as e:
            raise GraphCaptureError(
                f"capturing the training step as a CUDA graph failed ({type(e).__name__}: {e}). The step must have "
                f"static shapes and no host synchronization (.item(), .cpu(), data-dependent shapes). Fix: remove "
                f"those from the model, or run eagerly (hidup train --cuda-graphs off, GraphedStep(enabled=False))"
            ) from e
        self.graph = graph
        self._static_loss = loss.detach()
        self._static_grads = [p.grad for p in self.params]
        torch.cuda.synchronize(self.device)

    def _time_eager(self, examples, warmup: int, trials: int) -> float:
        """Median seconds of ``trials`` eager steps after ``warmup`` untimed ones."""
        for _ in range(warmup):
            self._eager(examples)
        seconds = median_seconds(lambda: self._eager(examples), self.device, trials)
        for p in self.params:
            p.grad = None
        return seconds

    def _choose(self, examples, trials: int, group, eager_s: float) -> None:
        """Time ``trials`` replays against the eager steps timed before the capture (``eager_s``) and
        keep the faster (the slowest rank's medians decide, so every rank makes the same choice);
        eager frees the graph."""
        graph_s = median_seconds(lambda: self(*examples), self.device, trials)
        graph_s, eager_s = max_over_ranks([graph_s, eager_s], group, self.device)
        self.timings = {"graph_s": graph_s, "eager_s": eager_s}
        if eager_s < graph_s:
            self.release()
        elif self.optimizer is None:
            self(*examples)  # leave this step's gradients attached, as after any call

    @property
    def mode(self) -> str:
        """``graph`` (replaying a captured graph) or ``eager``."""
        return "graph" if self.graph is not None else "eager"

    def _check(self, inputs) -> None:
        if len(inputs) != len(self._specs):
            raise ValueError(f"the graphed step was captured with {len(self._specs)} inputs, got {len(inputs)}")
        for i, (x, spec) in enumerate(zip(inputs, self._specs)):
            if spec is None:
                continue
            if not isinstance(x, torch.Tensor) or (tuple(x.shape), x.dtype) != spec:
                got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"input {i}: the graphed step was captured for shape/dtype {spec}, got {got}; "
                    f"a CUDA graph replays fixed shapes (use a fixed batch shape, drop the last "
                    f"partial batch, or run eagerly: hidup train --cuda-graphs off)"
                )

    def __call__(self, *inputs) -> torch.Tensor:
        """One step: this step's loss (detached); every parameter's ``.grad`` holds its gradient."""
        self._check(inputs)
        if self.graph is None:
            return self._eager(inputs)
        for static, x in zip(self._static_inputs, inputs):
            if isinstance(static, torch.Tensor) and x is not static:
                static.copy_(x, non_blocking=True)
        begin_step = getattr(self.module, "begin_step", None)
        if begin_step is not None:  # the step whose random values the replay draws (hidup.rules.random)
            begin_step()
        self.graph.replay()
        for p, g in zip(self.params, self._static_grads):
            if p.grad is not g:
                p.grad = g
        return self._static_loss.clone()

    def release(self) -> None:
        """Free the graph and its memory pool; the step then runs eagerly.  Call it before
        destroying a process group the step communicates on: NCCL requires the graphs that use a
        communicator to be gone before the communicator is."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None
        self._static_loss, self._static_grads, self._static_inputs = None, [], []


def fused_adam(params, lr: float, device: torch.device, **kwargs) -> torch.optim.Adam:
    """Adam with the fused kernel, capturable on CUDA (so that :class:`GraphedStep` can hold its
    step); the multi-tensor (``foreach``) kernel where the fused one does not exist."""
    capturable = torch.device(device).type == "cuda"
    try:
        return torch.optim.Adam(params, lr=lr, fused=True, capturable=capturable, **kwargs)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.Adam(params, lr=lr, foreach=True, capturable=capturable, **kwargs)


def graphed_step(module: nn.Module, example_inputs, **kwargs) -> GraphedStep:
    """:class:`GraphedStep` of ``module`` (see the module docstring)."""
    return GraphedStep(module, example_inputs, **kwargs)
