"""Command line of the acceptance-length evaluation: real block speculative decoding with the full target.

    python -m dflash_mp.eval RUN_DIR | EXPORT_DIR | CHECKPOINT_DIR [--step N] [--target PATH]
        [--prompts FILE.jsonl ...] [--num-prompts N] [--max-new-tokens N] [--temperature T] [--out FILE]

Decodes every prompt with the drafter proposing each block (`dflash_mp.evaluation.decoding`; a DFlash 2
drafter proposes through its candidate selector) and plainly with the target, and writes tau
(mean acceptance length), per-position acceptance and the speedup (`dflash_mp.evaluation.acceptance`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_mp.evaluation.acceptance import (
    EvalError,
    evaluate_acceptance,
    format_table,
    held_out_prompt_files,
    load_prompts,
    load_target_model,
    resolve_device,
)
from dflash_mp.models.drafter import DFlashDrafter

# ----------------------------------------------------------------------------------------
# command line


def _load_drafter(path: Path, step: int | None) -> tuple[DFlashDrafter, Path | None]:
    """(drafter, its run directory if known) from an export, a checkpoint or a run directory."""
    from dflash_mp.export.hf import CONFIG_NAME, WEIGHTS_NAME, drafter_from_checkpoint, load_exported_drafter

    if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
        run_dir = path.parent if (path.parent / "config.yaml").is_file() else None
        return load_exported_drafter(path), run_dir
    if (path / "drafter.safetensors").is_file():
        run_dir = path.parent.parent
        return drafter_from_checkpoint(run_dir, checkpoint_dir=path), run_dir
    if (path / "config.yaml").is_file():
        export_dir = path / "export"
        if step is None and (export_dir / WEIGHTS_NAME).is_file():
            return load_exported_drafter(export_dir), path
        return drafter_from_checkpoint(path, step=step), path
    raise EvalError(
        f"{path} is neither a run directory (config.yaml), an export (config.json + model.safetensors) "
        "nor a checkpoint (drafter.safetensors)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("drafter", type=Path, help="run directory, export directory or checkpoint directory")
    parser.add_argument(
        "--step", type=int, help="with a run directory: evaluate checkpoint step N (default: its export)"
    )
    parser.add_argument("--target", help="local HF target directory (default: the run's model.target_path)")
    parser.add_argument("--prompts", nargs="+", help="chat JSONL files (default: the run's data.eval_files)")
    parser.add_argument(
        "--num-prompts", type=int, default=16, help="prompts used, from the start (default 16)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="target dtype (auto: bf16 on GPU)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the target's own modelling code"
    )
    parser.add_argument(
        "--unary",
        action="store_true",
        help="DFlash 2: propose the LM head's argmax (or sample) at each position, bypassing the selector",
    )
    parser.add_argument("--out", type=Path, help="result JSON (default: RUN_DIR/eval.json, else ./eval.json)")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from dflash_mp.data import load_renderer
    from dflash_mp.embedded import embedded_path

    try:
        drafter, run_dir = _load_drafter(args.drafter, args.step)
        run_cfg = OmegaConf.load(run_dir / "config.yaml") if run_dir is not None else None
        target_path = args.target or (
            run_cfg.model.target_path if run_cfg is not None else str(embedded_path("target"))
        )
        run_data = run_cfg.data if run_cfg is not None else {}
        prompt_files = held_out_prompt_files(args.prompts or run_data.get("eval_files", []), target_path)
        trust_remote_code = args.trust_remote_code or bool(run_cfg and run_cfg.model.trust_remote_code)
        device, dtype = resolve_device(args.device, args.dtype)
        # The run's chat template and its kwargs (e.g. enable_thinking), as training rendered its data.
        renderer = load_renderer(
            target_path,
            trust_remote_code,
            run_data.get("chat_template", ""),
            run_data.get("chat_template_kwargs", {}),
        )
        tokenizer = renderer.tokenizer
        target = load_target_model(target_path, dtype, device, trust_remote_code)
        prompts = load_prompts(prompt_files, tokenizer, limit=args.num_prompts, renderer=renderer)
        # The drafter runs in the target's dtype, as an inference engine loads it.
        drafter = drafter.to(device=device, dtype=dtype)
        if args.unary:
            if drafter.candidate_selector is None:
                raise EvalError(
                    "--unary needs a DFlash 2 drafter (model.arch=dflash2): this one has no selector"
                )
            drafter.candidate_selector = None  # the unary-only path, to compare with the served one
        result = evaluate_acceptance(
            drafter,
            target,
            tokenizer,
            prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            baseline=True,
            per_prompt=True,
        )
    except (EvalError, FileNotFoundError) as e:
        print(f"dflash_mp.eval: {e}", file=sys.stderr)
        return 2
    result.update(
        drafter=str(args.drafter), target=str(target_path), prompt_files=[str(p) for p in prompt_files]
    )
    out = args.out or ((run_dir or Path(".")) / "eval.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
