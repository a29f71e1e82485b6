"""Duplication on or off, decided by timing both (``hidup train --duplication auto``).

The search decides duplication with the cost model.  Where the two modes are close -- a fast network
hides little communication, and half-batch kernels cost a little more than half -- the model can
misjudge which one is faster by the few percent that separate them.  :func:`choose_duplication`
settles it the way :class:`hidup.codegen.graphs.GraphedStep` settles graph against eager replay: it
compiles the plan without and with duplication, times ``trials`` training steps of each as training
runs them (forward and backward as one CUDA graph when ``cuda_graphs``, else eagerly; the optimizer
step is the same in both modes and is not run), and keeps the faster.  The slowest rank's medians
decide, so every rank keeps the same mode.  The plan's own mode is kept unless the other is faster
by more than ``margin`` (noise does not flip it).

The trial changes no parameter (no optimizer step runs) and leaves no gradient.  Only one compiled
module lives at a time, so the trial needs no more memory than training.  A plan whose batch cannot
be halved (an odd batch) runs without duplication and says so.

:func:`choose_compile` settles ``hidup train --compile auto`` the same way on the module the
duplication trial kept: eager steps, then one compiling step (its wall time is the reported
compilation time; torch's compile caches make a rerun of the same program cheaper), then compiled
steps, and the compiled program is kept only when faster by more than ``margin``.

How a trial times (``cuda_graphs``, ``autocast_dtype``, ``trials``, ``warmup``, ``margin``) is a
:class:`TrialOptions`, which each of these functions takes whole or as keywords; their other keywords
go to :func:`hidup.codegen.compile`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from hidup.codegen.graphs import GraphedStep
from hidup.codegen.mesh import MeshGroups
from hidup.codegen.rewrite import CompileError, compile
from hidup.codegen.timing import Stopwatch, max_over_ranks, median_seconds
from hidup.optionset import OptionSet

__all__ = ["TrialOptions", "choose_duplication", "time_modes", "choose_compile", "compile_step"]


@dataclass(frozen=True)
class TrialOptions(OptionSet):
    """How a trial times its modes (module docstring): ``trials`` timed forward + backward steps
    after ``warmup`` untimed ones (at least one each), captured as one CUDA graph when
    ``cuda_graphs`` (on CUDA), under autocast to ``autocast_dtype`` (None: none); the mode the plan (or
    eager) does not pick is kept only when faster by more than ``margin``."""

    cuda_graphs: bool = True
    autocast_dtype: torch.dtype | None = None
    trials: int = 5
    warmup: int = 2
    margin: float = 0.02
    WHAT = "trial"

    def timing(self) -> dict:
        """The keywords of :func:`_timed`."""
        return dict(
            cuda_graphs=self.cuda_graphs,
            autocast_dtype=self.autocast_dtype,
            trials=max(1, self.trials),
            warmup=max(1, self.warmup),
        )


def _split(options: TrialOptions | None, changes: dict) -> tuple[TrialOptions, dict]:
    """``(trial options, compile keywords)``: ``options`` updated by the keywords of ``changes`` that
    name a :class:`TrialOptions` field; the others are :func:`hidup.codegen.compile`'s."""
    names = {f.name for f in fields(TrialOptions)}
    trial = TrialOptions.of(options, **{k: v for k, v in changes.items() if k in names})
    return trial, {k: v for k, v in changes.items() if k not in names}


def _timed(module, inputs, *, cuda_graphs: bool, autocast_dtype, trials: int, warmup: int) -> float:
    """Median seconds of ``trials`` forward + backward steps of ``module`` on ``inputs``."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    step = GraphedStep(
        module, inputs, autocast_dtype=autocast_dtype, warmup=warmup, enabled=cuda_graphs and device.type == "cuda"
    )
    try:
        if not step.enabled:  # a captured step warmed up before its capture
            for _ in range(warmup):
                step(*inputs)
        return median_seconds(lambda: step(*inputs), device, trials)
    finally:
        step.release()
        for p in module.parameters():
            p.grad = None


def _release_copy_groups(module, group, compile_kwargs: dict) -> None:
    """Destroy the copy communicators :func:`hidup.codegen.compile` created for ``module`` (a module
    being dropped); groups the caller passed in (``copy_groups``) are the caller's to keep."""
    if compile_kwargs.get("copy_groups") is not None:
        return
    owned = [
        g
        for g in (getattr(module, "copy_groups", None) or ())
        if g is not None and g is not group and g is not dist.group.WORLD and not isinstance(g, MeshGroups)
    ]  # a mesh's groups are cached for the modules that follow (hidup.codegen.mesh)
    for g in {id(g): g for g in owned}.values():
        dist.destroy_process_group(g)


def _time_both(model, plan, rank: int, world_size: int, inputs: tuple, group, timing: dict, compile_kwargs: dict):
    """``(off_s, on_s, on, why)``: ``plan`` compiled without duplication, timed and dropped, then
    compiled with it and timed (the slowest rank's medians).  ``on`` is the duplicated module, kept
    for the caller; when the batch does not halve (the same on every rank) ``on_s`` and ``on`` are
    None and ``why`` says why."""
    kw = dict(compile_kwargs, group=group)
    off = compile(model, plan, rank, world_size, inputs, duplication=False, **kw)
    device = next((p.device for p in off.parameters()), torch.device("cpu"))
    off_s = _timed(off, inputs, **timing)
    del off  # one compiled module at a time
    on = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compile's warning is this function's reason below
            on = compile(model, plan, rank, world_size, inputs, duplication=True, **kw)
        if not on.duplication:
            raise CompileError("the copies' losses would not add up to this batch's loss (hidup.copies)")
        on_s = _timed(on, inputs, **timing)
    except (CompileError, ValueError) as e:
        if on is not None:
            _release_copy_groups(on, group, compile_kwargs)
        return max_over_ranks([off_s], group, device)[0], None, None, str(e)
    on_s, off_s = max_over_ranks([on_s, off_s], group, device)
    return off_s, on_s, on, ""


def time_modes(
    model,
    plan,
    rank: int,
    world_size: int,
    example_inputs,
    options: TrialOptions | None = None,
    *,
    group=None,
    **changes,
) -> dict:
    """``{"off_s", "on_s"}``: median seconds of a forward + backward step of ``plan`` compiled without
    and with duplication, timed as :func:`choose_duplication` times them (the slowest rank's medians;
    ``on_s`` is None when the batch does not halve).  ``options`` (:class:`TrialOptions`) are updated by
    the keyword ``changes`` that name one; the other keywords go to :func:`hidup.codegen.compile`.
    Keeps no module: each is dropped after its timing, with the copy communicators it created.  Every
    rank of ``group`` must call this."""
    trial, compile_kwargs = _split(options, changes)
    off_s, on_s, on, _ = _time_both(
        model, plan, rank, world_size, tuple(example_inputs), group, trial.timing(), compile_kwargs
    )
    if on is not None:
        _release_copy_groups(on, group, compile_kwargs)
    return {"off_s": off_s, "on_s": on_s}


def choose_duplication(
    model,
    plan,
    rank: int,
    world_size: int,
    example_inputs,
    options: TrialOptions | None = None,
    *,
    group=None,
    **changes,
):
    """``(module, info)``: ``plan`` compiled (:func:`hidup.codegen.compile`) in the faster of its two
    modes, and ``info = {"duplication": bool, "trial": {"on_s", "off_s"}, "reason": str}`` (see the
    module docstring).  ``example_inputs`` are the inputs of the timed steps (the global batch, as
    for ``compile``); ``options`` (:class:`TrialOptions`) are updated by the keyword ``changes`` that
    name one, and the other keywords go to ``compile``.  Every rank of ``group`` must call this."""
    trial, compile_kwargs = _split(options, changes)
    inputs = tuple(example_inputs)
    planned = bool(getattr(plan, "duplication", False))

    def single():
        return compile(model, plan, rank, world_size, inputs, duplication=False, group=group, **compile_kwargs)

    off_s, on_s, on, why = _time_both(model, plan, rank, world_size, inputs, group, trial.timing(), compile_kwargs)
    if on is None:
        return single(), {
            "duplication": False,
            "trial": {"off_s": off_s},
            "reason": f"duplication cannot run this batch ({why}); running one copy",
        }
    margin = trial.margin
    keep_on = on_s <= off_s * (1.0 + margin) if planned else on_s * (1.0 + margin) < off_s
    chosen = "on" if keep_on else "off"
    info = {
        "duplication": keep_on,
        "trial": {"on_s": on_s, "off_s": off_s},
        "reason": f"duplication {chosen} (trial: on {on_s * 1e3:.2f} ms, off {off_s * 1e3:.2f} ms per forward + "
        f"backward; the plan says {'on' if planned else 'off'})",
    }
    if keep_on:
        return on, info
    _release_copy_groups(on, group, compile_kwargs)
    del on
    return single(), info


def compile_step(module, inputs, *, autocast_dtype=None, graphed: bool = False) -> float:
    """Wall seconds of one forward + backward of ``module`` that compiles it (dynamo, AOTAutograd and the
    backend, forward and backward graphs); leaves no gradient.  ``graphed``: under the autocast a
    captured step runs (weight-cast cache off), so the steps that follow find the compiled graphs their
    guards accept.  Every rank of the module's group calls it."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    with Stopwatch(device) as watch:
        cast = (
            torch.autocast(device.type, dtype=autocast_dtype, cache_enabled=not graphed)
            if autocast_dtype
            else contextlib.nullcontext()
        )
        with cast:
            loss = module(*inputs)
        loss.backward()
    for p in module.parameters():
        p.grad = None
    return watch.seconds


def choose_compile(
    module, example_inputs, options: TrialOptions | None = None, *, group=None, backend: str = "inductor", **changes
) -> dict:
    """Keep ``module`` (a :class:`hidup.codegen.HidupModule`) compiled with ``backend`` or eager, whichever
    runs a forward + backward faster (``hidup train --compile auto``), timed as :func:`choose_duplication`
    times its modes, by ``options`` (:class:`TrialOptions`) updated by the keyword ``changes``:
    ``trials`` steps, captured as a CUDA graph when ``cuda_graphs``, the slowest rank's medians
    deciding; compiled is kept only when faster by more than ``margin``.  Returns ``{"compile":
    bool, "compile_s": seconds of the compiling step, "trial": {"eager_s", "compiled_s"}, "reason"}``.
    Every rank of ``group`` must call this; the module is left in the chosen mode with no gradient."""
    trial = TrialOptions.of(options, **changes)
    cuda_graphs, margin = trial.cuda_graphs, trial.margin
    inputs = tuple(example_inputs)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    timing = trial.timing()
    module.set_compile(None)
    eager_s = _timed(module, inputs, **timing)
    module.set_compile(backend)
    compile_s = compile_step(module, inputs, autocast_dtype=trial.autocast_dtype, graphed=cuda_graphs)
    compiled_s = _timed(module, inputs, **timing)
    eager_s, compiled_s, compile_s = max_over_ranks([eager_s, compiled_s, compile_s], group, device)
    keep = compiled_s * (1.0 + margin) < eager_s
    if not keep:
        module.set_compile(None)
    return {
        "compile": keep,
        "compile_s": compile_s,
        "trial": {"eager_s": eager_s, "compiled_s": compiled_s},
        "reason": f"compile {'on' if keep else 'off'} (trial: {backend} {compiled_s * 1e3:.2f} ms, eager "
        f"{eager_s * 1e3:.2f} ms per forward + backward{', as CUDA graphs' if cuda_graphs else ''}; "
        f"compiling took {compile_s:.1f} s)",
    }
