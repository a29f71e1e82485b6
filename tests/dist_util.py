"""Run a function on N gloo (or NCCL) ranks in fresh processes and collect what each rank returns.

``run_distributed(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` ranks started by
the runtime's own launcher (:func:`hidup.runtime.launch.run_ranks`, the one ``hidup train`` uses):
processes spawned afresh, joined into one gloo process group through a TCP store that this process
hosts on a free port (no port races), and returns the list of results by rank.  An exception on any
rank is re-raised here as :class:`DistributedFailure` with that rank's traceback; the other ranks
are stopped.  Nothing can hang: the process group has a timeout and the whole run a deadline, past
which the ranks print their Python stacks and are killed.  Results travel pickled (tensors by
value), so they survive the worker's exit.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hidup.runtime.launch import Distributed, LaunchError, Layout, run_ranks


class DistributedFailure(RuntimeError):
    """A rank raised (the message carries its traceback), died, or the run passed its deadline."""


def device() -> torch.device:
    """The device of this rank: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _call(ctx: Distributed, fn, args):
    torch.set_num_threads(1)
    return fn(ctx.rank, ctx.world_size, *args)


def run_distributed(
    fn,
    world: int,
    *args,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    env: dict | None = None,
    backend: str = "gloo",
):
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` computed on ``world`` ranks
    (gloo; or NCCL with ``backend="nccl"``, rank r on GPU ``r``), with ``env`` set in each rank.

    ``fn`` must be importable (a module-level function).  ``timeout`` bounds the whole run,
    ``pg_timeout`` each collective (so a dead rank makes the others fail fast)."""
    layout = Layout(world, 1, world, 0, "127.0.0.1", 0)  # port 0: the launcher hosts the store on a free port
    deadline = time.monotonic() + timeout

    def stalled() -> str | None:
        return f"the run did not finish in {timeout} s" if time.monotonic() > deadline else None

    try:
        return run_ranks(
            _call,
            (fn, args),
            layout,
            backend=backend,
            timeout_s=pg_timeout,
            env=env,
            stalled=stalled,
            user_errors=False,
        )
    except LaunchError as e:
        raise DistributedFailure(f"{fn.__name__} on {world} ranks: {e}") from None


def adam_reference(model, inputs, steps: int, lr: float) -> dict:
    """One device's ``steps`` Adam steps of ``model`` on ``inputs``: each step's loss and gradients and
    the final weights, the reference a distributed run's parity is checked against."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between the tensors ``a`` and ``b`` hold under ``b``'s names
    (names ``a`` lacks or holds as None are left out)."""
    return max(float((a[k] - b[k]).abs().max()) for k in b if a.get(k) is not None)
