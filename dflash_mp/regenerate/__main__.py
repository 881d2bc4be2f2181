"""`python -m dflash_mp.regenerate` (and `torchrun -m dflash_mp.regenerate`)."""

import sys

from dflash_mp.regenerate.cli import main

sys.exit(main())
