"""``python -m hidup.cli``: the command line, under the fixed hash seed (:mod:`hidup.cli.hashseed`;
here it is fixed after the package's imports, ``python -m hidup`` fixes it first)."""

import sys

from hidup.cli.app import main
from hidup.cli.hashseed import fix_hash_seed

fix_hash_seed()
sys.exit(main())
