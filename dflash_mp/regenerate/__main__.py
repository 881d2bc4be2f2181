"""`python -m dflash_mp.regenerate` (and `torchrun -m dflash_mp.regenerate`)."""

import sys

from dflash_mp.run import startup

startup.pause()  # resumed by cli.run once torch and transformers are imported
from dflash_mp.regenerate.cli import main  # noqa: E402

sys.exit(main())
