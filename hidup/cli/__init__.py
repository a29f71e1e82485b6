"""The ``hidup`` command line (layer ``cli``, the top: it may import every layer, none imports it).

:mod:`~hidup.cli.app` builds the parser and runs ``search``, ``show``, ``describe``, ``models``,
``profiles``, ``peak`` and ``bench-rank``; :mod:`~hidup.cli.run_commands` adds ``train``, ``verify``
and ``profile``; :mod:`~hidup.cli.hashseed` fixes Python's hash seed before anything is traced.
"""

from hidup.cli.app import main, parser

__all__ = ["main", "parser"]
