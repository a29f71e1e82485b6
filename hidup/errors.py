"""The one base of the errors a user can fix.

:class:`UserError` marks an error whose message says what is wrong, where, and how to fix it: a model
that cannot be built or traced, a plan that does not fit its model, a search with no plan, a malformed
profile, a compile or CUDA-graph capture that cannot work, a launch setting, a command-line value.
The command line prints its message alone and exits with status 1 (``--debug`` shows the traceback);
any other exception is a bug and keeps its traceback.  Each error class derives from it and from the
builtin class it always was (``ValueError``, ``RuntimeError``), so ``except ValueError`` still
catches it.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """An error the user can fix; its message is the whole report (module docstring)."""
