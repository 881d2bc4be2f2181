"""Command line of the acceptance-length evaluation: real block speculative decoding with the full target.

    python -m dflash_mp.eval RUN_DIR | EXPORT_DIR | CHECKPOINT_DIR [--step N] [--target PATH]
        [--prompts FILE.jsonl ...] [--num-prompts N] [--max-new-tokens N] [--temperature T] [--out FILE]
    python -m dflash_mp.eval RUN_DIR --benchmarks [NAME=]FILE ... [--limit N] [--max-new-tokens N]
        [--temperature T ...] [--thinking both|on|off] [--top-k K] [--top-p P] [--out FILE]
        [--server URL [--served-only] [--tolerance 0.1] ...]
    either form: [--length-buckets 512,1024,4096]

Decodes every prompt with the drafter proposing each block (`dflash_mp.evaluation.decoding`; a DFlash 2
drafter proposes through its candidate selector) and plainly with the target, and writes tau
(mean acceptance length), per-position acceptance and the speedup (`dflash_mp.evaluation.acceptance`).
With --benchmarks: the table over standard benchmark files (GSM8K, MATH-500, AIME, HumanEval,
MBPP, LiveCodeBench, MT-Bench, Alpaca; `dflash_mp.data.benchmark_sets`), at temperatures 0
and 1 and with thinking on and off where the chat template has the switch
(`dflash_mp.evaluation.benchmark_table`). With --server, a running vLLM or SGLang server decodes
the same prompts and its own acceptance counters are printed beside tau
(`dflash_mp.evaluation.served_acceptance`).
Both give tau by prompt length too, in buckets read against the run's data.max_length
(`dflash_mp.evaluation.length_buckets`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_mp.data.benchmark_sets import Benchmark, BenchmarkError, resolve_benchmarks
from dflash_mp.evaluation.acceptance import (
    evaluate_acceptance,
    format_table,
    load_target_model,
    resolve_device,
)
from dflash_mp.evaluation.benchmark_table import format_benchmark_table, plan_table, run_table
from dflash_mp.evaluation.length_buckets import LengthBuckets, parse_edges
from dflash_mp.evaluation.prompts import EvalError, held_out_prompt_files, load_prompts
from dflash_mp.evaluation.served_acceptance import ServedAcceptance, add_served_arguments, measure_served
from dflash_mp.evaluation.served_comparison import print_served, report_served_only, served_summary
from dflash_mp.models.drafter import DFlashDrafter

# --server: served and local tau differ by more than --tolerance (the JSON and the report are written).
EXIT_SERVED_DISAGREES = 1
# The DFlash authors' evaluation decodes up to 2048 new tokens (github.com/z-lab/dflash, benchmark.py).
BENCHMARK_MAX_NEW_TOKENS = 2048

# ----------------------------------------------------------------------------------------
# command line


def _load_drafter(path: Path, step: int | None) -> tuple[DFlashDrafter, Path | None, str]:
    """(drafter, its run directory if known, which weights they are) from an export, a checkpoint
    or a run directory."""
    from dflash_mp.export.hf import CONFIG_NAME, WEIGHTS_NAME, drafter_from_checkpoint, load_exported_drafter
    from dflash_mp.run import checkpoint

    if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
        run_dir = path.parent if (path.parent / "config.yaml").is_file() else None
        return load_exported_drafter(path), run_dir, f"the export {path}"
    if (path / "drafter.safetensors").is_file():
        run_dir = path.parent.parent
        number = path.name.removeprefix("step_")
        scored = f"checkpoint step {int(number) if number.isdigit() else number} ({path})"
        return drafter_from_checkpoint(run_dir, checkpoint_dir=path), run_dir, scored
    if (path / "config.yaml").is_file():
        export_dir = path / "export"
        if step is None and (export_dir / WEIGHTS_NAME).is_file():
            return (
                load_exported_drafter(export_dir),
                path,
                f"the export {export_dir} (--step N: a checkpoint)",
            )
        drafter = drafter_from_checkpoint(path, step=step)
        if step is None:  # the newest, as drafter_from_checkpoint took it
            step = int(checkpoint.complete_checkpoints(path / "checkpoints")[-1].name.removeprefix("step_"))
        return drafter, path, f"checkpoint step {step} of {path}"
    raise EvalError(
        f"{path} is neither a run directory (config.yaml), an export (config.json + model.safetensors) "
        "nor a checkpoint (drafter.safetensors)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"new tokens per prompt (default 64; with --benchmarks {BENCHMARK_MAX_NEW_TOKENS}, the DFlash eval's)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        help="0: greedy (default); > 0: sampling. With --benchmarks one column each (default: 0 1)",
    )
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        metavar="[NAME=]FILE",
        help="benchmark files (JSONL/Parquet) as their publishers distribute them: the acceptance table",
    )
    parser.add_argument(
        "--limit", type=int, help="with --benchmarks: the first N records of each (default all)"
    )
    parser.add_argument(
        "--thinking",
        choices=("both", "on", "off"),
        default="both",
        help="with --benchmarks: enable_thinking values, where the chat template has the switch",
    )
    parser.add_argument("--top-k", type=int, help="sampling top-k (default: the target's generation_config)")
    parser.add_argument(
        "--top-p", type=float, help="sampling top-p (default: the target's generation_config)"
    )
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
    parser.add_argument(
        "--out",
        type=Path,
        help="result JSON (default: RUN_DIR/eval.json, with --benchmarks RUN_DIR/eval-benchmarks.json; "
        "else in the current directory)",
    )
    parser.add_argument(
        "--length-buckets",
        type=parse_edges,
        metavar="N,N,...",
        help="tau by prompt length: the largest prompt length (tokens) of each bucket, e.g. 512,1024,4096 "
        "(default: powers of two from 256 below the run's data.max_length; data.max_length is always one)",
    )
    add_served_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    problem = _sampling_problem(args)
    if problem:
        parser.error(problem)
    prompt_files = served = None
    try:
        # A missing or unknown benchmark file is refused before anything heavy is read.
        benchmarks = resolve_benchmarks(args.benchmarks) if args.benchmarks else None
        run = _open_run(args)
        if benchmarks is not None:
            result = _benchmark_acceptance(args, run, benchmarks)
        else:
            prompt_files = held_out_prompt_files(
                args.prompts or run.data.get("eval_files", []), run.target_path
            )
            # The server first: it is quick to fail, and --served-only needs no local target.
            served = measure_served(
                args, prompt_files, run.data, str(run.target_path), run.drafter.block_size
            )
            if served is not None and args.served_only:
                return report_served_only(served, args)
            result = _prompt_acceptance(args, run, prompt_files)
    except (EvalError, BenchmarkError, FileNotFoundError) as e:
        print(f"dflash_mp.eval: {e}", file=sys.stderr)
        return 2
    return _report(args, run, result, prompt_files, served)


@dataclass
class _Run:
    """The drafter scored, and what its run directory (if any) says of the target and the data."""

    drafter: DFlashDrafter
    directory: Path | None
    scored: str  # which weights, for the report
    target_path: str
    data: Any  # the run's data config; {} without a run directory
    lengths: LengthBuckets
    trust_remote_code: bool


def _open_run(args: argparse.Namespace) -> _Run:
    from omegaconf import OmegaConf

    from dflash_mp.embedded import embedded_path

    drafter, run_dir, scored = _load_drafter(args.drafter, args.step)
    print(f"dflash_mp.eval: scoring {scored}", flush=True)
    run_cfg = OmegaConf.load(run_dir / "config.yaml") if run_dir is not None else None
    target_path = args.target or (
        run_cfg.model.target_path if run_cfg is not None else str(embedded_path("target"))
    )
    run_data = run_cfg.data if run_cfg is not None else {}
    lengths = LengthBuckets(run_data.get("max_length"), args.length_buckets)
    trust_remote_code = args.trust_remote_code or bool(run_cfg and run_cfg.model.trust_remote_code)
    return _Run(drafter, run_dir, scored, target_path, run_data, lengths, trust_remote_code)


def _device_and_renderer(args: argparse.Namespace, run: _Run) -> tuple[Any, Any, Any]:
    """(device, dtype, chat renderer) the evaluation runs with."""
    from dflash_mp.data import load_renderer

    device, dtype = resolve_device(args.device, args.dtype)
    # The run's chat template and its kwargs (e.g. enable_thinking), as training rendered its data.
    renderer = load_renderer(
        run.target_path,
        run.trust_remote_code,
        run.data.get("chat_template", ""),
        run.data.get("chat_template_kwargs", {}),
    )
    return device, dtype, renderer


def _load_models(args: argparse.Namespace, run: _Run, device: Any, dtype: Any) -> tuple[DFlashDrafter, Any]:
    """(drafter, target) on the device, the drafter without its selector for --unary."""
    target = load_target_model(run.target_path, dtype, device, run.trust_remote_code)
    # The drafter runs in the target's dtype, as an inference engine loads it.
    drafter = run.drafter.to(device=device, dtype=dtype)
    if args.unary:
        if drafter.candidate_selector is None:
            raise EvalError("--unary needs a DFlash 2 drafter (model.arch=dflash2): this one has no selector")
        drafter.candidate_selector = None  # the unary-only path, to compare with the served one
    return drafter, target


def _prompt_acceptance(args: argparse.Namespace, run: _Run, prompt_files: list[str]) -> dict[str, Any]:
    """tau and the speedup over the held-out prompts in `prompt_files`."""
    device, dtype, renderer = _device_and_renderer(args, run)
    drafter, target = _load_models(args, run, device, dtype)
    tokenizer = renderer.tokenizer
    prompts = load_prompts(prompt_files, tokenizer, limit=args.num_prompts, renderer=renderer)
    return evaluate_acceptance(
        drafter,
        target,
        tokenizer,
        prompts,
        args.max_new_tokens or 64,
        temperature=args.temperature[0] if args.temperature else 0.0,
        top_k=args.top_k or 0,
        top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed,
        baseline=True,
        per_prompt=True,
        lengths=run.lengths,
    )


def _benchmark_acceptance(args: argparse.Namespace, run: _Run, benchmarks: list[Benchmark]) -> dict[str, Any]:
    """The --benchmarks table: tau per benchmark, temperature and thinking setting."""
    device, dtype, renderer = _device_and_renderer(args, run)
    # Records, settings and prompt lengths, before the target loads.
    plan = plan_table(
        renderer,
        benchmarks,
        run.target_path,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens or BENCHMARK_MAX_NEW_TOKENS,
        temperatures=args.temperature or (0.0, 1.0),
        thinking=args.thinking,
        top_k=args.top_k,
        top_p=args.top_p,
        lengths=run.lengths,
    )
    drafter, target = _load_models(args, run, device, dtype)
    return run_table(plan, drafter, target, seed=args.seed)


def _report(
    args: argparse.Namespace,
    run: _Run,
    result: dict[str, Any],
    prompt_files: list[str] | None,
    served: ServedAcceptance | None,
) -> int:
    """Write the result JSON and print its table; `prompt_files` None: the benchmark table."""
    result.update(drafter=str(args.drafter), scored=run.scored, target=str(run.target_path))
    if prompt_files is not None:
        result["prompt_files"] = [str(p) for p in prompt_files]
    if served is not None:
        result["served"] = served_summary(served, result, args.tolerance)
    name = "eval.json" if prompt_files is not None else "eval-benchmarks.json"
    out = args.out or ((run.directory or Path(".")) / name)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result) if prompt_files is not None else format_benchmark_table(result))
    if served is not None:
        print_served(result["served"])
    print(f"wrote {out}")
    if served is not None and result["served"].get("agrees") is False:
        return EXIT_SERVED_DISAGREES  # a check that failed: scripts and CI must see it
    return 0


def _sampling_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling and benchmark options, or None."""
    temperatures = args.temperature or []
    if args.benchmarks and getattr(args, "server", None):
        return "--server compares the run's eval prompts; run --benchmarks without it (one at a time)"
    if any(t < 0 for t in temperatures):
        return f"--temperature {' '.join(map(str, temperatures))}: must be >= 0"
    if len(temperatures) > 1 and not args.benchmarks:
        return "--temperature takes one value without --benchmarks (one table column per value with it)"
    if args.top_k is not None and args.top_k < 0:
        return f"--top-k {args.top_k}: must be >= 0 (0: no top-k cut)"
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p}: must be in (0, 1] (1: no top-p cut)"
    if args.limit is not None and args.limit < 1:
        return f"--limit {args.limit}: must be >= 1"
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return f"--max-new-tokens {args.max_new_tokens}: must be >= 1"
    if args.benchmarks and args.prompts:
        return "--benchmarks and --prompts: give one of them (a table, or the held-out prompts)"
    return None


if __name__ == "__main__":
    sys.exit(main())
