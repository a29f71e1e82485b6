"""Train with a plan (the original HiDup workflow's `NODERANK=a CPN=b python train.py`).

On each machine: ``NODERANK=<node index> CPN=<GPUs per node> [NNODES=<nodes>] MASTER_ADDR=... \
python exp/train.py --plan strategy_bert-sgmoe.json``; under torchrun the RANK/WORLD_SIZE/LOCAL_RANK
variables are used instead; on one machine the plan's world size (or ``--world N``) is enough.  The
plan records its model (a zoo name or ``package.module:function``), so no model flags are needed.
Takes every flag of ``hidup train`` (see ``python exp/train.py --help``).
"""

import sys

from hidup.cli.hashseed import fix_hash_seed

if __name__ == "__main__":
    fix_hash_seed()  # before torch is imported: one trace for every run (hidup/cli/hashseed.py)
    from hidup.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
