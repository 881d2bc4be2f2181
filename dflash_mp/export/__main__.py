"""`python -m dflash_mp.export RUN_DIR [--step N] [--out DIR] [--dtype bfloat16|float32]`."""

import sys

from dflash_mp.export.cli import main

sys.exit(main())
