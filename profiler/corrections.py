"""Empirical corrections of the cost model, each with where it was measured.

The cost model (:mod:`hidup.search.cost`) first computes a *physical* time from measurements of
single mechanisms: per-op times, the roofline, the fixed cost of one op, alpha-beta collective
tables, copy bandwidths, the speedup of two concurrent collectives.  A *correction* is different in
kind: a factor fitted so that the cost model's prediction of whole programs equals their measured
time.  It holds near the programs it was fitted on, and a prediction on those programs is
in-sample by construction.  So each correction here carries

* its ``value`` (1 = not calibrated: the identity),
* what it multiplies (:data:`MULTIPLIES`),
* its :class:`Provenance`: the device and world it was timed on, every plan it was fitted on
  (model, precision, measured and predicted seconds) and every held-out plan it was checked on
  (predicted *with* the fitted value), so that a report can tell in-sample numbers from
  out-of-sample ones (:meth:`Corrections.in_sample`).

The corrections
---------------
``dist_scale``
    multiplies ``t_fwd`` and ``t_bwd`` of every call node of a plan run without duplication: the
    compute inside the ranks' program (NCCL kernels beside it, the waits around each collective)
    against the same ops on one device.
``dist_dup_scale``
    multiplies ``t_fwd`` and ``t_bwd`` of every call node in each duplicated copy: the same with
    duplication, where one copy's kernels also fill the other's gaps.

Both are fitted by :func:`hidup.profiler.measure.calibrate.program_scales` on the searched plans of a list of
calibration models; its held-out models are timed the same way and priced with the fitted value.
The search finds its plan with both taken as 1 and lets them choose only the plan's mode
(:mod:`hidup.search.api`).

JSON
----
A profile stores them under ``"corrections"``::

    "corrections": {"dist_scale": {"value": 1.086, "multiplies": "...",
                                   "provenance": {"device": "...", "world": 4, "cuda_graphs": true,
                                                  "date": "...", "fitted_on": [point, ...],
                                                  "held_out": [point, ...]}}, ...}

with ``point = {"model", "precision", "measured_s", "predicted_s", "coverage", "scale"}``.  A missing
correction is the identity.  A profile written before corrections were kept apart carries
``dist_scale`` and ``dist_dup_scale`` at its top level: they load with an unrecorded provenance,
which :meth:`Corrections.in_sample` counts as in-sample for every model (nothing says otherwise).
A value with no provenance at all was set by hand or drawn by a perturbation: fitted on no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable

__all__ = ["Correction", "Corrections", "Point", "Provenance", "MULTIPLIES", "CorrectionError"]

MULTIPLIES = {
    "dist_scale": "t_fwd and t_bwd of every call node of a plan without duplication (compute inside the "
    "ranks' program)",
    "dist_dup_scale": "t_fwd and t_bwd of every call node in each duplicated copy (compute inside the ranks' "
    "program with duplication)",
}


class CorrectionError(ValueError):
    """A corrections document is malformed; the message names the field."""


def _number(value, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CorrectionError(f"{where}: expected a finite number, got {value!r}")
    if value < 0 or (positive and value <= 0):
        raise CorrectionError(f"{where}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Point:
    """One plan timed on the ranks: its model and precision, the measured seconds and the cost
    model's (at the identity for a point a correction was fitted on, with the fitted value for a
    held-out point), the share of the prediction that moves with compute (``coverage``) and the
    factor that alone would make the two agree (``scale``; 0 when none in range does)."""

    model: str
    precision: str
    measured_s: float
    predicted_s: float
    coverage: float = 1.0
    scale: float = 0.0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(d, where: str) -> "Point":
        if not isinstance(d, dict) or not isinstance(d.get("model"), str) or not isinstance(d.get("precision"), str):
            raise CorrectionError(f"{where}: expected {{model, precision, measured_s, predicted_s, ...}}, got {d!r}")
        return Point(
            d["model"],
            d["precision"],
            _number(d.get("measured_s"), f"{where}.measured_s"),
            _number(d.get("predicted_s"), f"{where}.predicted_s"),
            _number(d.get("coverage", 1.0), f"{where}.coverage"),
            _number(d.get("scale", 0.0), f"{where}.scale"),
        )

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1.0 if self.measured_s > 0 else math.inf


@dataclass(frozen=True)
class Provenance:
    """Where a correction was measured: the device, the world size, whether the steps ran as CUDA
    graphs, the date, the plans it was fitted on (in-sample) and the held-out plans it was checked
    on.  ``recorded=False``: a value from a profile written before provenance was kept."""

    fitted_on: tuple[Point, ...] = ()
    held_out: tuple[Point, ...] = ()
    device: str = ""
    world: int = 0
    cuda_graphs: bool = False
    date: str = ""
    recorded: bool = True

    @property
    def models(self) -> tuple[str, ...]:
        """The calibration models (in-sample), in order, each once."""
        return tuple(dict.fromkeys(p.model for p in self.fitted_on))

    @property
    def held_out_models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.model for p in self.held_out))

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "world": self.world,
            "cuda_graphs": self.cuda_graphs,
            "date": self.date,
            "recorded": self.recorded,
            "fitted_on": [p.to_dict() for p in self.fitted_on],
            "held_out": [p.to_dict() for p in self.held_out],
        }

    @staticmethod
    def from_dict(d, where: str) -> "Provenance":
        if not isinstance(d, dict):
            raise CorrectionError(f"{where}: expected an object, got {d!r}")
        for key in ("fitted_on", "held_out"):
            if not isinstance(d.get(key, []), list):
                raise CorrectionError(f"{where}.{key}: expected a list of points")
        world = d.get("world", 0)
        if isinstance(world, bool) or not isinstance(world, int) or world < 0:
            raise CorrectionError(f"{where}.world: expected a world size, got {world!r}")

        def points(key: str) -> tuple[Point, ...]:
            return tuple(Point.from_dict(p, f"{where}.{key}[{i}]") for i, p in enumerate(d.get(key, [])))

        return Provenance(
            points("fitted_on"),
            points("held_out"),
            str(d.get("device", "")),
            world,
            bool(d.get("cuda_graphs", False)),
            str(d.get("date", "")),
            bool(d.get("recorded", True)),
        )


UNRECORDED = Provenance(recorded=False)


@dataclass(frozen=True)
class Correction:
    """A factor and where it was measured (None: not calibrated; the value is then 1)."""

    value: float = 1.0
    provenance: Provenance | None = None

    @property
    def identity(self) -> bool:
        return self.value == 1.0

    def to_dict(self, name: str) -> dict:
        out = {"value": self.value, "multiplies": MULTIPLIES[name]}
        if self.provenance is not None:
            out["provenance"] = self.provenance.to_dict()
        return out

    @staticmethod
    def from_dict(d, where: str) -> "Correction":
        if not isinstance(d, dict) or "value" not in d:
            raise CorrectionError(f'{where}: expected {{"value": factor, "provenance": {{...}}}}, got {d!r}')
        prov = d.get("provenance")
        return Correction(
            _number(d["value"], f"{where}.value", positive=True),
            None if prov is None else Provenance.from_dict(prov, f"{where}.provenance"),
        )


@dataclass(frozen=True)
class Corrections:
    """The cost model's empirical corrections (module docstring); the default is the identity."""

    dist_scale: Correction = field(default_factory=Correction)
    dist_dup_scale: Correction = field(default_factory=Correction)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, **values: float) -> "Corrections":
        """Corrections with the given values and no provenance (a value set by hand)."""
        unknown = set(values) - set(cls.names())
        if unknown:
            raise CorrectionError(f"unknown correction(s) {sorted(unknown)}; expected {cls.names()}")
        return cls(**{k: Correction(float(v)) for k, v in values.items()})

    @property
    def identity(self) -> bool:
        return all(getattr(self, n).identity for n in self.names())

    def factor(self, duplicated: bool) -> float:
        """What a call node's physical compute is multiplied by, in a duplicated copy or not."""
        return (self.dist_dup_scale if duplicated else self.dist_scale).value

    def with_values(self, **values: float) -> "Corrections":
        """A copy with the named values replaced (provenance kept)."""
        unknown = set(values) - set(self.names())
        if unknown:
            raise CorrectionError(f"unknown correction(s) {sorted(unknown)}; expected {self.names()}")
        return replace(self, **{k: replace(getattr(self, k), value=float(v)) for k, v in values.items()})

    def in_sample(self, model: str) -> bool:
        """Whether a prediction for ``model`` uses a correction fitted on ``model`` itself, or on
        models nobody recorded (a value from an older profile): its accuracy then says nothing about
        other models.  A value set by hand or drawn by :meth:`perturb` (no provenance) was fitted on
        nothing."""
        return model in self.calibration_models() or "?" in self.calibration_models()

    def calibration_models(self) -> list[str]:
        """The models any non-identity correction was fitted on (``"?"`` for an unrecorded one)."""
        out: dict[str, None] = {}
        for name in self.names():
            c = getattr(self, name)
            if c.identity or c.provenance is None:
                continue
            out.update(dict.fromkeys(c.provenance.models if c.provenance.recorded else ("?",)))
        return list(out)

    def perturb(self, draw: Callable[[], float]) -> "Corrections":
        """Each value times one ``draw()``, in :meth:`names` order (provenance kept)."""
        return replace(
            self, **{n: replace(getattr(self, n), value=getattr(self, n).value * draw()) for n in self.names()}
        )

    def to_dict(self) -> dict:
        return {n: getattr(self, n).to_dict(n) for n in self.names()}

    @classmethod
    def from_dict(cls, d, where: str = "corrections") -> "Corrections":
        if not isinstance(d, dict):
            raise CorrectionError(f"{where}: expected an object {{name: correction}}, got {d!r}")
        unknown = set(d) - set(cls.names())
        if unknown:
            raise CorrectionError(f"{where}: unknown correction(s) {sorted(unknown)}; expected {cls.names()}")
        return cls(**{n: Correction.from_dict(v, f"{where}.{n}") for n, v in d.items()})

    @classmethod
    def from_legacy(cls, d: dict) -> "Corrections":
        """The top-level ``dist_scale`` / ``dist_dup_scale`` of an older profile document (values
        already validated), with an unrecorded provenance where a value is not 1."""
        return cls(
            **{n: Correction(float(d[n]), UNRECORDED if float(d[n]) != 1.0 else None) for n in cls.names() if n in d}
        )

    def describe(self) -> str:
        """One line per non-identity correction: its value, what it was fitted on, and how it did on held-out plans."""
        lines = []
        for n in self.names():
            c = getattr(self, n)
            if c.identity:
                continue
            p = c.provenance
            if p is None:
                lines.append(f"{n} {c.value:.3f} (set by hand: fitted on no model)")
                continue
            if not p.recorded:
                lines.append(f"{n} {c.value:.3f} (provenance not recorded: in-sample for every model)")
                continue
            held = ", ".join(f"{x.model} {x.precision} {x.error:+.1%}" for x in p.held_out) or "none"
            lines.append(
                f"{n} {c.value:.3f} fitted on {', '.join(p.models) or 'no plan'} "
                f"(x{p.world}, {p.device or 'unknown device'}); held out: {held}"
            )
        return "; ".join(lines) or "none (identity)"
