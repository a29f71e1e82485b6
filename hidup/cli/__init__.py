"""The ``hidup`` command line (layer ``cli``, the top: it may import every layer, none imports it).

:mod:`~hidup.cli.app` builds the parser and runs ``search``, ``show``, ``describe``, ``models``,
``profiles``, ``peak`` and ``bench-rank``; :mod:`~hidup.cli.run_commands` adds ``train``, ``verify``
and ``profile``; :mod:`~hidup.cli.hashseed` fixes Python's hash seed before anything is traced.

The flags live here and nowhere else: each command's module defines them and turns the parsed
arguments into the typed options the library takes -- :mod:`~hidup.cli.model_flags` (the model
flags -> ``ModelRequest``), :mod:`~hidup.cli.launch_flags` (-> ``LaunchOptions``),
:mod:`~hidup.cli.train_flags` (-> ``TrainOptions``), :mod:`~hidup.cli.verify_flags` (->
``VerifyOptions``), :mod:`~hidup.cli.bench_rank_flags` (-> ``BenchRankOptions``) and
:mod:`~hidup.cli.peak_flags` (-> ``PeakOptions``), :mod:`~hidup.cli.profile_flags` (->
``ProfileOptions``); :mod:`~hidup.cli.config_file` reads ``--config``.
"""

__all__ = ["main", "parser"]


def main(argv: list[str] | None = None) -> int:
    """:func:`hidup.cli.app.main` (imported on call: ``hidup.cli.hashseed`` runs before anything heavy)."""
    from hidup.cli.app import main as run

    return run(argv)


def parser(command: str | None = "*"):
    """:func:`hidup.cli.app.parser`."""
    from hidup.cli.app import parser as build

    return build(command)
