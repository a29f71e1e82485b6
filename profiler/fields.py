"""Checks of a profile document's fields, shared by the parsers of its parts.

Each part's ``from_dict`` (:meth:`hidup.profiler.tables.CommTable.tables_from_dict`,
:func:`hidup.profiler.tables.concurrency_from_dict`, :meth:`hidup.profiler.profile.NetworkTables.from_dict`,
the profile's own fields) raises :class:`FieldError` naming the field it reads, as a dotted path from
the document's top (``collectives.all_reduce.4.alpha``); :meth:`hidup.profiler.profile.Profile.from_dict`
turns it into a :class:`~hidup.profiler.profile.ProfileError` that names the document too
(``<where>: field '<field>': <message>``).
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["FieldError", "number", "group_size", "per_dtype"]


class FieldError(ValueError):
    """Field ``field`` of a profile document is malformed; the message says how."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def number(value, field: str, positive: bool = True) -> float:
    """``value`` as a float: finite, and > 0 (``positive``) or >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(field, f"expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise FieldError(field, f"must be > 0, got {value!r}")
    if not positive and value < 0:
        raise FieldError(field, f"must be >= 0, got {value!r}")
    return float(value)


def group_size(key, field: str) -> int:
    """A table's group size key (a JSON object key: a string) as an integer >= 2."""
    try:
        g = int(key)
    except (TypeError, ValueError):
        raise FieldError(field, "group size keys must be integers >= 2") from None
    if g < 2:
        raise FieldError(field, "group size keys must be integers >= 2")
    return g


def per_dtype(d: dict, key: str, dtypes: tuple[str, ...], parse: Callable, shape: str) -> dict:
    """The mapping ``dtype -> parse(value)`` of field ``key`` of ``d`` (absent: empty), each dtype one of
    ``dtypes``; a ``ValueError`` of ``parse`` names the entry (``shape`` describes a value)."""
    given = d.get(key, {})
    if not isinstance(given, dict) or set(given) - set(dtypes):
        raise FieldError(key, f"expected a mapping {{dtype of {dtypes}: {shape}}}")
    out = {}
    for dt, value in given.items():
        try:
            out[dt] = parse(value)
        except ValueError as e:
            raise FieldError(f"{key}.{dt}", str(e)) from None
    return out
