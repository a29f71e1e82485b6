"""Where a model comes from: a zoo name or the user's own factory, ``package.module:function``.

    model, inputs = hidup.models.build("mymodels:build_llama", world_size=2, layers=2)

A *factory* is a function returning ``(model, example_inputs)``: an ``nn.Module`` whose forward
returns the scalar loss, and its example inputs for the global batch -- a tensor, a tuple of
positional inputs or a dict of keyword inputs, as :func:`hidup.trace` takes them.  It is called
with the model's arguments as keyword arguments, plus

* ``world_size`` (the number of ranks) if it has a parameter of that name,
* ``device`` if it has a parameter of that name: where the model will run (the CPU when hidup only
  traces it, a rank's GPU when it trains); a factory without one builds on the CPU and the model
  and inputs are then moved.

It runs under ``torch.manual_seed(seed)`` (the global RNG state is restored afterwards), so every
rank that calls it gets the same weights and the same inputs.  ``package.module`` is imported
normally, with the current directory importable (as ``python -m`` makes it).  Dict inputs are
turned into the positional tuple of ``model.forward`` (parameters not given take their defaults),
so every consumer sees ``model(*inputs)``.

Every failure -- no such module, no such attribute, an argument the factory does not take, a
factory that raises or returns something else -- is a :class:`ModelSourceError` whose one-line
message names the spec, what went wrong and where.

A plan remembers its model as a *record* ``{"model": spec, "args": {...}}`` (JSON-able arguments
only; :func:`hidup.plan.model_record` checks them); :func:`recorded_source` reads it back, and
reads a plan written before records existed as its zoo name plus ``model_config``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback

import torch
import torch.nn as nn

from hidup.errors import UserError
from hidup.models.config import ZOO

__all__ = [
    "ModelSourceError",
    "is_factory",
    "load_factory",
    "build_factory",
    "recorded_source",
    "positional_inputs",
    "describe_source",
    "HIDUP_SUPPLIED",
]

# Parameters hidup fills in itself when the factory declares them; they are not model arguments.
HIDUP_SUPPLIED = ("world_size", "device")


class ModelSourceError(UserError, ValueError):
    """A model spec that cannot be resolved or built; the message says what, where and the fix."""


def is_factory(spec: str) -> bool:
    """Whether ``spec`` names a factory (``package.module:function``) rather than a zoo model."""
    return isinstance(spec, str) and ":" in spec


def _where(tb, module_file: str | None = None) -> str:
    """``file:line`` of the innermost frame of ``tb``, plus the innermost frame in ``module_file``
    when that is another one (the user's line that led into a library)."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?"
    last = frames[-1]
    text = f"{last.filename}:{last.lineno}"
    if module_file is not None:
        mine = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(module_file)]
        if mine and mine[-1] is not last:
            text += f", called from {mine[-1].filename}:{mine[-1].lineno}"
    return text


def _importable_cwd() -> None:
    """Make the current directory importable, as ``python -m`` does (the ``hidup`` script does not)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def load_factory(spec: str):
    """The function ``spec`` (``package.module:function``) names; :class:`ModelSourceError` if none."""
    module_name, _, attr = spec.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not module_name or not attr or ":" in attr:
        raise ModelSourceError(
            f"model {spec!r}: expected a zoo name (see `hidup models`) or "
            "package.module:function, e.g. mymodels:build_llama"
        )
    _importable_cwd()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ModelSourceError(
                f"model {spec!r}: no module named {module_name!r} (looked in the current directory "
                f"{os.getcwd()} and on sys.path). Fix: run from the directory holding {module_name.split('.')[0]}"
                f".py, or add its directory to PYTHONPATH"
            ) from None
        raise ModelSourceError(
            f"model {spec!r}: importing {module_name} failed: ModuleNotFoundError: {e} "
            f"(at {_where(e.__traceback__)}). Fix: install the missing package"
        ) from None
    except Exception as e:  # noqa: BLE001 - any error while importing the user's module is reported as such
        raise ModelSourceError(
            f"model {spec!r}: importing {module_name} failed: {type(e).__name__}: {e} (at {_where(e.__traceback__)})"
        ) from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            public = sorted(
                k
                for k, v in vars(module).items()
                if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
            )
            raise ModelSourceError(
                f"model {spec!r}: module {module_name} ({getattr(module, '__file__', '?')}) has no attribute "
                f"{attr!r}; its functions and classes: {', '.join(public) or '(none)'}"
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelSourceError(
            f"model {spec!r}: {attr} is a {type(factory).__name__}, not a function returning (model, example_inputs)"
        )
    return factory


def _factory_kwargs(spec: str, factory, world_size: int, device: torch.device, args: dict) -> dict:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = None  # a builtin without a signature: pass the arguments as they are
    supplied = sorted(set(HIDUP_SUPPLIED) & set(args))
    if supplied:
        raise ModelSourceError(
            f"model {spec!r}: {', '.join(supplied)} is set by hidup (--world, the rank's "
            "device), not a model argument; drop it from the model arguments"
        )
    kwargs = dict(args)
    if params is None:
        return kwargs
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(k for k in args if k not in named and not takes_any)
    if unknown:
        accepted = [n for n in named if n not in HIDUP_SUPPLIED]
        raise ModelSourceError(
            f"model {spec!r}: the factory takes no argument {', '.join(unknown)}; it takes: "
            f"{', '.join(accepted) or '(none)'}"
        )
    for name, value in (("world_size", world_size), ("device", device)):
        if name in named:
            kwargs[name] = value
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty and n not in kwargs and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if missing:
        raise ModelSourceError(
            f"model {spec!r}: the factory needs {', '.join(missing)}; pass "
            + ", ".join(f"--model-arg {n}=VALUE" for n in missing)
        )
    return kwargs


def positional_inputs(model: nn.Module, inputs, where: str) -> tuple:
    """``inputs`` (a tensor, tuple/list or dict) as the positional tuple of ``model.forward``."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    if isinstance(inputs, dict):
        sig = inspect.signature(model.forward)
        params = list(sig.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ModelSourceError(
                f"{where}: {type(model).__name__}.forward takes *args/**kwargs, so dict example "
                "inputs have no order; return them as a tuple"
            )
        try:
            bound = sig.bind(**inputs)
        except TypeError as e:
            raise ModelSourceError(
                f"{where}: example inputs {sorted(inputs)} do not match {type(model).__name__}.forward{sig}: {e}"
            ) from None
        last = max(i for i, p in enumerate(params) if p.name in bound.arguments)
        return tuple(bound.arguments.get(p.name, p.default) for p in params[: last + 1])
    raise ModelSourceError(
        f"{where}: example inputs must be a tensor, a tuple or a dict of inputs, got {type(inputs).__name__}"
    )


def build_factory(spec: str, /, world_size: int = 1, *, device=None, seed: int = 0, **args) -> tuple[nn.Module, tuple]:
    """Call the factory ``spec`` names (see the module docstring); ``(model, positional inputs)``."""
    factory = load_factory(spec)
    device = torch.device(device) if device is not None else torch.device("cpu")
    kwargs = _factory_kwargs(spec, factory, world_size, device, args)
    module_file = getattr(sys.modules.get(getattr(factory, "__module__", None) or ""), "__file__", None)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            result = factory(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's code: one message naming the error and its line
        raise ModelSourceError(
            f"model {spec!r}: the factory raised {type(e).__name__}: {e} (at {_where(e.__traceback__, module_file)})"
        ) from None
    where = f"model {spec!r}"
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = (
            f"a {type(result).__name__} of {len(result)} items"
            if isinstance(result, (tuple, list))
            else f"an object of type {type(result).__name__}"
        )
        raise ModelSourceError(f"{where}: the factory must return (model, example_inputs), but it returned {got}")
    model, inputs = result
    if not isinstance(model, nn.Module):
        raise ModelSourceError(
            f"{where}: the factory's first result must be an nn.Module whose forward returns "
            f"the loss, but it is an object of type {type(model).__name__}"
        )
    inputs = positional_inputs(model, inputs, where)
    if "device" not in kwargs and device.type != "cpu":
        model = model.to(device)
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    return model, inputs


def recorded_source(plan) -> dict | None:
    """``{"model": spec, "args": {...}}`` that rebuilds ``plan``'s model, or None when the plan does
    not say (searched in Python without ``model_source``).  A plan from before model records that
    names a zoo model is read as that model with its ``model_config`` overrides."""
    record = getattr(plan, "model_source", None)
    if record:
        return {"model": record["model"], "args": dict(record.get("args") or {})}
    if getattr(plan, "model", None) in ZOO:
        return {"model": plan.model, "args": dict(getattr(plan, "model_config", None) or {})}
    return None


def describe_source(record: dict) -> str:
    """``spec arg=value ...`` for messages."""
    args = " ".join(f"{k}={v!r}" for k, v in record["args"].items())
    return record["model"] + (f" ({args})" if args else "")
