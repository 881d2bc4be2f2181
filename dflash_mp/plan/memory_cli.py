"""`python -m dflash_mp.plan memory [--target T] [--gpu-memory-gib G] [--json] [key=value ...]`:
the predicted peak memory of a colocated rank, a target rank and a drafter rank, term by term.

The overrides compose the training config as `python -m dflash_mp.train` does (e.g. `experiment=qwen3-8b
data.max_length=32768 data.num_anchors=5461 train.activation_checkpointing=true`); the target's
shape is its config.json at model.target_path, or `--target` (an HF directory, a preset or an entry
of the families measurement, as `python -m dflash_mp.plan --target` reads it). With a GPU's memory
(`--gpu-memory-gib`, DFLASH_MP_GPU_MEMORY_GIB or the visible GPU), the config's layout is judged
as the preflight judges it; exit 0 when it fits or nothing was judged, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_mp.plan import PlanError
from dflash_mp.plan.memory import colocated_rank, drafter_rank, target_rank
from dflash_mp.plan.memory_check import GPU_MEMORY_ENV, layout_name, memory_verdict, training_shape


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mp.plan memory",
        description="Predicted peak GPU memory per rank, term by term, for a training config.",
    )
    p.add_argument(
        "--target",
        help="the target's shape: an HF directory, a preset or a families entry (default: model.target_path)",
    )
    p.add_argument(
        "--gpu-memory-gib", type=float, help=f"the GPU's memory (default: {GPU_MEMORY_ENV}, else the GPU's)"
    )
    p.add_argument("--json", action="store_true", help="print the breakdowns as JSON")
    p.add_argument("overrides", nargs="*", help="training config overrides key=value")
    return p


def _config(overrides: list[str]):
    from dflash_mp.config.schema import compose_config, to_dataclass

    try:
        return to_dataclass(compose_config(overrides))
    except Exception as e:  # an unknown key or a value of the wrong type, named by Hydra
        raise PlanError(f"the overrides do not compose: {e}") from e


def _target_config(cfg, target: str | None) -> dict:
    from dflash_mp.config.schema import read_target_config

    if target is None and (Path(str(cfg.model.target_path)) / "config.json").is_file():
        return read_target_config(str(cfg.model.target_path))
    from dflash_mp.plan.targets import DEFAULT_FAMILIES, resolve_target

    families = {}
    if DEFAULT_FAMILIES.is_file():
        from dflash_mp.plan.measured import read_families

        families = read_families(str(DEFAULT_FAMILIES))
    planned = resolve_target(target or cfg.preset, families)
    return {"_name_or_path": planned.shape.name, **planned.config}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        print(f"plan memory: --gpu-memory-gib {args.gpu_memory_gib}: must be positive", file=sys.stderr)
        return 2
    try:
        cfg = _config(args.overrides)
        target_config = _target_config(cfg, args.target)
        shape = training_shape(cfg, target_config)
        verdict = memory_verdict(cfg, target_config, total=args.gpu_memory_gib)
    except (PlanError, OSError, ValueError) as e:
        print(f"plan memory: {e}", file=sys.stderr)
        return 2
    ranks = [colocated_rank(shape), target_rank(shape), drafter_rank(shape)]
    if args.json:
        print(json.dumps({"ranks": [r.as_dict() for r in ranks], "verdict": verdict}, indent=1))
    else:
        print(
            f"target {shape.target.name}: {shape.target_layers_kept} layers kept, features K={shape.feature_layers}; "
            f"rows of {shape.seq_len} tokens x micro-batch {shape.micro_batch}, {shape.num_anchors} anchors x "
            f"block {shape.block_size}, {shape.draft_layers} draft layers ({shape.arch}), activation "
            f"checkpointing {'on' if shape.activation_checkpointing else 'off'}, CUDA graphs "
            f"{'on' if shape.cuda_graphs else 'off'}"
        )
        for rank in ranks:
            print("\n".join(rank.lines()))
        if verdict is not None:
            print(f"{layout_name(cfg)}: {'fits' if verdict[0] else 'does not fit'}: {verdict[1]}")
    return 0 if verdict is None or verdict[0] else 1
