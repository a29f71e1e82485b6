"""Search a parallelization plan and save it (the original HiDup workflow's `python strategy.py`).

With no flags: BERT-SGMoE at the paper's defaults on 8 GPUs under the paper's V100 cluster profile;
prints the plan summary, writes strategy_bert-sgmoe.json and says what to run next (show, verify,
train).  ``--model package.module:function`` searches your own model (a function returning
``(model, example_inputs)``).  Takes every flag of `hidup search` (see `python exp/strategy.py --help`).
"""

import sys

from hidup.cli.hashseed import fix_hash_seed

if __name__ == "__main__":
    fix_hash_seed()  # before torch is imported: one trace for every run (hidup/cli/hashseed.py)
    from hidup.cli import main

    sys.exit(main(["search", *sys.argv[1:]]))
