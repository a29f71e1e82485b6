"""The job's model, settled: what every command that builds a model asks for, and what it decides.

``--model`` is a zoo name or ``package.module:function`` (:mod:`hidup.models.source`); its
arguments come from the model flags (``--layers`` ... -> ``layers`` ...), ``--model-arg KEY=VALUE``
(VALUE read as JSON, else as a string) and a ``--config`` TOML file's ``[model]`` table, flags
winning.  The command line (:mod:`hidup.cli.model_flags`) gathers them into a :class:`ModelRequest`;
:func:`settle_model` decides the job's model and world size -- from the request, or from a plan's
record, refusing flags that contradict it -- as a :class:`ModelChoice`, and :func:`build_graph`
traces it.  The commands (:mod:`hidup.cli`, and the runtime's ``train``, ``verify``, ``peak`` and
``bench-rank``) all read their model through here, so one definition serves them all.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field

import hidup.models
from hidup.errors import UserError
from hidup.ir import mesh_text
from hidup.models.source import ModelSourceError, describe_source, recorded_source
from hidup.plan import PlanError

__all__ = [
    "ModelRequest",
    "ModelChoice",
    "settle_model",
    "check_plan_fits",
    "build_graph",
    "parse_model_arg",
    "mesh_phrase",
    "say",
    "CommandError",
    "DEFAULT_MODEL",
    "DEFAULT_WORLD",
    "DEFAULT_PROFILE",
]

DEFAULT_MODEL = "bert-sgmoe"
DEFAULT_WORLD = 8
DEFAULT_PROFILE = "paper-v100-9.7gbps"


@dataclass(frozen=True)
class ModelRequest:
    """The model a command asks for, as given (nothing checked yet): ``model`` the spec (None: the
    default, or the plan's), ``table`` the ``[model]`` table of ``--config`` (defaults), ``flags`` the
    model flags given (``layers`` ...), ``model_arg`` the ``--model-arg KEY=VALUE`` texts, ``world``
    and ``mesh`` (a tuple of axis sizes) as given, and ``world_default`` the world of a job that names
    neither (None: none)."""

    model: str | None = None
    table: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)
    model_arg: tuple[str, ...] = ()
    world: int | None = None
    mesh: tuple[int, ...] | None = None
    world_default: int | None = None

    def given(self) -> bool:
        """Whether the command line (or ``--config``) asked for anything about the model."""
        return bool(self.model or self.table or self.flags or self.model_arg or self.world or self.mesh)

    def arguments(self) -> dict:
        """The model's arguments: the ``[model]`` table, overridden by the model flags, and
        ``--model-arg`` (which may not repeat a flag)."""
        given = dict(self.table)  # --config's [model] table: defaults
        given.update(self.flags)
        for text in self.model_arg:
            key, value = parse_model_arg(text)
            if key in self.flags:
                raise ModelSourceError(
                    f"--model-arg {text!r} repeats --{key.replace('_', '-')} {self.flags[key]!r}; keep one"
                )
            given[key] = value
        return given


@dataclass(frozen=True)
class ModelChoice:
    """The job's model, decided by :func:`settle_model`: ``model`` (zoo name or
    ``package.module:function``), its keyword arguments ``model_args``, the number of ranks ``world``
    (None where the command needs none) and ``mesh``, the axis sizes of a device mesh of several axes
    (None for one axis)."""

    model: str
    model_args: dict = field(default_factory=dict)
    world: int | None = None
    mesh: tuple[int, ...] | None = None

    @property
    def record(self) -> dict:
        """``{"model": spec, "args": {...}}``, the record a plan keeps of its model."""
        return {"model": self.model, "args": dict(self.model_args)}


def mesh_phrase(mesh) -> str:
    """`` as a 2x2 mesh`` for a device mesh of several axes (a tuple or a plan's list), else ``""``."""
    return f" as a {mesh_text(tuple(mesh))} mesh" if mesh and len(mesh) > 1 else ""


def _settle_mesh(world, mesh, plan, where) -> tuple[int | None, tuple[int, ...] | None]:
    """``(world, mesh)``: the mesh (a tuple of 2+ axis sizes, or None for one axis) and the world
    agreeing with it."""
    if plan is not None:
        if mesh is not None and tuple(mesh) != plan.mesh_shape:
            raise PlanError(
                f"{where} was searched for mesh {mesh_text(plan.mesh_shape)}, not --mesh {mesh_text(mesh)}. "
                "Fix: drop --mesh (the plan's is used), or search again with that mesh"
            )
        return world, (tuple(plan.mesh) if len(plan.mesh) > 1 else None)
    if mesh is None or len(mesh) < 2:
        if mesh is not None and world in (None, mesh[0]):
            world = mesh[0]
        return world, None
    size = math.prod(mesh)
    if world not in (None, size):
        raise PlanError(f"--mesh {mesh_text(mesh)} holds {size} ranks, not --world {world}. Fix: give one of them")
    return size, tuple(mesh)


def parse_model_arg(text: str) -> tuple[str, object]:
    """``"key=value"`` -> ``("key", value)``; the value is JSON when it parses, else the string."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise ModelSourceError(
            f"--model-arg {text!r}: write KEY=VALUE with KEY a Python identifier, e.g. --model-arg dtype=float64"
        )
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def settle_model(request: ModelRequest, plan=None, plan_path=None) -> ModelChoice:
    """Decide the job's model, its arguments and world size from ``request``.

    Without a plan: what was given (the default zoo model if nothing).  With a plan: its record, after
    checking that the given flags agree with it (:class:`PlanError` otherwise); a plan without a record
    needs ``--model``."""
    spec, given, world = request.model, request.arguments(), request.world
    where = plan_path or "the plan"
    if plan is None:
        record = {"model": spec or DEFAULT_MODEL, "args": given}
        if world is None and request.mesh is None:
            world = request.world_default
    else:
        if world is not None and world != plan.world_size:
            raise PlanError(
                f"{where} was searched for {plan.world_size} ranks, not --world {world}. Fix: drop "
                f"--world (the plan's {plan.world_size} is used), or search again with --world "
                f"{world}"
            )
        world = plan.world_size
        record = _plan_record(plan, where, spec, given)
    world, mesh = _settle_mesh(world, request.mesh, plan, where)
    return ModelChoice(record["model"], dict(record["args"]), world, mesh)


def _plan_record(plan, where, spec: str | None, given: dict) -> dict:
    """The plan's record of its model, checked against the model flags given (``spec``, ``given``)."""
    record = recorded_source(plan)
    if record is None:
        if spec is None:
            raise PlanError(
                f"{where} does not record its model (it was searched in Python without "
                "model_source=). Fix: pass --model NAME or --model package.module:function with "
                "the model's arguments (--layers ..., --model-arg KEY=VALUE), or search with "
                "hidup.search(..., model_source='package.module:function')"
            )
        return {"model": spec, "args": given}
    wrong = []
    if spec is not None and spec != record["model"]:
        wrong.append(f"--model {spec}")
    for key, value in given.items():
        if key not in record["args"]:
            wrong.append(f"{key}={value!r} (the plan records no {key})")
        elif record["args"][key] != value:
            wrong.append(f"{key}={value!r} (the plan has {record['args'][key]!r})")
    if wrong:
        raise PlanError(
            f"{where} was searched for {describe_source(record)}; the model flags "
            f"{', '.join(wrong)} contradict it. Fix: drop the model flags (the plan rebuilds "
            "its own model), or run `hidup search` again for the model you mean"
        )
    return record


def check_plan_fits(choice: ModelChoice, plan, where) -> None:
    """Trace the job's model as the ranks will and refuse a plan made for another graph
    (:meth:`hidup.plan.Plan.check`: world size, model structure, shapes, dtypes) -- before any
    rank is spawned (``hidup train``, ``hidup verify``), rather than in every rank after it started."""
    graph = build_graph(choice, "checking the plan against its model: tracing")
    try:
        plan.check(graph)
    except PlanError as e:
        raise PlanError(f"{where or 'the plan'}: {e}") from None


class CommandError(UserError):
    """A command-line mistake found by a subcommand (a path that cannot be written, a value out of
    range); its message names the flag and the fix."""


def say(text: str, quiet: bool = False) -> None:
    """A status line on stderr (what a phase longer than a moment is doing), unless ``quiet``."""
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def build_graph(choice: ModelChoice, why: str = "tracing", *, quiet: bool = False):
    """Build the model and trace it: a zoo model on the meta device (no weights are allocated), a
    factory's on the CPU, as the ranks trace it when they compile (``torch.export`` records tensors
    created from Python data differently on ``meta``, which would change the graph's fingerprint).
    ``choice`` comes from :func:`settle_model`; ``why`` starts the status line printed while it runs
    (unless ``quiet``)."""
    if not hidup.models.is_factory(choice.model) and choice.model not in hidup.models.names():
        raise SystemExit(
            f"unknown model {choice.model!r}; choose one of: {', '.join(hidup.models.names())}, "
            "or give your own as package.module:function"
        )
    try:
        device = None if hidup.models.is_factory(choice.model) else "meta"
        model, inputs = hidup.models.build(choice.model, world_size=choice.world, device=device, **choice.model_args)
    except ModelSourceError:
        raise
    except ValueError as e:  # a zoo configuration out of range
        raise ModelSourceError(str(e)) from None
    mesh = choice.mesh
    ranks = f"a {mesh_text(mesh)} mesh" if mesh else f"{choice.world} ranks"
    say(f"{why} {choice.model} for {ranks} (torch.export) ...", quiet)
    t0 = time.perf_counter()
    from hidup.frontend.trace import trace  # here: commands that only read a plan never load the front end

    graph = trace(model, inputs, world_size=choice.world, half_batch=True, mesh=mesh)
    graph.model = choice.model
    say(f"traced {len(graph.nodes)} nodes in {time.perf_counter() - t0:.1f} s", quiet)
    return graph
