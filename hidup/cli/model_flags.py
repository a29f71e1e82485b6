"""The model flags of every command that builds a model, and the :class:`ModelRequest` they make.

``--model`` (a zoo name or ``package.module:function``), the model flags (``--layers``,
``--d-model``, ... -> keyword arguments ``layers``, ``d_model``, ...), ``--model-arg KEY=VALUE``,
``--world``, ``--mesh`` and ``--config`` (:mod:`hidup.cli.config_file`).  :func:`model_request`
turns the parsed flags into the :class:`hidup.runtime.options.ModelRequest` that
:func:`hidup.runtime.options.settle_model` decides the job's model from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hidup.ir import parse_mesh
from hidup.runtime.options import DEFAULT_MODEL, DEFAULT_WORLD, ModelRequest

__all__ = ["MODEL_FLAGS", "MODEL_HELP", "add_model_flags", "add_model_args", "model_overrides", "model_request"]

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
    """``--model``, the model flags, ``--model-arg``, ``--world``, ``--mesh`` and ``--config``;
    ``world_default`` is the world of a job that names neither (None: none)."""
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


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_overrides(args: argparse.Namespace) -> dict:
    """The model flags given (``--layers`` ...), as keyword arguments (``layers`` ...)."""
    return {
        flag.replace("-", "_"): getattr(args, flag.replace("-", "_"))
        for flag in MODEL_FLAGS
        if getattr(args, flag.replace("-", "_"), None) is not None
    }


def model_request(args: argparse.Namespace) -> ModelRequest:
    """The model the parsed flags ask for (:func:`add_model_args`, and ``--config``'s ``[model]``
    table, which :func:`hidup.cli.config_file.apply_config_file` puts in ``args.model_table``)."""
    mesh = getattr(args, "mesh", None)
    return ModelRequest(
        model=getattr(args, "model", None),
        table=dict(getattr(args, "model_table", None) or {}),
        flags=model_overrides(args),
        model_arg=tuple(getattr(args, "model_arg", None) or ()),
        world=getattr(args, "world", None),
        mesh=None if mesh is None else tuple(mesh),
        world_default=getattr(args, "world_default", None),
    )
