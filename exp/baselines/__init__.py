"""The baselines hidup is measured against, in one harness (:mod:`exp.baselines.harness`): DDP,
FSDP2, expert parallelism and one rank's share on a single device, each a module with
``prepare(model, rank, world, device, options)``, all timed by :mod:`exp.baselines.timing`."""
