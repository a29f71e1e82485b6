"""Files written whole or not at all.

:func:`atomic_write` writes into a temporary file beside the target (same directory, so the same
file system), flushes it to disk (``fsync``) and renames it over the target with ``os.replace``,
which POSIX and Windows make atomic: a reader, or a run killed mid-write, finds the old file or the
new one, never a part.  The temporary name carries the process id, so two processes writing one
target do not write into each other's temporary file; a failed write removes its temporary file
and leaves the target as it was.  Plans, profiles, raw measurements and checkpoints are written
this way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path.

    ``data`` is text (written as UTF-8), bytes, or a function that writes into the open binary file
    (``lambda f: torch.save(obj, f)``).  The parent directory is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
