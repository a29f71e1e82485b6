"""Let a module double as its main function: ``hidup.trace(...)`` and ``import hidup.frontend.trace`` both work.

``hidup.trace``, ``hidup.search`` and ``hidup.describe`` are modules *and* the functions users call.
Once a submodule is imported Python binds the module object to the package attribute, so each such
module makes itself callable, forwarding to its main function.
"""

from __future__ import annotations

import sys
import types


def make_callable(module_name: str, function_name: str) -> None:
    module = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(self, function_name)(*args, **kwargs)

    module.__class__ = _CallableModule
