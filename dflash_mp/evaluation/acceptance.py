"""Acceptance length of a drafter on held-out prompts: checks, the evaluation and its summary
(`dflash_mp.evaluation.decoding` runs the decoding; `evaluator.py` is what training calls)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_mp.evaluation.decoding import Generation, autoregressive_generate, speculative_generate
from dflash_mp.evaluation.length_buckets import LengthBuckets, format_buckets
from dflash_mp.evaluation.prompts import EvalError, Prompt

if TYPE_CHECKING:  # annotations only: the preflight imports this without the models
    from dflash_mp.models.drafter import DFlashDrafter


def check_drafter_fits(drafter: DFlashDrafter, target_config: Any) -> None:
    """Raise EvalError unless the drafter reads this target (its layers, width and vocabulary)."""
    text_config = target_config.get_text_config()
    num_layers, hidden, vocab = text_config.num_hidden_layers, text_config.hidden_size, text_config.vocab_size
    problems = []
    bad_ids = [i for i in drafter.target_layer_ids if not 0 <= i < num_layers]
    if bad_ids:
        problems.append(
            f"its target_layer_ids {drafter.target_layer_ids} include {bad_ids}, outside this target's "
            f"layers [0, {num_layers - 1}]"
        )
    trained_for = getattr(drafter.config, "num_target_layers", num_layers)
    if trained_for != num_layers:
        problems.append(f"it was built for a target with {trained_for} layers, this one has {num_layers}")
    if drafter.config.hidden_size != hidden:
        problems.append(f"its hidden_size is {drafter.config.hidden_size}, the target's is {hidden}")
    if not 0 <= drafter.mask_token_id < vocab:
        problems.append(
            f"its mask_token_id {drafter.mask_token_id} is outside the target vocabulary [0, {vocab})"
        )
    if getattr(drafter, "arch", "dflash") == "dflash2" and drafter.config.vocab_size != vocab:
        problems.append(
            f"its selector codebooks cover {drafter.config.vocab_size} token ids, the target's vocabulary "
            f"has {vocab} (DFlash 2 needs the full target vocabulary)"
        )
    if problems:
        raise EvalError(
            "the drafter does not fit the target: "
            + "; ".join(problems)
            + ". Evaluate it with the target it was trained for."
        )


def check_prompt_lengths(prompts: Sequence[Prompt], max_new_tokens: int, context: int | None) -> None:
    if max_new_tokens < 1:
        raise EvalError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if not prompts:
        raise EvalError("no prompts to evaluate")
    if context is None:
        return
    too_long = [p for p in prompts if len(p.input_ids) + max_new_tokens > context]
    if too_long:
        worst = max(too_long, key=lambda p: len(p.input_ids))
        raise EvalError(
            f"{len(too_long)} prompt(s) do not fit the target's context of {context} positions with "
            f"max_new_tokens={max_new_tokens}, e.g. {worst.source} ({len(worst.input_ids)} prompt tokens): "
            "lower max_new_tokens or drop the long prompts"
        )


def stop_token_ids(tokenizer: Any, target: nn.Module) -> list[int]:
    """End-of-turn tokens: the tokenizer's eos and the target's generation_config eos ids."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def evaluate_acceptance(
    drafter: DFlashDrafter,
    target_model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    baseline: bool = False,
    per_prompt: bool = False,
    lengths: LengthBuckets | None = None,
) -> dict[str, Any]:
    """Speculative decoding of every prompt; returns tau and friends as plain JSON-able numbers
    (`acceptance_summary`). Sampling (temperature > 0) draws from the distributions cut by top_k
    and top_p (0 and 1: uncut). `baseline` also decodes every prompt autoregressively for the
    speedup; `lengths` adds tau by prompt length. The drafter is put in eval mode for the call and
    restored after.
    """
    check_drafter_fits(drafter, target_model.config)
    context = getattr(target_model.config.get_text_config(), "max_position_embeddings", None)
    check_prompt_lengths(prompts, max_new_tokens, context)
    stops = stop_token_ids(tokenizer, target_model)
    device = target_model.get_input_embeddings().weight.device
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    # One generator per evaluation: the same seed gives the same samples on every call.
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    was_training = drafter.training
    drafter.eval()
    try:
        runs = [
            speculative_generate(
                drafter, target_model, p.input_ids, max_new_tokens, stops, generator=generator, **sampling
            )
            for p in prompts
        ]
    finally:
        drafter.train(was_training)
    plain = None
    if baseline:
        generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        plain = [
            autoregressive_generate(
                target_model, p.input_ids, max_new_tokens, stops, generator=generator, **sampling
            )
            for p in prompts
        ]
    return acceptance_summary(
        prompts, runs, plain, drafter.block_size, max_new_tokens, temperature, per_prompt, lengths
    )


def pooled_rates(runs: Sequence[Generation]) -> dict[str, float]:
    """tau, the mean over the verify rounds of all `runs` together, and new tokens per target
    forward (prefills included): of all the prompts, and of each bucket of `LengthBuckets`."""
    lengths = [n for run in runs for n in run.acceptance_lengths]
    new_tokens = sum(len(run.new_tokens) for run in runs)
    return {
        "tau": statistics.fmean(lengths) if lengths else 0.0,
        "tokens_per_target_forward": new_tokens / sum(run.target_forwards for run in runs),
    }


def acceptance_summary(
    prompts: Sequence[Prompt],
    runs: Sequence[Generation],
    plain: Sequence[Generation] | None,
    block_size: int,
    max_new_tokens: int,
    temperature: float,
    per_prompt: bool = False,
    lengths: LengthBuckets | None = None,
) -> dict[str, Any]:
    """tau and friends of speculative decodings `runs` of `prompts` (and of their autoregressive
    decodings `plain`, for the speedup), as plain JSON-able numbers; with `lengths`, also tau and
    tokens per target forward by prompt length.

    tau is the mean acceptance length (tokens per verify forward, bonus included, as in the DFlash
    paper); acceptance_rate[k-1] the fraction of rounds whose block index k was accepted;
    acceptance_length_counts[n-1] the rounds that produced n tokens. Greedy, `plain` also checks
    that both decodings gave identical outputs.
    """
    rounds = [n for run in runs for n in run.acceptance_lengths]
    drafted = [sum(column) for column in zip(*(run.drafted for run in runs), strict=True)]
    accepted = [sum(column) for column in zip(*(run.accepted for run in runs), strict=True)]
    new_tokens = sum(len(run.new_tokens) for run in runs)
    seconds = sum(run.seconds for run in runs)
    result: dict[str, Any] = {
        **pooled_rates(runs),
        "acceptance_rate": [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)],
        "acceptance_length_counts": [rounds.count(n) for n in range(1, block_size + 1)],
        "tokens_per_s": new_tokens / seconds,
        "num_prompts": len(prompts),
        "new_tokens": new_tokens,
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }
    if plain is not None:
        plain_tokens_per_s = sum(len(run.new_tokens) for run in plain) / sum(run.seconds for run in plain)
        result["autoregressive_tokens_per_s"] = plain_tokens_per_s
        result["speedup"] = result["tokens_per_s"] / plain_tokens_per_s
        if temperature <= 0:
            result["matches_autoregressive"] = all(
                s.new_tokens == a.new_tokens for s, a in zip(runs, plain, strict=True)
            )
    if lengths is not None:
        result.update(lengths.summarize([len(p.input_ids) for p in prompts], runs, pooled_rates))
    if per_prompt:
        result["prompts"] = [
            {
                "source": p.source,
                "prompt_tokens": len(p.input_ids),
                "new_tokens": run.new_tokens,
                "acceptance_lengths": run.acceptance_lengths,
            }
            for p, run in zip(prompts, runs, strict=True)
        ]
    return result


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Command-line "auto" choices: this process's GPU (LOCAL_RANK under torchrun) in bf16, else CPU fp32."""
    if device == "auto":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    auto = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    return torch_device, {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, auto)


def load_target_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, trust_remote_code: bool = False
) -> nn.Module:
    """The whole target (with its LM head) for decoding, from the local directory only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
    )
    return model.to(device).eval().requires_grad_(False)


def require_room_for_target(
    path: str | Path, dtype: torch.dtype, device: torch.device, free_bytes: int
) -> None:
    """EvalError unless the whole target's weights fit in `free_bytes` of `device` (safetensors only)."""
    from dflash_mp.models.target import checkpoint_bytes

    needed = checkpoint_bytes(path, dtype)
    if needed is not None and needed > free_bytes:
        raise EvalError(
            f"eval.every decodes with the whole target ({path}: {needed / 1e9:.1f} GB in "
            f"{str(dtype).removeprefix('torch.')}) on the first drafter rank's {device}, which has "
            f"{free_bytes / 1e9:.1f} GB free beside the drafter: set eval.every=0 and measure tau "
            "after training with `python -m dflash_mp.eval` where the target fits (a target that "
            "needed topology.target_parallel > 1 does not fit one GPU)"
        )


def format_table(result: dict[str, Any]) -> str:
    """The result as a few readable lines for the console."""
    lines = [
        f"prompts {result['num_prompts']}, new tokens {result['new_tokens']}, block size {result['block_size']}, "
        f"temperature {result['temperature']}",
        f"  tau (mean acceptance length)   {result['tau']:.3f}",
        f"  tokens per target forward      {result['tokens_per_target_forward']:.3f}",
        f"  speculative tokens/s           {result['tokens_per_s']:.1f}",
    ]
    if "autoregressive_tokens_per_s" in result:
        lines.append(f"  autoregressive tokens/s        {result['autoregressive_tokens_per_s']:.1f}")
        lines.append(f"  speedup                        {result['speedup']:.2f}x")
    if "matches_autoregressive" in result:
        lines.append(f"  same output as greedy          {result['matches_autoregressive']}")
    lines.append("  block index   acceptance rate")
    lines += [f"  {k:>11}   {rate:.3f}" for k, rate in enumerate(result["acceptance_rate"], start=1)]
    return "\n".join(lines + format_buckets(result))
