"""PyTorch DistributedDataParallel, tuned: every parameter replicated, gradients averaged by DDP's
bucketed, backward-overlapped all-reduce, with ``gradient_as_bucket_view=True`` (the gradients are
views of the communication buckets: no copy in or out, less memory) and ``static_graph=True`` (the
same parameters are used every step, so DDP skips its per-step search for unused parameters and
can fix its bucket order after the first step).

Rank ``r`` runs groups ``r B/N .. (r+1) B/N - 1`` of the batch.  DDP averages gradients, so the
loop back-propagates ``N w_r L_r`` and the parameters see ``sum_r w_r dL_r/dw = dL/dw``
(see baseline_util.py).

Variants: ``compile`` compiles the DDP-wrapped model (``torch.compile(DDP(model))``, as torch's
DDP notes direct: TorchDynamo's DDPOptimizer then splits the graph at bucket boundaries so that
the all-reduces still overlap the backward).  For a captured step DDP is built on a side stream and
runs 11 eager steps before the capture, as torch's CUDA-graph notes require.

On torch's fake process group (one rank alone, ``harness.py --fake-world``) the all-reduce's future
carries no tensor, which DDP refuses; there a communication hook does the rank's own part of DDP's
default hook -- divide the bucket by the world size -- and hands the bucket back unreduced.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from exp.baselines.baseline_util import EAGER, Options, Prepared, compile_module

DDP_CAPTURE_WARMUP = 11  # eager DDP iterations torch requires before a CUDA-graph capture


def _local_average(world: int, bucket):  # no annotations: DDP compares them as objects
    """DDP's default hook without its all-reduce: the bucket divided by the world size, in a done future."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer().div_(world))
    return fut


def prepare(model: nn.Module, rank: int, world: int, device: torch.device, opts: Options = EAGER) -> Prepared:
    model.to(device)
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    # Buffers are identical on every rank (same seed): do not re-broadcast them every forward.
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else {"broadcast_buffers": False}
    )
    kwargs = dict(device_ids=ids, gradient_as_bucket_view=True, static_graph=True, **no_sync)
    if opts.graph and device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            module = DDP(model, **kwargs)
        torch.cuda.current_stream(device).wait_stream(side)
    else:
        module = DDP(model, **kwargs)
    if dist.get_backend() == "fake":
        module.register_comm_hook(world, _local_average)
    return Prepared(
        compile_module(module, opts),
        grads_averaged=True,
        capture_warmup=DDP_CAPTURE_WARMUP,
        info={
            "gradient_as_bucket_view": True,
            "static_graph": True,
            "compile": "DDP-wrapped model" if opts.compile else None,
        },
    )
