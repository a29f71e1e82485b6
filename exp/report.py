"""Shared helpers of the experiment drivers: host facts, JSON and markdown output.

* :func:`hardware` records what a result was measured on (GPU name and count, torch, CUDA and NCCL
  versions, host, date).
* :func:`write_section` replaces one marked section of a markdown file, so that several drivers
  (bench, breakdown) can write into ``docs/benchmarks.md`` without erasing each other's tables.
* :func:`link` is a markdown link from a page to a file beside it, so a page links every result it
  was written with (tests/test_docs.py checks that every file under ``docs/`` is linked);
* :func:`table` renders a markdown table; :func:`pyplot` returns ``matplotlib.pyplot`` or ``None``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path

from hidup.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent


def hardware(device_type: str | None = None) -> dict:
    """Facts about this host and its accelerators (GPU name/count, torch, CUDA, NCCL, Python)."""
    import torch  # here, not at the top: benchsearch's pool workers import this module before torch

    info = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available() and device_type != "cpu":
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - a missing NCCL is a fact to record, not an error
            info["nccl"] = f"unavailable ({type(e).__name__})"
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
        info["device_count"] = 0
    return info


def hardware_line(hw: dict) -> str:
    parts = [
        f"{hw.get('device_count', 0)} x {hw.get('device', '?')}"
        if hw.get("device_count")
        else str(hw.get("device", "?")),
        f"torch {hw.get('torch', '?')}",
    ]
    if hw.get("cuda"):
        parts.append(f"CUDA {hw['cuda']}")
    if hw.get("nccl"):
        parts.append(f"NCCL {hw['nccl']}")
    parts += [f"Python {hw.get('python', '?')}", f"host {hw.get('host', '?')} ({hw.get('cpus', '?')} CPUs)"]
    return ", ".join(parts)


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that produced a result, as a user would type it."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script] + [a if a and " " not in a else repr(a) for a in args])


def save_json(path: str | Path, obj) -> Path:
    """Write ``obj`` as indented JSON atomically (:func:`hidup.files.atomic_write`)."""
    return atomic_write(path, json.dumps(obj, indent=1, default=str) + "\n")


def load_json(path: str | Path, default=None):
    path = Path(path)
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete or repair the file") from None


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (cells converted with ``str``; ``None`` shows as ``-``)."""

    def cell(v) -> str:
        return "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list]) -> str:
    """A fixed-width plain-text table for the terminal."""
    cells = [[("-" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def link(target: str | Path, page_dir: str | Path, text: str | None = None) -> str:
    """A markdown link to ``target`` from a page in ``page_dir`` (a relative path, so that the link
    holds wherever the repository is checked out)."""
    rel = os.path.relpath(Path(target).resolve(), Path(page_dir).resolve()).replace(os.sep, "/")
    return f"[`{text or Path(target).name}`]({rel})"


def write_section(path: str | Path, name: str, body: str, title: str | None = None) -> Path:
    """Replace the section ``name`` of the markdown file ``path`` (created with ``title`` if new).

    A section is everything between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``; sections
    not named are kept as they are, a new one is appended at the end."""
    path = Path(path)
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.is_file() else (f"# {title}\n\n" if title else "")
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + ("\n\n" if text.strip() else "") + block + "\n"
    return atomic_write(path, text)


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or ``None`` if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def rate(x) -> str:
    if x is None:
        return "-"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.1f}"
