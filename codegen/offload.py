"""Optimizer offload (``plan.offload == "optimizer"``): Adam's state in host memory, stepped by the CPU.

Adam keeps, for every parameter ``W`` it steps, two moments of ``W``'s size; with the rank's weights,
their gradients and the activations they are what fills a device.  With the optimizer offloaded (as
DeepSpeed's ZeRO-Offload does) the device keeps only the weights the program reads and their
gradients; the host keeps, per stepped tensor ``W`` of ``B`` bytes (a parameter, or under ZeRO this
rank's rows of it, :mod:`hidup.codegen.zero`):

* ``H``, a copy of ``W`` in host memory (pinned when ``W`` is on a GPU) -- the tensor the optimizer
  steps (the fp32 master of the weights: the device's copy is the same float32 values, which the
  forward reads and autocast casts per op);
* ``G``, a host buffer for ``W``'s gradient, and the optimizer's moments of ``H``:
  ``(2 + 2) B`` bytes of host memory in all (Adam), none of them on the device.

One step (:meth:`OffloadedOptimizer.bind` hooks it around ``optimizer.step()``):

1. before the step, every gradient is copied to its host buffer, ``G = grad(W)`` (device to host on a
   side stream that waits for the backward's, one synchronisation for all), and ``H.grad = G``
   (``None`` where ``W`` has no gradient: the optimizer skips it, as it would ``W``);
2. the optimizer -- any ``torch.optim`` optimizer over :meth:`OffloadedOptimizer.optimizer_parameters`,
   on the CPU: torch's ``Adam``/``AdamW`` with ``fused=True`` where the CPU kernel exists
   (:func:`host_adam`) -- steps ``H``;
3. after the step, ``W = H`` (host to device, asynchronous from pinned memory, ordered before the next
   forward on the device's stream).

The update is the one the device's optimizer computes (the same torch optimizer on the same values):
on the CPU in float64 a run trains exactly as on one device (``tests/test_offload.py``).  Bytes moved
per step and rank: ``B`` device to host and ``B`` host to device per stepped tensor; the search prices
them and the CPU's step (:meth:`hidup.profiler.Profile.offload_time`), one after the other.

Clipping (:func:`hidup.codegen.grads.clip_grad_norm_`) scales the device's gradients before
``step()``, so the host receives the clipped ones.  A loss scaler (fp16) unscales the gradients the
optimizer holds before ``step()``, which here reach the host only inside it: fp16 is refused with
offload (``hidup train``).  The copies and the CPU's step are host work that a CUDA graph cannot hold:
a step with offload runs uncaptured.  After the device's weights change by other means (a checkpoint
loaded into the module) :meth:`OffloadedOptimizer.pull` copies them to the host
(:func:`hidup.runtime.checkpoint.load` does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["HostCopy", "OffloadedOptimizer", "host_adam"]


@dataclass
class HostCopy:
    """One stepped tensor: ``stepped`` on the device (a parameter or a ZeRO slice), ``host`` its copy the
    optimizer steps, ``grad`` the host buffer its gradient is copied into."""

    stepped: nn.Parameter
    host: nn.Parameter
    grad: torch.Tensor


def _host_empty(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``t``, pinned when ``t`` is on a GPU (so copies run asynchronously)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")


class OffloadedOptimizer:
    """The host copies of the tensors an optimizer of a module steps (module docstring): ``stepped`` as
    :meth:`hidup.codegen.rewrite.HidupModule.optimizer_parameters` gives them without offload."""

    def __init__(self, stepped: list[nn.Parameter]):
        self.copies: list[HostCopy] = []
        for p in stepped:
            host = nn.Parameter(_host_empty(p).copy_(p.detach()), requires_grad=True)
            self.copies.append(HostCopy(p, host, _host_empty(p)))
        self.by_device = {id(c.stepped): c for c in self.copies}
        cuda = [c.stepped.device for c in self.copies if c.stepped.device.type == "cuda"]
        self.stream = torch.cuda.Stream(cuda[0]) if cuda else None
        self._hooks = []

    def __bool__(self) -> bool:
        return bool(self.copies)

    def optimizer_parameters(self, stepped: list[nn.Parameter]) -> list[nn.Parameter]:
        """The host copies of ``stepped`` (what the optimizer steps in their place)."""
        return [self.by_device[id(p)].host for p in stepped]

    def host_of(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy of stepped tensor ``t`` (``t`` itself when it has none)."""
        c = self.by_device.get(id(t))
        return t if c is None else c.host

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the gradients to the host before every ``optimizer.step()`` and the weights back after it."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.to_host()))
        self._hooks.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.to_device()))

    def to_host(self) -> None:
        """Every stepped tensor's gradient into its host buffer, ``host.grad`` that buffer (None without one)."""
        with torch.no_grad():
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                for c in self.copies:
                    g = c.stepped.grad
                    c.host.grad = None if g is None else c.grad.copy_(g, non_blocking=self.stream is not None)
            if self.stream is not None:
                self.stream.synchronize()

    def to_device(self) -> None:
        """Every stepped tensor made its updated host copy (asynchronous from pinned memory)."""
        with torch.no_grad():
            for c in self.copies:
                c.stepped.copy_(c.host, non_blocking=c.stepped.device.type == "cuda")

    def pull(self) -> None:
        """Every host copy made its stepped tensor's value (after the device's weights were loaded)."""
        with torch.no_grad():
            for c in self.copies:
                c.host.copy_(c.stepped)


def host_adam(params: list[nn.Parameter], lr: float, **kwargs) -> torch.optim.Adam:
    """torch's Adam over host tensors: the fused CPU kernel where this torch has it, else ``foreach``."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # a torch or a dtype without the fused CPU kernel
        return torch.optim.Adam(params, lr=lr, foreach=True, **kwargs)
