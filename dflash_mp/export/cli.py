"""`python -m dflash_mp.export RUN_DIR [--step N] [--out DIR] [--dtype bfloat16|float32]`

exports a checkpoint of a run (the newest, or step N) to RUN_DIR/export (or DIR).
`--speculators` writes an XPress drafter (model.arch=xpress) in speculators' format instead, for
vLLM's XPress method (docs/evaluation-and-serving.md, XPress).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_mp.export.hf import drafter_from_checkpoint, export_drafter, vllm_path_note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dir", type=Path, help="the training run directory (holds config.yaml and checkpoints/)"
    )
    parser.add_argument("--step", type=int, help="export the checkpoint of this step (default: the newest)")
    parser.add_argument("--out", type=Path, help="export directory (default: RUN_DIR/export)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="dtype of the exported weights"
    )
    parser.add_argument(
        "--speculators", action="store_true", help="speculators' format (model.arch=xpress drafters)"
    )
    args = parser.parse_args(argv)
    try:
        drafter = drafter_from_checkpoint(args.run_dir, step=args.step)
    except FileNotFoundError as e:
        print(f"dflash_mp.export: {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.speculators:
        from dflash_mp.export.speculators_format import export_run_speculators

        try:
            print(export_run_speculators(drafter, args.run_dir, args.out, dtype))
        except ValueError as e:
            print(f"dflash_mp.export: {e}", file=sys.stderr)
            return 2
        return 0
    verifier = None
    if drafter.arch == "dspark":  # speculators' format names the target (its verifier)
        from dflash_mp.export.speculators_format import run_verifier

        verifier = run_verifier(args.run_dir)
    out_dir = export_drafter(drafter, args.out or args.run_dir / "export", dtype=dtype, verifier=verifier)
    print(out_dir)
    if note := vllm_path_note(out_dir):
        print(note, file=sys.stderr)
    return 0
