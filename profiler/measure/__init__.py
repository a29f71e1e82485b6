"""The measuring harness: times this machine's kernels, collectives and rank programs and writes a
profile (``hidup profile``).  Layer ``profiler (measurement)``, above the runtime whose programs it
times; the profile data it writes is :mod:`hidup.profiler` (a leaf the cost model reads).

Modules: :mod:`~hidup.profiler.measure.machine` (``profile_machine``: the whole profile),
:mod:`~hidup.profiler.measure.device` (matmul rates, op overheads), :mod:`~hidup.profiler.measure.comm`
(collective tables), :mod:`~hidup.profiler.measure.ops` (per-op times of a plan's rank program),
:mod:`~hidup.profiler.measure.calibrate` (corrections fitted on measured programs).
"""
