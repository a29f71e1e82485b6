"""Profile this machine (device FLOP rates and collective tables) and write a profile JSON.

    CPN=4 NODERANK=0 python exp/profiler.py --out h100x4.json         # one host, 4 GPUs
    NNODES=2 CPN=8 NODERANK=<n> MASTER_ADDR=<node 0> MASTER_PORT=29500 python exp/profiler.py
    torchrun --nproc-per-node 4 exp/profiler.py --quick
    python exp/profiler.py                                            # one process: device rates only

The math and the file format are described in hidup.profiler.measure and hidup.profiler.profile.
"""

from __future__ import annotations

import argparse
import sys

from hidup.profiler.measure import add_profile_args, run_profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    add_profile_args(p)
    return run_profile(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
