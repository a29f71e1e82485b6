"""The experiment drivers: benchmarks against tuned baselines, the robustness and search-time studies,
large-model plans, and the original HiDup workflow's scripts.

``exp`` is a package of the project (``pip install -e .`` installs it beside ``hidup``), so every
module imports its siblings as ``exp.<module>`` and each driver runs either way from the repository
root::

    python exp/bench.py --help          # by path, as documented
    python -m exp.bench --help          # as a module

Modules and their order (each imports only those before it):

* :mod:`exp.report`: host facts, JSON and markdown output shared by every driver;
* :mod:`exp.baselines`: DDP, FSDP2, expert parallelism and the single-device floor, and the one
  step timer (:mod:`exp.baselines.timing`) every method is timed by;
* :mod:`exp.breakdown`: the time breakdown of a chrome trace;
* :mod:`exp.benchrun`: the rank side of a benchmark (one method, timed, agreed across ranks);
* :mod:`exp.benchsearch`, :mod:`exp.benchplan`: plan searches in worker processes, the run order;
* :mod:`exp.benchreport`: the benchmark's tables, ``docs/benchmarks.md`` section and figure;
* :mod:`exp.bench`: the side-by-side benchmark driver;
* :mod:`exp.noise`: the robustness study (plans searched with perturbed profiles) and its report;
* :mod:`exp.search_time`, :mod:`exp.scale_plans`, :mod:`exp.parity`: single-purpose studies;
* :mod:`exp.strategy`, :mod:`exp.train`, :mod:`exp.profiler`: ``hidup search`` / ``train`` /
  ``profile`` under the original workflow's names.

Their records live in ``exp/records/`` (the drivers' default output folder): only those a page of
``docs/`` or the README links, within a size budget and without archives (``tests/test_docs.py``).
"""
