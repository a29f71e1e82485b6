"""The measured time of an attention kernel by its variant, head dim, sequence length and rows.

``scaled_dot_product_attention`` does ``2 B H S L (E + F)`` FLOPs in its two matmuls, but its time
does not follow them at any one rate: the kernels (flash, memory-efficient, cuDNN) run the softmax
between the matmuls, skip the key blocks above the diagonal under ``is_causal``, and with an explicit
mask read it and add it as a bias.  On an H200, in float32, a causal attention with an explicit
boolean mask (how an exported ``transformers`` model passes its causal mask) takes about 1.3x the
time of the same attention under ``is_causal``.  So a profile keeps, per storage dtype, measured
times of each variant (:data:`VARIANTS`, :func:`hidup.rules.variant`) and the cost model prices an
attention from them.

A profile's :class:`AttentionTable` holds, for one storage dtype (``fp32``: float32 attention uses
no TF32 tensor cores, so it serves ``tf32`` too), the forward and the backward seconds of each
variant at every point of ``head_dims x seqs x rows`` (:func:`hidup.profiler.measure.device.attention_table`),
``rows`` being ``batch x heads`` (the rows of independent attention problems), queries = keys =
``seq``.  It prices ``(variant, E, S, L, R)`` as follows:

* the sequence length is ``s = sqrt(S L)`` (the score matrix's size); between measured lengths
  ``log t`` is linear in ``log s``; below the shortest, the shortest's time (a kernel that short is
  bound by its launch and its tiles); above the longest, the longest's times ``(s / s_max)^2`` (the
  work is quadratic in ``s``);
* the rows: between measured counts ``t`` is linear in ``R``; below the fewest, the fewest's time
  (the device is not full); above the most, the most's time times ``R / R_max`` (it is);
* the head dim: between measured dims ``t`` is linear in ``E``; below the smallest, the smallest's
  time; above the largest, the largest's times ``E / E_max``.

Serialized in a profile's ``attention`` field as ``{dtype: {"head_dims": [...], "seqs": [...],
"rows": [...], "variants": {variant: {"forward": [...], "backward": [...]}}}}``, each list of
seconds in ``(head_dim, seq, rows)`` order, rows fastest.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["AttentionTable", "VARIANTS"]

# no mask; is_causal; an explicit mask tensor (hidup.rules.attention)
VARIANTS = ("dense", "causal", "masked")


def _bracket(points: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """(lower index, upper index, weight of the upper) of ``x`` between ``points``, linear in ``x``;
    outside them both indices are the nearest end's."""
    if x <= points[0]:
        return 0, 0, 0.0
    if x >= points[-1]:
        return len(points) - 1, len(points) - 1, 0.0
    hi = bisect.bisect_right(points, x)
    return hi - 1, hi, (x - points[hi - 1]) / (points[hi] - points[hi - 1])


@dataclass(frozen=True)
class AttentionTable:
    """Seconds of attention's forward and backward per variant on a grid (module docstring)."""

    head_dims: tuple[int, ...]
    seqs: tuple[int, ...]
    rows: tuple[int, ...]
    # variant -> (forward seconds, backward seconds), each (head_dim, seq, rows) order, rows fastest
    times: tuple[tuple[str, tuple[tuple[float, ...], tuple[float, ...]]], ...]

    def __post_init__(self) -> None:
        for name in ("head_dims", "seqs", "rows"):
            axis = getattr(self, name)
            if not axis or list(axis) != sorted(set(axis)) or axis[0] <= 0:
                raise ValueError(f"attention table {name} must be distinct positive integers, increasing; got {axis}")
        variants = [v for v, _ in self.times]
        if not variants or len(set(variants)) != len(variants) or set(variants) - set(VARIANTS):
            raise ValueError(f"attention table variants must be distinct ones of {VARIANTS}, got {variants}")
        want = len(self.head_dims) * len(self.seqs) * len(self.rows)
        for variant, pair in self.times:
            for part, seconds in zip(("forward", "backward"), pair):
                if len(seconds) != want:
                    raise ValueError(f"attention table {variant} {part}: {want} times expected, got {len(seconds)}")
                if not all(t > 0 and math.isfinite(t) for t in seconds):
                    raise ValueError(f"attention table {variant} {part}: times must be positive and finite")

    @staticmethod
    def of(head_dims, seqs, rows, by_variant: dict) -> "AttentionTable":
        """The table of ``by_variant`` (variant -> (forward seconds, backward seconds))."""
        times = tuple((v, (tuple(f), tuple(b))) for v, (f, b) in by_variant.items())
        return AttentionTable(tuple(head_dims), tuple(seqs), tuple(rows), times)

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(v for v, _ in self.times)

    def _at(self, seconds: tuple[float, ...], d: int, s: int, r: int) -> float:
        return seconds[(d * len(self.seqs) + s) * len(self.rows) + r]

    def _over_rows(self, seconds: tuple[float, ...], d: int, s: int, rows: float) -> float:
        r0, r1, w = _bracket(self.rows, rows)
        t = (1.0 - w) * self._at(seconds, d, s, r0) + w * self._at(seconds, d, s, r1)
        return t * (rows / self.rows[-1] if rows > self.rows[-1] else 1.0)

    def _over_seqs(self, seconds: tuple[float, ...], d: int, seq: float, rows: float) -> float:
        seqs = self.seqs
        if seq >= seqs[-1]:
            return self._over_rows(seconds, d, len(seqs) - 1, rows) * (seq / seqs[-1]) ** 2
        if seq <= seqs[0]:
            return self._over_rows(seconds, d, 0, rows)
        hi = bisect.bisect_right(seqs, seq)
        w = (math.log(seq) - math.log(seqs[hi - 1])) / (math.log(seqs[hi]) - math.log(seqs[hi - 1]))
        lo_t, hi_t = self._over_rows(seconds, d, hi - 1, rows), self._over_rows(seconds, d, hi, rows)
        return math.exp((1.0 - w) * math.log(lo_t) + w * math.log(hi_t))

    def time(
        self, variant: str, head_dim: float, seq_q: float, seq_k: float, rows: float
    ) -> tuple[float, float] | None:
        """(forward, backward) seconds of ``rows`` attention problems of ``seq_q`` queries and
        ``seq_k`` keys of head dim ``head_dim`` in ``variant`` (module docstring); None when the
        table has no times of ``variant``."""
        pair = dict(self.times).get(variant)
        if pair is None:
            return None
        seq = math.sqrt(max(seq_q, 1) * max(seq_k, 1))
        d0, d1, w = _bracket(self.head_dims, head_dim)
        out = []
        for seconds in pair:
            t = (1.0 - w) * self._over_seqs(seconds, d0, seq, rows) + w * self._over_seqs(seconds, d1, seq, rows)
            out.append(t * (head_dim / self.head_dims[-1] if head_dim > self.head_dims[-1] else 1.0))
        return out[0], out[1]

    def scaled(self, factor: float) -> "AttentionTable":
        """Every time divided by ``factor`` (a perturbed profile's rates times ``factor``)."""
        by_variant = {v: ([t / factor for t in f], [t / factor for t in b]) for v, (f, b) in self.times}
        return AttentionTable.of(self.head_dims, self.seqs, self.rows, by_variant)

    def to_dict(self) -> dict:
        return {
            "head_dims": list(self.head_dims),
            "seqs": list(self.seqs),
            "rows": list(self.rows),
            "variants": {v: {"forward": list(f), "backward": list(b)} for v, (f, b) in self.times},
        }

    @classmethod
    def from_dict(cls, d: object) -> "AttentionTable":
        """Build from :meth:`to_dict`'s form; ``ValueError`` naming what is wrong."""
        keys = {"head_dims", "seqs", "rows", "variants"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ValueError(f"expected the keys {sorted(keys)}")
        axes = []
        for name in ("head_dims", "seqs", "rows"):
            axis = d[name]
            if not isinstance(axis, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in axis):
                raise ValueError(f"{name} must be a list of integers, got {axis!r}")
            axes.append(axis)
        variants = d["variants"]
        if not isinstance(variants, dict):
            raise ValueError('variants must map a variant to {"forward": [...], "backward": [...]}')
        by_variant = {}
        for v, parts in variants.items():
            if not isinstance(parts, dict) or set(parts) != {"forward", "backward"}:
                raise ValueError(f'variants.{v} must be {{"forward": [...], "backward": [...]}}')
            pair = []
            for part in ("forward", "backward"):
                seconds = parts[part]
                numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in seconds or ())
                if not isinstance(seconds, list) or not numbers:
                    raise ValueError(f"variants.{v}.{part} must be a list of numbers")
                pair.append([float(t) for t in seconds])
            by_variant[v] = tuple(pair)
        return cls.of(*axes, by_variant)
