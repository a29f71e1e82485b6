"""Profile this machine (device FLOP rates and collective tables) and write a profile JSON.

    CPN=4 NODERANK=0 python exp/profiler.py --out h100x4.json         # one host, 4 GPUs
    NNODES=2 CPN=8 NODERANK=<n> MASTER_ADDR=<node 0> MASTER_PORT=29500 python exp/profiler.py
    torchrun --nnodes 2 --nproc-per-node 8 ... exp/profiler.py        # the same two nodes under torchrun
    torchrun --nproc-per-node 4 exp/profiler.py --quick
    CPN=4 NODERANK=0 python exp/profiler.py --gpus-per-node 2 --quick  # one host taken as 2 nodes x 2
    python exp/profiler.py                                            # one process: device rates only

On several nodes both levels are measured: the node's tables inside each node, the network's on
groups of one rank per node, and the profile records gpus_per_node.  The math and the file format
are described in hidup.profiler.measure.machine and hidup.profiler.profile; the flags in
hidup.cli.profile_flags.
"""

from __future__ import annotations

import argparse
import sys

from hidup.cli.profile_flags import add_profile_args, run_profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    add_profile_args(p)
    return run_profile(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
