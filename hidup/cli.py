"""The ``hidup`` command line: search, show, verify, profile, train, describe.

Every subcommand that builds a zoo model takes the same model flags (``--model``, ``--layers``,
``--d-model``, ...); a TOML file given with ``--config`` supplies defaults for any flag (keys are the
flag names with dashes or underscores), and flags on the command line win.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def add_model_flags(group) -> None:
    """The model override flags (``--layers``, ``--d-model``, ...), each defaulting to the model's."""
    for flag, (typ, text) in MODEL_FLAGS.items():
        group.add_argument(f"--{flag}", type=typ, default=None, help=f"{text} (default: the model's)")


def add_model_args(p: argparse.ArgumentParser, *, world_default: int | None = DEFAULT_WORLD) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"zoo model name (default {DEFAULT_MODEL}); "
                   "see `hidup models`")
    add_model_flags(g)
    g.add_argument("--world", type=int, default=world_default, help="number of ranks (GPUs)")
    g.add_argument("--config", type=Path, default=None, help="TOML file with defaults for these flags")


def model_overrides(args: argparse.Namespace) -> dict:
    return {flag.replace("-", "_"): getattr(args, flag.replace("-", "_"))
            for flag in MODEL_FLAGS if getattr(args, flag.replace("-", "_")) is not None}


def apply_config_file(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; values from ``--config FILE`` (TOML) become defaults that flags override."""
    args = p.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
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
            p.error(f"--config {path}: unknown key {key!r}; valid keys: "
                    + ", ".join(sorted(k.replace('_', '-') for k in known)))
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return p.parse_args(argv)


def build_graph(args: argparse.Namespace):
    """Build the zoo model on the meta device and trace it (no weights are allocated)."""
    import hidup.models
    from hidup.trace import trace

    if args.model not in hidup.models.names():
        raise SystemExit(f"unknown model {args.model!r}; choose one of: {', '.join(hidup.models.names())}")
    model, inputs = hidup.models.build(args.model, world_size=args.world, device="meta", **model_overrides(args))
    graph = trace(model, inputs, world_size=args.world, half_batch=True)
    graph.model = args.model
    return graph


# --------------------------------------------------------------------------------------------- search

def _search_parser(sub) -> None:
    p = sub.add_parser("search", help="search a parallelization plan for a model",
                       description="Trace a zoo model, search the fastest per-op sharding for a world "
                       "size under a machine profile, print the plan summary and save it as JSON.")
    add_model_args(p)
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"builtin profile name or path to a profile JSON (default {DEFAULT_PROFILE})")
    p.add_argument("--algorithm", choices=("dp", "ilp"), default="dp", help="search algorithm (default dp)")
    p.add_argument("--no-duplication", action="store_true", help="search without the two-copy overlap")
    p.add_argument("--memory", type=float, default=None, metavar="GB",
                   help="per-rank memory budget in GB (the ILP enforces it; the DP checks it)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16", "fp16"), default="fp32",
                   help="compute precision assumed by the cost model (default fp32)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="price eager dispatch per op (for training with --cuda-graphs off) instead of a "
                        "step captured as one CUDA graph")
    p.add_argument("--noise", type=float, default=0.0, metavar="X",
                   help="perturb every profiled rate by an independent uniform factor in [1-X, 1+X]")
    p.add_argument("--seed", type=int, default=0, help="seed for --noise")
    p.add_argument("--out", type=Path, default=None, help="plan file (default strategy_<model>.json)")
    p.add_argument("--quiet", action="store_true", help="print only the output path")


def cmd_search(args: argparse.Namespace) -> int:
    import hidup.profiler
    from hidup.plan import summary
    from hidup.search import search

    profile = hidup.profiler.load(args.profile)
    if args.noise:
        profile = profile.perturb(noise=args.noise, seed=args.seed)
    graph = build_graph(args)
    budget = None if args.memory is None else args.memory * 1e9
    plan = search(graph, profile, world_size=args.world, algorithm=args.algorithm,
                  duplication=not args.no_duplication, memory_budget=budget, precision=args.precision,
                  progress=not args.quiet, cuda_graphs=not args.no_cuda_graphs)
    plan.model = args.model
    plan.model_config = model_overrides(args)  # lets `hidup show` rebuild the same graph
    out = args.out or Path(f"strategy_{args.model}.json")
    plan.save(out)
    if not args.quiet:
        print(summary(plan, graph))
    print(f"plan saved to {out}")
    return 0


def _show_parser(sub) -> None:
    p = sub.add_parser("show", help="print a saved plan's summary")
    p.add_argument("plan", type=Path, help="plan JSON written by `hidup search`")


def cmd_show(args: argparse.Namespace) -> int:
    from hidup.plan import Plan, summary

    plan = Plan.load(args.plan)
    graph = None
    if plan.model:
        # Rebuild the graph the plan was made for, so the summary can name layers and shapes.
        ns = argparse.Namespace(model=plan.model, world=plan.world_size,
                                **{k.replace("-", "_"): None for k in MODEL_FLAGS})
        for k, v in (plan.model_config or {}).items():
            setattr(ns, k, v)
        graph = build_graph(ns)
        plan.check(graph)
    print(summary(plan, graph))
    return 0


def _describe_parser(sub) -> None:
    p = sub.add_parser("describe", help="trace a model and print its graph with the sharding options")
    add_model_args(p)
    p.add_argument("--rows", type=int, default=None, help="print at most this many nodes")


def cmd_describe(args: argparse.Namespace) -> int:
    from hidup.describe import describe

    print(describe(build_graph(args), max_rows=args.rows))
    return 0


def _models_parser(sub) -> None:
    sub.add_parser("models", help="list the model zoo and each model's default configuration")


def cmd_models(args: argparse.Namespace) -> int:
    import dataclasses

    import hidup.models

    for name in hidup.models.names():
        cfg = hidup.models.config(name)
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
        print(f"{name}: {fields}")
    return 0


COMMANDS = {
    "search": (_search_parser, cmd_search),
    "show": (_show_parser, cmd_show),
    "describe": (_describe_parser, cmd_describe),
    "models": (_models_parser, cmd_models),
}


def _optional_commands() -> None:
    """Subcommands whose implementation lives with the runtime and profiler packages."""
    try:
        from hidup.runtime import cli as runtime_cli
    except ImportError:
        return
    for name, entry in getattr(runtime_cli, "COMMANDS", {}).items():
        COMMANDS.setdefault(name, entry)


def parser() -> argparse.ArgumentParser:
    _optional_commands()
    p = argparse.ArgumentParser(prog="hidup", description="Automatic SPMD parallelism for PyTorch "
                                "training: trace, search, compile, verify.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for make, _ in COMMANDS.values():
        make(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = apply_config_file(p, argv)
    return COMMANDS[args.command][1](args) or 0


if __name__ == "__main__":
    sys.exit(main())
