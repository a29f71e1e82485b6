"""Typed option sets: a frozen dataclass of options that an entry point takes whole or as keywords.

``SearchOptions`` (:mod:`hidup.search.api`) and ``CompileOptions`` (:mod:`hidup.codegen.rewrite`)
derive from :class:`OptionSet`; ``Cls.of(options, **changes)`` is ``options`` (or the defaults)
with ``changes`` applied, and a keyword that names no option is a TypeError listing the options.
"""

from __future__ import annotations

from dataclasses import fields, replace

__all__ = ["OptionSet"]


class OptionSet:
    """Mixin for a frozen dataclass of options (see the module docstring)."""

    WHAT = "options"  # who takes them, for the error message

    @classmethod
    def of(cls, options=None, **changes):
        """``options`` (or the defaults) with ``changes``, then :meth:`check`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(
                f"{cls.WHAT}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}"
            )
        opts = replace(options or cls(), **changes)
        opts.check()
        return opts

    def check(self) -> None:
        """Raise ValueError on a value out of range (nothing by default)."""
