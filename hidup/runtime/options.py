"""The command-line options shared by every command that builds a model, and what they decide.

``--model`` is a zoo name or ``package.module:function`` (:mod:`hidup.models.source`); its
arguments come from the model flags (``--layers`` ... -> ``layers`` ...), ``--model-arg KEY=VALUE``
(VALUE read as JSON, else as a string) and a ``--config`` TOML file's ``[model]`` table, flags
winning.  :func:`settle_model` decides the job's model and world size -- from these, or from a
plan's record, refusing flags that contradict it -- and :func:`build_graph` traces it.  The
commands (:mod:`hidup.cli`, and the runtime's ``train``, ``verify`` and ``bench-rank``) all read
their model through here, so one definition serves them all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import hidup.models
from hidup.frontend.trace import trace
from hidup.ir import mesh_text, parse_mesh
from hidup.models.source import ModelSourceError, describe_source, recorded_source
from hidup.plan import PlanError

MODEL_FLAGS = {
    # flag: (type, help)
    "layers": (int, "number of transformer layers"),
    "d-model": (int, "hidden size"),
    "heads": (int, "attention heads"),
    "ffn": (int, "feed-forward hidden size"),
    "experts-per-gpu": (int, "experts per GPU (MoE models); total experts = this x world"),
    "capacity-factor": (float, "MoE capacity factor (already doubled for top-2 models)"),
    "seq-len": (int, "sequence length (BERT/GPT) or number of patches (ViT)"),
    "batch-per-gpu": (int, "sequences (or images) per GPU; the global batch is this x world"),
    "vocab": (int, "vocabulary size (BERT/GPT)"),
}

DEFAULT_MODEL = "bert-sgmoe"
DEFAULT_WORLD = 8
DEFAULT_PROFILE = "paper-v100-9.7gbps"

MODEL_HELP = (
    f"zoo model name (default {DEFAULT_MODEL}; see `hidup models`) or package.module:function, a "
    "function returning (model, example_inputs) that gets the model flags as keyword arguments (plus "
    "world_size and device if it takes them); the module is imported from the current directory or "
    "sys.path"
)


def add_model_flags(group) -> None:
    """The model override flags (``--layers``, ``--d-model``, ...), each defaulting to the model's."""
    for flag, (typ, text) in MODEL_FLAGS.items():
        group.add_argument(f"--{flag}", type=typ, default=None, help=f"{text} (default: the model's)")


def add_model_args(p: argparse.ArgumentParser, *, world_default: int | None = DEFAULT_WORLD) -> None:
    g = p.add_argument_group(
        "model", "with --plan, the plan's record of its model; flags that contradict it are refused"
    )
    g.add_argument("--model", default=None, metavar="NAME|MODULE:FUNCTION", help=MODEL_HELP)
    add_model_flags(g)
    g.add_argument(
        "--model-arg",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="another keyword argument of the model (repeatable): VALUE is read as JSON (2, 0.5, true, "
        "null, [1, 2]) or else as a string (float64); zoo models take their overrides "
        "(dropout, aux_weight, ...)",
    )
    g.add_argument(
        "--world",
        type=int,
        default=None,
        help="number of ranks (GPUs)"
        + ("" if world_default is None else f" (default {world_default}; with --plan the plan's)"),
    )
    g.add_argument(
        "--mesh",
        type=_mesh_arg,
        default=None,
        metavar="AxB",
        help="a device mesh of several axes, outer first (e.g. 8x8: nodes x GPUs per node); the world is "
        "its size (with --plan the plan's)",
    )
    g.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML file with defaults for these flags; a [model] table: spec = NAME or MODULE:FUNCTION "
        "and the model's arguments",
    )
    p.set_defaults(world_default=world_default)


def mesh_phrase(mesh) -> str:
    """`` as a 2x2 mesh`` for a device mesh of several axes (a tuple or a plan's list), else ``""``."""
    return f" as a {mesh_text(tuple(mesh))} mesh" if mesh and len(mesh) > 1 else ""


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _settle_mesh(args: argparse.Namespace, plan, where) -> None:
    """``args.mesh`` (a tuple of 2+ axis sizes, or None for one axis) and ``args.world`` agreeing with it."""
    mesh = getattr(args, "mesh", None)
    if plan is not None:
        if mesh is not None and tuple(mesh) != plan.mesh_shape:
            raise PlanError(
                f"{where} was searched for mesh {mesh_text(plan.mesh_shape)}, not --mesh {mesh_text(mesh)}. "
                "Fix: drop --mesh (the plan's is used), or search again with that mesh"
            )
        args.mesh = tuple(plan.mesh) if len(plan.mesh) > 1 else None
        return
    if mesh is None or len(mesh) < 2:
        args.mesh = None
        if mesh is not None and getattr(args, "world", None) in (None, mesh[0]):
            args.world = mesh[0]
        return
    size = math.prod(mesh)
    if getattr(args, "world", None) not in (None, size):
        raise PlanError(f"--mesh {mesh_text(mesh)} holds {size} ranks, not --world {args.world}. Fix: give one of them")
    args.world = size


def model_overrides(args: argparse.Namespace) -> dict:
    """The model flags given (``--layers`` ...), as keyword arguments (``layers`` ...)."""
    return {
        flag.replace("-", "_"): getattr(args, flag.replace("-", "_"))
        for flag in MODEL_FLAGS
        if getattr(args, flag.replace("-", "_"), None) is not None
    }


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


def model_request(args: argparse.Namespace) -> tuple[str | None, dict]:
    """The model spec and arguments given on the command line or in ``--config`` (spec None if none):
    the ``[model]`` table, overridden by the model flags, and ``--model-arg``."""
    given = dict(getattr(args, "model_table", None) or {})  # --config's [model] table: defaults
    flags = model_overrides(args)
    given.update(flags)
    for text in getattr(args, "model_arg", None) or ():
        key, value = parse_model_arg(text)
        if key in flags:
            raise ModelSourceError(f"--model-arg {text!r} repeats --{key.replace('_', '-')} {flags[key]!r}; keep one")
        given[key] = value
    return getattr(args, "model", None), given


def settle_model(args: argparse.Namespace, plan=None, plan_path=None) -> dict:
    """Decide the job's model: set ``args.model`` (spec) and ``args.model_args``, and ``args.world``.

    Without a plan: what was given (the default zoo model if nothing).  With a plan: its record, after
    checking that the given flags agree with it (:class:`PlanError` otherwise); a plan without a record
    needs ``--model``.  Returns the record ``{"model": spec, "args": {...}}``."""
    spec, given = model_request(args)
    if plan is None:
        record = {"model": spec or DEFAULT_MODEL, "args": given}
        if getattr(args, "world", None) is None and getattr(args, "mesh", None) is None:
            args.world = getattr(args, "world_default", None)
    else:
        where = plan_path or "the plan"
        if getattr(args, "world", None) is not None and args.world != plan.world_size:
            raise PlanError(
                f"{where} was searched for {plan.world_size} ranks, not --world {args.world}. Fix: drop "
                f"--world (the plan's {plan.world_size} is used), or search again with --world "
                f"{args.world}"
            )
        args.world = plan.world_size
        record = recorded_source(plan)
        if record is None:
            if spec is None:
                raise PlanError(
                    f"{where} does not record its model (it was searched in Python without "
                    "model_source=). Fix: pass --model NAME or --model package.module:function with "
                    "the model's arguments (--layers ..., --model-arg KEY=VALUE), or search with "
                    "hidup.search(..., model_source='package.module:function')"
                )
            record = {"model": spec, "args": given}
        else:
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
    _settle_mesh(args, plan, plan_path or "the plan")
    args.model, args.model_args = record["model"], dict(record["args"])
    if plan is not None and getattr(args, "command", None) in RANK_COMMANDS:
        check_plan_fits(args, plan, where)
    return record


RANK_COMMANDS = ("train", "verify")  # commands that start ranks: a plan is checked against its model first


def check_plan_fits(args: argparse.Namespace, plan, where) -> None:
    """Trace the job's model as the ranks will and refuse a plan made for another graph
    (:meth:`hidup.plan.Plan.check`: world size, model structure, shapes, dtypes) -- here, before any
    rank is spawned, rather than in every rank after it started."""
    graph = build_graph(args, "checking the plan against its model: tracing")
    try:
        plan.check(graph)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def apply_config_file(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; values from ``--config FILE`` (TOML) become defaults that flags override.
    A ``[model]`` table names the model (``spec``) and holds its arguments."""
    args = p.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10, where TOML needs the tomli package
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        p.error(f"--config {path}: no such file")
    except tomllib.TOMLDecodeError as e:
        p.error(f"--config {path}: not valid TOML ({e})")
    subparsers = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subparsers[0].choices[args.command] if subparsers else p
    known = {a.dest for a in sub._actions} - {"help", "config"}
    defaults = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest not in known:
            p.error(
                f"--config {path}: unknown key {key!r}; valid keys: "
                + ", ".join(sorted(k.replace("_", "-") for k in known))
            )
        if dest == "model" and isinstance(value, dict):
            table = {k.replace("-", "_"): v for k, v in value.items()}
            spec = table.pop("spec", None)
            if spec is not None:
                defaults["model"] = spec
            defaults["model_table"] = table
            continue
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return p.parse_args(argv)


class CommandError(Exception):
    """A command-line mistake found by a subcommand (a path that cannot be written, a value out of
    range); its message names the flag and the fix."""


def say(args: argparse.Namespace, text: str) -> None:
    """A status line on stderr (what a phase longer than a moment is doing), unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(text, file=sys.stderr, flush=True)


def build_graph(args: argparse.Namespace, why: str = "tracing"):
    """Build the model and trace it: a zoo model on the meta device (no weights are allocated), a
    factory's on the CPU, as the ranks trace it when they compile (``torch.export`` records tensors
    created from Python data differently on ``meta``, which would change the graph's fingerprint).
    ``args.model`` / ``args.model_args`` come from :func:`settle_model`; ``why`` starts the status
    line printed while it runs."""
    if not hidup.models.is_factory(args.model) and args.model not in hidup.models.names():
        raise SystemExit(
            f"unknown model {args.model!r}; choose one of: {', '.join(hidup.models.names())}, "
            "or give your own as package.module:function"
        )
    try:
        device = None if hidup.models.is_factory(args.model) else "meta"
        model, inputs = hidup.models.build(args.model, world_size=args.world, device=device, **args.model_args)
    except ModelSourceError:
        raise
    except ValueError as e:  # a zoo configuration out of range
        raise ModelSourceError(str(e)) from None
    mesh = getattr(args, "mesh", None)
    ranks = f"a {mesh_text(mesh)} mesh" if mesh else f"{args.world} ranks"
    say(args, f"{why} {args.model} for {ranks} (torch.export) ...")
    t0 = time.perf_counter()
    graph = trace(model, inputs, world_size=args.world, half_batch=True, mesh=mesh)
    graph.model = args.model
    say(args, f"traced {len(graph.nodes)} nodes in {time.perf_counter() - t0:.1f} s")
    return graph
