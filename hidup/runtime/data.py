"""Training data that needs no download.

* :class:`SyntheticTokens`: uniform random token ids; batch ``t`` is drawn from a generator seeded
  with ``seed * 1_000_003 + t``, so every rank (and every resumed run) sees the same batch ``t``.
* :class:`StdlibCorpus`: byte-level tokens (vocabulary 256) of the Python standard library's own
  source files, read in sorted path order (deterministic on a given Python version).  Batch ``t``
  holds ``B`` windows of ``S + 1`` bytes; window ``b`` starts at
  ``((t * B + b) * (S + 1)) mod (L - S - 1)`` of the corpus of ``L`` bytes, so consecutive steps walk
  the corpus without overlap until it wraps.

Both return ``(tokens, targets)`` of shape ``[B, S]`` (int64), ``targets`` being ``tokens`` shifted
by one: ``window[:, :-1]`` and ``window[:, 1:]``.  ``local_batch(t, rank, world)`` returns rank
``rank``'s ``B / world`` rows of the same global batch (for modules compiled to take local batches).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["SyntheticTokens", "StdlibCorpus", "stdlib_bytes", "rank_share"]


def rank_share(inputs, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s equal share (``B / world`` consecutive rows) of every input along dim 0."""
    out = []
    for t in inputs:
        if t.shape[0] % world:
            raise ValueError(
                f"input of shape {tuple(t.shape)}: global batch {t.shape[0]} does not split over "
                f"{world} ranks; choose a batch that is a multiple of the world size"
            )
        k = t.shape[0] // world
        out.append(t[rank * k : (rank + 1) * k].contiguous())
    return tuple(out)


class _Batches:
    batch: int
    seq: int

    def window(self, step: int) -> torch.Tensor:  # [B, S + 1] int64
        raise NotImplementedError

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(step)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def local_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rank_share(self.batch_at(step), rank, world)

    def __iter__(self):
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1


class SyntheticTokens(_Batches):
    """Random token ids in ``[0, vocab)``; deterministic per (seed, step)."""

    def __init__(self, batch: int, seq: int, vocab: int, seed: int = 0):
        if batch < 1 or seq < 1 or vocab < 2:
            raise ValueError(
                f"SyntheticTokens(batch={batch}, seq={seq}, vocab={vocab}): need batch >= 1, seq >= 1, vocab >= 2"
            )
        self.batch, self.seq, self.vocab, self.seed = batch, seq, vocab, seed

    def window(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)


def stdlib_bytes(max_bytes: int = 8 << 20, root: str | os.PathLike | None = None) -> bytes:
    """Concatenated ``*.py`` sources under the standard library (sorted relative paths, third-party
    ``site-packages``/``dist-packages`` excluded), truncated to ``max_bytes``."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} not found; pass root= explicitly")
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).parts
        if any(part in ("site-packages", "dist-packages", "__pycache__") for part in rel):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class StdlibCorpus(_Batches):
    """Byte-level language-modelling batches over the standard library's source (vocab 256)."""

    vocab = 256

    def __init__(self, batch: int, seq: int, max_bytes: int = 8 << 20, root=None):
        if batch < 1 or seq < 1:
            raise ValueError(f"StdlibCorpus(batch={batch}, seq={seq}): need batch >= 1 and seq >= 1")
        self.batch, self.seq = batch, seq
        data = stdlib_bytes(max_bytes, root)
        if len(data) < seq + 2:
            raise ValueError(f"the corpus has {len(data)} bytes, too few for windows of {seq + 1}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.tokens.numel()

    def window(self, step: int) -> torch.Tensor:
        span = self.seq + 1
        n = self.tokens.numel() - span
        starts = ((step * self.batch + torch.arange(self.batch)) * span) % n
        idx = starts[:, None] + torch.arange(span)[None, :]
        return self.tokens[idx].long()
