"""`python -m dflash_mp.plot RUN_DIR` writes RUN_DIR/plots/*.png from RUN_DIR/metrics.jsonl
(dflash_mp.run.plots draws them)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_mp.run.plots import plot_run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="the training run directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"dflash_mp.plot: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
