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
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from hidup import __version__
from hidup.cli.config_file import apply_config_file
from hidup.cli.model_flags import add_model_args, model_request
from hidup.cli.precision_flags import add_reduce_dtype_arg
from hidup.errors import UserError
from hidup.ir import OFFLOAD_CHOICES, RECOMPUTE_CHOICES, RESHARD_CHOICES, ZERO_CHOICES
from hidup.plan import Plan, model_record, summary
from hidup.precision import check_reduce_dtype
from hidup.runtime.options import DEFAULT_PROFILE, CommandError, build_graph, say, settle_model

# --------------------------------------------------------------------------------------------- search


def _search_parser(p: argparse.ArgumentParser) -> None:
    from hidup.profiler.profile import DTYPES
    from hidup.search import STYLES

    p.description = (
        "Trace a model (zoo or package.module:function), search the fastest "
        "per-op sharding for a world size under a machine profile, print the plan summary and save "
        "it as JSON; the plan records the model and its arguments."
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
    _add_lever_flags(p)
    p.add_argument(
        "--precision", choices=DTYPES, default="fp32", help="compute precision assumed by the cost model (default fp32)"
    )
    add_reduce_dtype_arg(p)
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


def _add_lever_flags(p: argparse.ArgumentParser) -> None:
    """The search's memory and communication levers: recomputation, resharding, prefetch, ZeRO."""
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_CHOICES,
        default="auto",
        help="run repeated layers' forward again in the backward instead of keeping their activations: "
        "auto (only when the fastest plan does not fit --memory: the fastest plan that fits, recomputing "
        "as few layers as fit, selectively or whole), on (every repeated layer, whole), selective (every "
        "repeated layer, keeping the outputs of its matmuls and attention and running only the ops "
        "between them again), off (default auto)",
    )
    p.add_argument(
        "--reshard",
        choices=RESHARD_CHOICES,
        default="auto",
        help="free the all-gathered copy of every weight stored split after its forward use and gather it "
        "again in the backward (FSDP2's reshard after forward): auto (when the plan found does not fit "
        "--memory, or fits only by recomputing, keep the better plan with resharding), on, off (default auto)",
    )
    p.add_argument(
        "--prefetch",
        choices=("on", "off"),
        default="on",
        help="gather weights stored split one layer early, overlapping that layer's compute (on), or right "
        "before their use (off): eagerly on a side stream, compiled (--compile) as an asynchronous "
        "all-gather waited for at the weight's use; the plan records it, hidup train runs it so, the search "
        "prices it, with --compiled too (default on)",
    )
    p.add_argument(
        "--zero",
        choices=ZERO_CHOICES,
        default="auto",
        help="ZeRO for the weights a plan replicates: 1 splits their Adam state over the ranks, 2 also their "
        "gradients (reduce-scattered instead of all-reduced); both all-gather the updated rows after the "
        "optimizer, which costs time. auto (when the plan found does not fit --memory, or fits only by "
        "recomputing, search again with ZeRO-2 and keep the better plan), off, 1, 2 (default auto)",
    )
    p.add_argument(
        "--offload",
        choices=OFFLOAD_CHOICES,
        default="auto",
        help="keep Adam's state (and the float32 copy of the weights it steps) in host memory, stepped by the "
        "CPU: each step copies the gradients to the host and the weights back, which costs seconds on a large "
        "model. auto (only when no plan fits --memory without it; the plan says so), off, optimizer "
        "(default auto)",
    )


def _add_time_limit_flag(p: argparse.ArgumentParser) -> None:
    from hidup.search.ilp import DEFAULT_TIME_LIMIT

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
    import hidup.profiler
    from hidup.search import forced, search

    choice = settle_model(model_request(args))
    record = model_record(choice.record)  # refuses non-JSON arguments before the search runs
    out = args.out or Path(f"strategy_{choice.model.replace(':', '.')}.json")
    check_out_path(out)
    if not args.time_limit > 0:
        raise CommandError(f"--time-limit {args.time_limit:g}: give a positive number of seconds")
    check_reduce_dtype(args.reduce_dtype, args.precision)  # before the model is traced
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
            zero=args.zero,
            offload=args.offload,
            reduce_dtype=args.reduce_dtype,
            prefetch=args.prefetch == "on",
        )
    _report_warnings(caught, "search")
    plan.save(out)
    if not args.quiet:
        print(summary(plan, graph))
    print(f"plan saved to {out}")
    if not args.quiet:
        print(next_steps(out))
    return 0


def _styles() -> tuple[str, ...]:
    from hidup.search import STYLES

    return STYLES


def _style(text: str, axes: int) -> str | tuple | None:
    """``--style``: None (searched), one style, or on a mesh one per axis (None where ``-``)."""
    if text == "searched":
        return None
    parts = [t.strip() for t in text.split(",")]
    for t in parts:
        if t != "-" and t not in _styles():
            raise CommandError(f"--style {text}: unknown style {t!r}. Fix: one of searched, {', '.join(_styles())}")
    if axes > 1 or len(parts) > 1:
        if len(parts) != axes:
            raise CommandError(
                f"--style {text}: {len(parts)} styles for a mesh of {axes} axes. Fix: one style per axis, "
                "outer first, comma-separated ('-' leaves an axis free)"
            )
        return tuple(None if t == "-" else t for t in parts)
    return parts[0]


def _show_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Print a saved plan's summary from the plan alone: per layer, its ops and how they "
        "run, how its weights are stored, the collectives it runs with the bytes each rank sends, and its "
        "time; the routed experts by name; a legend. With --check, rebuild the plan's model from its record "
        "first and check the plan against it (the model flags are needed only for a plan that records no "
        "model, searched in Python without model_source=)."
    )
    p.add_argument("plan", type=Path, help="plan JSON written by `hidup search` or Plan.save")
    p.add_argument(
        "--check",
        action="store_true",
        help="trace the plan's model again and check that the plan was made for it (seconds to minutes)",
    )
    add_model_args(p, world_default=None)


def cmd_show(args: argparse.Namespace) -> int:
    from hidup.models.source import recorded_source

    plan = Plan.load(args.plan)
    request = model_request(args)
    choice = None
    # flags that contradict the plan's record are refused; with none given there is nothing to check
    if args.check or (recorded_source(plan) is not None and request.given()):
        choice = settle_model(request, plan, args.plan)
    graph = None
    if args.check:  # the graph the plan was made for: the plan is checked against it
        graph = build_graph(choice, "rebuilding the plan's model: tracing")
        plan.check(graph)
    print(summary(plan, graph))
    return 0


def _describe_parser(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--rows", type=int, default=None, help="print at most this many nodes")


def cmd_describe(args: argparse.Namespace) -> int:
    from hidup.frontend.describe import describe

    print(describe(build_graph(settle_model(model_request(args))), max_rows=args.rows))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    import hidup.models

    for name in hidup.models.names():
        cfg = hidup.models.config(name)
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())
        print(f"{name}: {fields}")
    return 0


def _profile_kind(notes: str) -> str:
    """How a built-in profile's numbers were obtained, from its notes: links from published figures
    with compute measured on a GPU of the same family, published figures alone, or measured."""
    text = notes.lower()
    if "public figures" in text:
        return "published links, compute measured on its GPU family" if "measured" in text else "published figures"
    return "measured" if "measured" in text else "published figures"


def cmd_profiles(args: argparse.Namespace) -> int:
    """Each built-in profile: name, kind (how its numbers were obtained, and the GPU), one line on the
    machine it describes and the world sizes it has collective tables for."""
    import hidup.profiler

    rows = []
    for name in hidup.profiler.builtin_names():
        prof = hidup.profiler.load(name)
        kind = _profile_kind(prof.notes or "") + f", {prof.gpu}"
        sizes = ", ".join(str(w) for w in prof.world_sizes)
        default = " (default)" if name == DEFAULT_PROFILE else ""
        rows.append((name + default, kind, f"{prof.host}; world sizes {sizes}"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, kind, text in rows:
        print(f"{name:<{width[0]}}  {kind:<{width[1]}}  {text}")
    print("a profile of your machine: hidup profile --out my.json; then --profile my.json")
    return 0


# ------------------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, and where its flags and its run live (``module:function``,
    imported only for the command that runs, so ``hidup show`` loads no search, trace or runtime).
    ``flags(p)`` adds the flags (and the description) to the command's parser; ``run(args)`` runs it."""

    help: str
    flags: str | None
    run: str

    def resolve(self, which: str):
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), name)


_HERE = "hidup.cli.app"
COMMANDS = {
    "search": Command("search a parallelization plan for a model", f"{_HERE}:_search_parser", f"{_HERE}:cmd_search"),
    "show": Command("print a saved plan's summary", f"{_HERE}:_show_parser", f"{_HERE}:cmd_show"),
    "describe": Command(
        "trace a model and print its graph with the sharding options",
        f"{_HERE}:_describe_parser",
        f"{_HERE}:cmd_describe",
    ),
    "models": Command("list the model zoo and each model's default configuration", None, f"{_HERE}:cmd_models"),
    "profiles": Command("list the built-in machine profiles (for --profile)", None, f"{_HERE}:cmd_profiles"),
    "bench-rank": Command(
        "time one rank's program of a world-N plan on one device (fake process group) against the single-device share",
        "hidup.cli.bench_rank_flags:add_flags",
        "hidup.cli.bench_rank_flags:run",
    ),
    "peak": Command(
        "predict one rank's peak memory under a plan by running its program on fake tensors (no GPU)",
        "hidup.cli.peak_flags:add_flags",
        "hidup.cli.peak_flags:run",
    ),
    "train": Command(
        "train a zoo model under a plan on this node's GPUs (or CPU ranks)",
        "hidup.cli.run_commands:train_flags",
        "hidup.cli.run_commands:run_train",
    ),
    "verify": Command(
        "compare a plan's loss and gradients with the single-device model",
        "hidup.cli.run_commands:verify_flags",
        "hidup.cli.run_commands:run_verify",
    ),
    "profile": Command(
        "measure this machine's device FLOP rates and collective bandwidths",
        "hidup.cli.run_commands:profile_flags",
        "hidup.cli.run_commands:run_profile",
    ),
}

DEBUG_HELP = "on a user error, show the Python traceback (also from the ranks) instead of one message"


def parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The ``hidup`` parser with every command's flags (``command`` ``"*"``), or only ``command``'s (the
    others listed by name and help: what ``hidup --help`` and a mistyped command need)."""
    p = argparse.ArgumentParser(
        prog="hidup", description="Automatic SPMD parallelism for PyTorch training: trace, search, compile, verify."
    )
    _add_global_flags(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        q = sub.add_parser(name, help=cmd.help, description=cmd.help[0].upper() + cmd.help[1:] + ".")
        if cmd.flags is not None and command in ("*", name):
            cmd.resolve("flags")(q)
        if "--debug" not in q._option_string_actions:
            q.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return p


def _add_global_flags(p: argparse.ArgumentParser) -> None:
    """``hidup --version`` and ``hidup --debug COMMAND`` (``--debug`` also works after the command)."""
    p.add_argument("--version", action="version", version=f"hidup {__version__}")
    p.add_argument("--debug", dest="debug_all", action="store_true", help=DEBUG_HELP)


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not a global flag), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand.  A user error (a model that cannot be built or traced, a plan that does not
    fit, a path that cannot be written, a rank that failed or died) ends with one message on stderr
    and exit status 1, not a traceback; ``--debug`` re-raises it with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(_command_in(argv))
    args = apply_config_file(p, argv)
    debug = bool(getattr(args, "debug", False) or getattr(args, "debug_all", False))
    previous = os.environ.get("HIDUP_DEBUG")
    if debug:
        os.environ["HIDUP_DEBUG"] = "1"  # spawned ranks send their tracebacks too
    try:
        return COMMANDS[args.command].resolve("run")(args) or 0
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
    from hidup.runtime.launch import user_error

    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, ModuleNotFoundError) and e.name == "mip":
        return "--algorithm ilp needs python-mip. Fix: pip install mip, or use --algorithm dp"
    return user_error(e)
