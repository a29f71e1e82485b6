"""One string hash for every run, so that a model's trace does not depend on Python's hash seed.

Python salts ``str`` hashes per process (``PYTHONHASHSEED``), and a model whose forward iterates over
a ``set`` of strings runs its ops in a per-process order: `transformers`' Gemma-3 builds its rotary
embeddings with ``for layer_type in set(config.layer_types)``, so its exported graph -- op order,
node names, fingerprint -- changes from run to run, and a plan searched in one run is refused by the
next.  No trace can fix an order the model's own Python picks, so the command-line entry points fix
the seed instead: :func:`fix_hash_seed` starts the same command again (``os.execv``) with
``PYTHONHASHSEED=0`` unless it already runs with it, before anything heavy is imported; ranks and the
searches a command forks inherit it.  (A seed the user set is replaced too: a plan must be accepted
whatever seed each run was started with.)  The Python API (``hidup.trace`` in a script) traces under
the script's own seed; a plan check that fails on the fingerprint says so.
"""

from __future__ import annotations

import os
import sys

__all__ = ["fix_hash_seed", "SEED"]

SEED = "0"


def fix_hash_seed() -> None:
    """Start this command again with ``PYTHONHASHSEED=0`` unless it runs with it (module docstring)."""
    if os.environ.get("PYTHONHASHSEED") == SEED or not getattr(sys, "orig_argv", None):
        return
    os.environ["PYTHONHASHSEED"] = SEED
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
