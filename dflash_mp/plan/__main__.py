"""`python -m dflash_mp.plan --gpus N --bench FILE [--target DIR]`."""

import sys

from dflash_mp.plan.cli import main

sys.exit(main())
