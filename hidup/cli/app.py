"""The ``hidup`` command line: search, show, verify, profile, train, describe.

Every subcommand that builds a model takes the same model flags (:mod:`hidup.cli.model_flags`).
``--model`` is a zoo name (``hidup models``) or ``package.module:function``, a factory returning
``(model, example_inputs)`` (:mod:`hidup.models.source`).  The model's arguments are the flags
``--layers``, ``--d-model``, ... (keyword arguments ``layers``, ``d_model``, ...) and ``--model-arg
KEY=VALUE`` (repeatable; VALUE is read as JSON -- ``2``, ``0.5``, ``true``, ``[1, 2]`` -- and as a
plain string otherwise) for any other keyword.  A TOML file given with ``--config`` supplies
defaults for any flag (keys are the flag names with dashes or underscores), and a ``[model]`` table
gives the model: its ``spec`` key names it and every other key is a model argument.  Flags on the
command line win.

A plan records its model and arguments, so ``show``, ``train``, ``verify`` with a plan need no model
flags.  Model flags given with a plan must agree with its record: a different model, a different
value or an argument the plan does not record is refused (search again to change the model).

A user error -- a bad flag, model, plan, profile, path or checkpoint, a search with no plan, a
compile or launch failure, in this process or in a rank -- ends with one message on stderr and exit
status 1 (2 for a malformed command line), never a traceback; ``--debug`` shows the traceback.  A
rank that dies is named with its exit code or signal (:mod:`hidup.runtime.launch`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path

import hidup.models
import hidup.profiler
from hidup import __version__
from hidup.cli import bench_rank_flags, peak_flags
from hidup.cli import run_commands as runtime_cli
from hidup.cli.config_file import apply_config_file
from hidup.cli.model_flags import add_model_args, model_request
from hidup.frontend.describe import describe
from hidup.models.source import recorded_source
from hidup.plan import Plan, model_record, summary
from hidup.profiler.profile import DTYPES
from hidup.runtime.launch import LaunchError, user_error
from hidup.runtime.options import DEFAULT_PROFILE, CommandError, build_graph, say, settle_model
from hidup.search import STYLES, forced, search
from hidup.search.ilp import DEFAULT_TIME_LIMIT

# --------------------------------------------------------------------------------------------- search


def _search_parser(sub) -> None:
    p = sub.add_parser(
        "search",
        help="search a parallelization plan for a model",
        description="Trace a model (zoo or package.module:function), search the fastest "
        "per-op sharding for a world size under a machine profile, print the plan summary and save "
        "it as JSON; the plan records the model and its arguments.",
    )
    add_model_args(p)
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"builtin profile name or path to a profile JSON (default {DEFAULT_PROFILE})",
    )
    p.add_argument("--algorithm", choices=("dp", "ilp"), default="dp", help="search algorithm (default dp)")
    p.add_argument("--no-duplication", action="store_true", help="search without the two-copy overlap")
    p.add_argument(
        "--style",
        default="searched",
        metavar="STYLE",
        help="searched (default), or a fixed parallelism style for baselines: "
        + ", ".join(STYLES)
        + " (expert-all-gather / expert-all-to-all force the routed experts' token dispatcher); on a "
        "--mesh one style per axis, outer first, comma-separated ('-' leaves an axis free)",
    )
    p.add_argument(
        "--memory",
        type=float,
        default=None,
        metavar="GB",
        help="per-rank memory budget in GB (the ILP enforces it; the DP checks it)",
    )
    _add_time_limit_flag(p)
    p.add_argument(
        "--recompute",
        choices=("auto", "on", "off"),
        default="auto",
        help="run repeated layers' forward again in the backward instead of keeping their activations: "
        "auto (when the fastest plan does not fit --memory, keep the faster plan that fits, with "
        "the fewest layers recomputed), on (every repeated layer), off (default auto)",
    )
    p.add_argument(
        "--reshard",
        choices=("auto", "on", "off"),
        default="auto",
        help="free the all-gathered copy of every weight stored split after its forward use and gather it "
        "again in the backward (FSDP2's reshard after forward): auto (when the plan found does not fit "
        "--memory, or fits only by recomputing, keep the better plan with resharding), on, off (default auto)",
    )
    p.add_argument(
        "--precision", choices=DTYPES, default="fp32", help="compute precision assumed by the cost model (default fp32)"
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="price eager dispatch per op (for training with --cuda-graphs off) instead of a "
        "step captured as one CUDA graph (a captured step cannot run the routed experts' all-to-all "
        "dispatcher: with capture priced, the search keeps the faster of the captured plan without it "
        "and the uncaptured plan with it)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="price the program as inductor runs it (hidup train --compile on or auto on GPUs): views "
        "free, pointwise chains fused (default: op by op)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.0,
        metavar="X",
        help="perturb every profiled rate by an independent uniform factor in [1-X, 1+X]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for --noise")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="plan file (default strategy_<model>.json, a factory's ':' written as '.')",
    )
    p.add_argument("--quiet", action="store_true", help="print only the output path")


def _add_time_limit_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        metavar="SECONDS",
        help=f"stop the ILP after this many seconds (default {DEFAULT_TIME_LIMIT:g}); it then keeps the "
        "best plan found, marked unproven in the plan, or fails if it found none",
    )


def check_out_path(out: Path, flag: str = "--out") -> None:
    """Refuse an output path that cannot be written, before any work: its directory must exist and be
    writable, and the path must not be a directory."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise CommandError(f"{flag} {out} is a directory. Fix: give a file name, e.g. {flag} {out / 'plan.json'}")
    if not parent.is_dir():
        raise CommandError(
            f"{flag} {out}: the directory {parent} does not exist. Fix: create it first "
            f"(mkdir -p {parent}) or write elsewhere"
        )
    if not os.access(parent, os.W_OK):
        raise CommandError(f"{flag} {out}: the directory {parent} is not writable. Fix: write elsewhere")


def next_steps(out: Path) -> str:
    """What to run after a plan is saved."""
    return (
        f"next:\n  hidup show {out}      # per-layer summary\n"
        f"  hidup verify --plan {out}   # loss and gradients on the plan's ranks vs one device (CPU is fine)\n"
        f"  hidup train --plan {out}    # train on this node's GPUs"
    )


def _report_warnings(caught, command: str) -> None:
    for w in caught:
        text = str(w.message).removeprefix("hidup.search: ")
        print(f"hidup {command}: warning: {text}", file=sys.stderr, flush=True)


def cmd_search(args: argparse.Namespace) -> int:
    choice = settle_model(model_request(args))
    record = model_record(choice.record)  # refuses non-JSON arguments before the search runs
    out = args.out or Path(f"strategy_{choice.model.replace(':', '.')}.json")
    check_out_path(out)
    if not args.time_limit > 0:
        raise CommandError(f"--time-limit {args.time_limit:g}: give a positive number of seconds")
    profile = hidup.profiler.load(args.profile)
    if args.noise:
        profile = profile.perturb(noise=args.noise, seed=args.seed)
    graph = build_graph(choice, quiet=args.quiet)
    budget = None if args.memory is None else args.memory * 1e9
    say(
        f"searching ({args.algorithm}{', time limit %g s' % args.time_limit if args.algorithm == 'ilp' else ''}) ...",
        args.quiet,
    )
    style = _style(args.style, len(graph.mesh))
    run = search if style is None else (lambda g, p, **kw: forced(g, p, style, **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = run(
            graph,
            profile,
            world_size=choice.world,
            algorithm=args.algorithm,
            duplication=not args.no_duplication,
            memory_budget=budget,
            precision=args.precision,
            progress=not args.quiet,
            cuda_graphs=not args.no_cuda_graphs,
            compiled=args.compiled,
            model_source=record,
            time_limit=args.time_limit,
            recompute=args.recompute,
            reshard=args.reshard,
        )
    _report_warnings(caught, "search")
    plan.save(out)
    if not args.quiet:
        print(summary(plan, graph))
    print(f"plan saved to {out}")
    if not args.quiet:
        print(next_steps(out))
    return 0


def _style(text: str, axes: int) -> str | tuple | None:
    """``--style``: None (searched), one style, or on a mesh one per axis (None where ``-``)."""
    if text == "searched":
        return None
    parts = [t.strip() for t in text.split(",")]
    for t in parts:
        if t != "-" and t not in STYLES:
            raise CommandError(f"--style {text}: unknown style {t!r}. Fix: one of searched, {', '.join(STYLES)}")
    if axes > 1 or len(parts) > 1:
        if len(parts) != axes:
            raise CommandError(
                f"--style {text}: {len(parts)} styles for a mesh of {axes} axes. Fix: one style per axis, "
                "outer first, comma-separated ('-' leaves an axis free)"
            )
        return tuple(None if t == "-" else t for t in parts)
    return parts[0]


def _show_parser(sub) -> None:
    p = sub.add_parser(
        "show",
        help="print a saved plan's summary",
        description="Print a saved plan's summary from the plan alone: per layer, its ops and how they "
        "run, how its weights are stored, the collectives it runs with the bytes each rank sends, and its "
        "time; the routed experts by name; a legend. With --check, rebuild the plan's model from its record "
        "first and check the plan against it (the model flags are needed only for a plan that records no "
        "model, searched in Python without model_source=).",
    )
    p.add_argument("plan", type=Path, help="plan JSON written by `hidup search` or Plan.save")
    p.add_argument(
        "--check",
        action="store_true",
        help="trace the plan's model again and check that the plan was made for it (seconds to minutes)",
    )
    add_model_args(p, world_default=None)


def cmd_show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    choice = None
    if args.check or recorded_source(plan) is not None:  # flags that contradict the plan's record are refused
        choice = settle_model(model_request(args), plan, args.plan)
    graph = None
    if args.check:  # the graph the plan was made for: the plan is checked against it
        graph = build_graph(choice, "rebuilding the plan's model: tracing")
        plan.check(graph)
    print(summary(plan, graph))
    return 0


def _describe_parser(sub) -> None:
    p = sub.add_parser("describe", help="trace a model and print its graph with the sharding options")
    add_model_args(p)
    p.add_argument("--rows", type=int, default=None, help="print at most this many nodes")


def cmd_describe(args: argparse.Namespace) -> int:
    print(describe(build_graph(settle_model(model_request(args))), max_rows=args.rows))
    return 0


def _models_parser(sub) -> None:
    sub.add_parser("models", help="list the model zoo and each model's default configuration")


def cmd_models(args: argparse.Namespace) -> int:
    for name in hidup.models.names():
        cfg = hidup.models.config(name)
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
        print(f"{name}: {fields}")
    return 0


def _profiles_parser(sub) -> None:
    sub.add_parser("profiles", help="list the built-in machine profiles (for --profile)")


def cmd_profiles(args: argparse.Namespace) -> int:
    """Each built-in profile: name, kind (how its numbers were obtained, and the GPU), one line on the
    machine it describes and the world sizes it has collective tables for."""
    rows = []
    for name in hidup.profiler.builtin_names():
        prof = hidup.profiler.load(name)
        kind = ("measured" if "measured" in (prof.notes or "").lower() else "published figures") + f", {prof.gpu}"
        sizes = ", ".join(str(w) for w in prof.world_sizes)
        default = " (default)" if name == DEFAULT_PROFILE else ""
        rows.append((name + default, kind, f"{prof.host}; world sizes {sizes}"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, kind, text in rows:
        print(f"{name:<{width[0]}}  {kind:<{width[1]}}  {text}")
    print("a profile of your machine: hidup profile --out my.json; then --profile my.json")
    return 0


COMMANDS = {
    "search": (_search_parser, cmd_search),
    "show": (_show_parser, cmd_show),
    "describe": (_describe_parser, cmd_describe),
    "models": (_models_parser, cmd_models),
    "profiles": (_profiles_parser, cmd_profiles),
}


COMMANDS["bench-rank"] = (bench_rank_flags.add_parser, bench_rank_flags.run)
COMMANDS["peak"] = (peak_flags.add_parser, peak_flags.run)
for _name, _entry in runtime_cli.COMMANDS.items():  # train, verify, profile
    COMMANDS.setdefault(_name, _entry)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hidup", description="Automatic SPMD parallelism for PyTorch training: trace, search, compile, verify."
    )
    _add_global_flags(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for make, _ in COMMANDS.values():
        make(sub)
    for command in sub.choices.values():
        if "--debug" not in command._option_string_actions:
            command.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return p


DEBUG_HELP = "on a user error, show the Python traceback (also from the ranks) instead of one message"


def _add_global_flags(p: argparse.ArgumentParser) -> None:
    """``hidup --version`` and ``hidup --debug COMMAND`` (``--debug`` also works after the command)."""
    p.add_argument("--version", action="version", version=f"hidup {__version__}")
    p.add_argument("--debug", dest="debug_all", action="store_true", help=DEBUG_HELP)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand.  A user error (a model that cannot be built or traced, a plan that does not
    fit, a path that cannot be written, a rank that failed or died) ends with one message on stderr
    and exit status 1, not a traceback; ``--debug`` re-raises it with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = apply_config_file(p, argv)
    debug = bool(getattr(args, "debug", False) or getattr(args, "debug_all", False))
    previous = os.environ.get("HIDUP_DEBUG")
    if debug:
        os.environ["HIDUP_DEBUG"] = "1"  # spawned ranks send their tracebacks too
    try:
        return COMMANDS[args.command][1](args) or 0
    except KeyboardInterrupt:
        if debug:
            raise
        raise SystemExit(f"hidup {args.command}: interrupted") from None
    except Exception as e:  # only the user errors below are turned into messages
        message = _user_error(e)
        if message is None or debug:
            raise
        raise SystemExit(f"hidup {args.command}: error: {message}") from None
    finally:
        if debug:
            if previous is None:
                os.environ.pop("HIDUP_DEBUG", None)
            else:
                os.environ["HIDUP_DEBUG"] = previous


def _user_error(e: Exception) -> str | None:
    """The message of an error the user can fix, or None for a bug (which keeps its traceback):
    the command line's own (:class:`CommandError`), and every error the ranks report as the user's
    (:func:`hidup.runtime.launch.user_error`: models, plans, traces, searches, profiles, compiles,
    checkpoints, paths, launches)."""
    if isinstance(e, (CommandError, LaunchError)):
        return str(e)
    if isinstance(e, ModuleNotFoundError) and e.name == "mip":
        return "--algorithm ilp needs python-mip. Fix: pip install mip, or use --algorithm dp"
    return user_error(e)
