"""``hidup`` (the console command) and ``python -m hidup``: fix the hash seed, then run the CLI."""

from __future__ import annotations

import sys

from hidup.cli.hashseed import fix_hash_seed


def entry() -> int:
    """Start again under ``PYTHONHASHSEED=0`` if needed (:mod:`hidup.cli.hashseed`), then
    :func:`hidup.cli.main`."""
    fix_hash_seed()
    from hidup.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(entry())
