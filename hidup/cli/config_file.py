"""``--config FILE``: a TOML file whose values become the defaults of a command's flags.

Keys are the flag names with dashes or underscores; a ``[model]`` table names the model (``spec``)
and holds its arguments (:class:`hidup.runtime.options.ModelRequest`'s ``table``).  Flags on the
command line win.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["apply_config_file"]


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
