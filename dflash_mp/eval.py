"""Acceptance length of a DFlash drafter: real block speculative decoding with the full target.

    python -m dflash_mp.eval RUN_DIR | EXPORT_DIR | CHECKPOINT_DIR [--step N] [--target PATH]
        [--prompts FILE.jsonl ...] [--num-prompts N] [--max-new-tokens N] [--temperature T] [--out FILE]

One decoding round, after the target has accepted everything up to position p (DESIGN.md §3):
the drafter gets the block `[token at p, MASK x (B-1)]` at positions p..p+B-1 and the target's
features of all positions < p, and proposes B-1 tokens; the target scores the whole block in one
forward over its KV cache; the longest prefix of proposals the target agrees with is accepted,
plus one token of the target's own (the bonus). Greedy verification compares with the target's
argmax, so the output is exactly the target's greedy decoding; with temperature > 0, rejection
sampling keeps the output distributed as the target's. The accounting (acceptance length = tokens
produced per verify forward, bonus included, cut at the length limit and at a stop token) is the
reference `dflash.model.dflash_generate`'s, so tau here is the number the DFlash paper reports.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_mp.models.drafter import DFlashDrafter


class EvalError(ValueError):
    """Input the evaluation cannot run on; the message names the file or setting and the fix."""


@dataclass
class Prompt:
    """A tokenized prompt and where it came from (file:line), for error messages."""

    source: str
    input_ids: list[int]


@dataclass
class Generation:
    """One prompt's decoding."""

    new_tokens: list[int]
    seconds: float
    target_forwards: int  # the prefill included
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per verify forward
    drafted: list[int] = field(default_factory=list)  # [B-1]: rounds that proposed block index k+1
    accepted: list[int] = field(default_factory=list)  # [B-1]: rounds that accepted block index k+1


# ----------------------------------------------------------------------------------------
# prompts


def chat_messages(record: Any) -> list[dict[str, str]]:
    """The role/content pairs of a chat record {"messages": [...]}; ValueError says what is wrong."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            'expected {"messages": [{"role": ..., "content": ...}, ...]} with at least one message'
        )
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f'message {i} must be an object with string "role" and "content"')
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def prompt_messages(record: Any) -> list[dict[str, str]]:
    """The messages of a chat record before its first assistant turn; they must end with a user turn."""
    messages = chat_messages(record)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompt = messages[: replies[0]] if replies else messages
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError("the messages before the first assistant turn must end with a user turn")
    return prompt


def load_prompts(paths: Sequence[str | Path], tokenizer: Any, limit: int | None = None) -> list[Prompt]:
    """The first `limit` prompts of chat JSONL files, rendered with the generation prompt.

    A record's prompt is its messages before the first assistant turn (all of them for a
    prompt-only record), so training files and held-out conversations both serve as prompts.
    """
    if not paths:
        raise EvalError("no prompt files given: pass --prompts FILE.jsonl (or set data.eval_files)")
    prompts: list[Prompt] = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise EvalError(f"{path}: cannot read the prompt file ({e.strerror})") from None
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and len(prompts) >= limit:
                return prompts
            if not line.strip():
                continue
            source = f"{path}:{line_number}"
            try:
                messages = prompt_messages(json.loads(line))
            except json.JSONDecodeError as e:
                raise EvalError(f"{source}: malformed JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise EvalError(f"{source}: {e}") from None
            input_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            prompts.append(Prompt(source=source, input_ids=list(input_ids)))
    if not prompts:
        raise EvalError(
            f"no prompts in {', '.join(map(str, paths))}: every file is empty or blank. Give JSONL "
            'files with one {"messages": [{"role": "user", "content": ...}, ...]} record per line.'
        )
    return prompts


def load_eval_prompts(cfg: Any, tokenizer: Any) -> list[Prompt]:
    """The held-out prompts for evaluation during training: cfg.eval.num_prompts of cfg.data.eval_files
    (the embedded eval set when none are configured)."""
    from dflash_mp.embedded import embedded_path

    files = list(cfg.data.eval_files) or [embedded_path("data/eval.jsonl")]
    return load_prompts(files, tokenizer, limit=cfg.eval.num_prompts)


# ----------------------------------------------------------------------------------------
# checks


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
    if problems:
        raise EvalError(
            "the drafter does not fit the target: "
            + "; ".join(problems)
            + ". Evaluate it with the target it was trained for."
        )


def _check_lengths(prompts: Sequence[Prompt], max_new_tokens: int, context: int | None) -> None:
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


# ----------------------------------------------------------------------------------------
# decoding


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_cache(target: nn.Module) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    # Sliding-window layers drop old entries unless told that the cache will be rolled back.
    cache.activate_past_recording()
    return cache


@functools.cache
def _cache_keyword(model_type: type) -> str:
    # transformers 5 renamed past_key_values to cache; the old name is gone from 5.40 on.
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def _crop(cache: Any, length: int) -> None:
    cache.crop(length - cache.get_seq_length())  # crop() takes minus the number of tokens to drop


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [N] from logits [N, V]: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(_probs(logits, temperature), 1, generator=generator)[:, 0]


def _rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted proposals, next token) of speculative sampling (Leviathan et al. 2023, Alg. 1).

    Proposal k is kept with probability min(1, p_k / q_k); at the first rejection the next token is
    drawn from normalize(max(0, p - q)), and after all B-1 acceptances from the target's last row,
    which makes every emitted token distributed exactly as the target's own sample.
    """
    rows = torch.arange(draft_tokens.numel(), device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    uniform = torch.rand(q.shape, generator=generator, device=q.device)
    accepted = int((uniform * q < p).int().cumprod(0).sum())
    if accepted == draft_tokens.numel():
        residual = target_probs[accepted]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        if residual.sum() <= 0:  # p == q: the rejection had probability 0; fall back to p
            residual = target_probs[accepted]
    return accepted, int(torch.multinomial(residual, 1, generator=generator))


def _target_step(
    target: nn.Module,
    token_ids: list[int],
    start: int,
    cache: Any,
    layer_ids: list[int] | None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target forward of `token_ids` at positions start.. over the cache: (logits [T, V], features [T, K*H])."""
    device = target.get_input_embeddings().weight.device
    input_ids = torch.tensor([token_ids], device=device)
    positions = torch.arange(start, start + len(token_ids), device=device)[None]
    output = target(
        input_ids=input_ids,
        position_ids=positions,
        **{_cache_keyword(type(target)): cache},
        use_cache=True,
        output_hidden_states=layer_ids is not None,
        logits_to_keep=logits_to_keep,
    )
    if layer_ids is None:
        return output.logits[0], None
    # hidden_states[0] is the embedding output, so target layer i is entry i + 1 (DESIGN.md §3).
    features = torch.cat([output.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return output.logits[0], features[0]


def _propose(
    drafter: DFlashDrafter,
    target: nn.Module,
    context_features: torch.Tensor,
    first_token: int,
    start: int,
    size: int,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's `size - 1` proposals for block [first_token, MASK...] at positions start..; and
    their sampling distributions [size-1, V] when temperature > 0."""
    device = context_features.device
    param = next(drafter.parameters())
    block_ids = torch.full((1, size), drafter.mask_token_id, device=device)
    block_ids[0, 0] = first_token
    embed_weight = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    context_len = context_features.shape[0]
    # Eager even when the layers are compiled for training: a new context length every call would
    # otherwise recompile them, and fill the compile cache that training shapes need.
    with torch.compiler.set_stance("force_eager"):
        hidden = drafter(
            context_features[None].to(param.dtype),
            F.embedding(block_ids, embed_weight).to(param.dtype),
            torch.arange(context_len, device=device)[None],
            torch.arange(start, start + size, device=device)[None],
            # One block that sees all context before it and itself: everything.
            torch.ones(1, 1, size, context_len + size, dtype=torch.bool, device=device),
        )
    # Output at block index k guesses the token at start + k; index 0 is the known token.
    logits = head(hidden[0, 1:].to(head.weight.dtype))
    proposals = _pick(logits, temperature, generator).tolist()
    return proposals, (_probs(logits, temperature) if temperature > 0 else None)


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Block speculative decoding of one prompt (batch 1) with the drafter proposing every block."""
    block_size, layer_ids = drafter.block_size, drafter.target_layer_ids
    device = target.get_input_embeddings().weight.device
    stop = set(stop_token_ids)
    max_length = len(prompt_ids) + max_new_tokens
    drafted, accepted_at = [0] * (block_size - 1), [0] * (block_size - 1)
    acceptance_lengths = []
    _synchronize(device)
    began = time.perf_counter()

    cache = _new_cache(target)
    logits, context_features = _target_step(target, prompt_ids, 0, cache, layer_ids, logits_to_keep=1)
    tokens = list(prompt_ids) + _pick(logits[-1:], temperature, generator).tolist()
    # tokens[start] is the newest token: produced, but not yet run through the target.
    start = len(prompt_ids)
    stopped = tokens[start] in stop
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        proposals, draft_probs = [], None
        if size > 1:
            proposals, draft_probs = _propose(
                drafter, target, context_features, tokens[start], start, size, temperature, generator
            )
        block = [tokens[start], *proposals]
        logits, block_features = _target_step(target, block, start, cache, layer_ids)
        if temperature <= 0:
            agrees = torch.tensor(proposals, device=device) == logits[:-1].argmax(-1)
            accepted = int(agrees.int().cumprod(0).sum())
            next_token = int(logits[accepted].argmax())
        elif proposals:
            accepted, next_token = _rejection_sample(
                torch.tensor(proposals, device=device), draft_probs, _probs(logits, temperature), generator
            )
        else:
            accepted, next_token = 0, int(_pick(logits[-1:], temperature, generator))
        for k in range(len(proposals)):
            drafted[k] += 1
            accepted_at[k] += k < accepted
        new = [*proposals[:accepted], next_token]
        produced = min(len(new), max_length - start - 1)
        stop_at = next((i for i, token in enumerate(new[:produced]) if token in stop), None)
        if stop_at is not None:
            produced, stopped = stop_at + 1, True
        tokens = tokens[: start + 1] + new[:produced]
        # The target's features of the block are valid up to the last token it agreed with.
        context_features = torch.cat([context_features, block_features[:produced]])
        start += produced
        _crop(cache, start)
        acceptance_lengths.append(produced)
    _synchronize(device)
    return Generation(
        new_tokens=tokens[len(prompt_ids) :],
        seconds=time.perf_counter() - began,
        target_forwards=1 + len(acceptance_lengths),
        acceptance_lengths=acceptance_lengths,
        drafted=drafted,
        accepted=accepted_at,
    )


@torch.inference_mode()
def autoregressive_generate(
    target: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Plain decoding with the target, one token per forward over a KV cache: the baseline."""
    device = target.get_input_embeddings().weight.device
    stop = set(stop_token_ids)
    _synchronize(device)
    began = time.perf_counter()
    cache = _new_cache(target)
    logits, _ = _target_step(target, prompt_ids, 0, cache, None, logits_to_keep=1)
    new_tokens = _pick(logits[-1:], temperature, generator).tolist()
    while len(new_tokens) < max_new_tokens and new_tokens[-1] not in stop:
        logits, _ = _target_step(target, new_tokens[-1:], len(prompt_ids) + len(new_tokens) - 1, cache, None)
        new_tokens += _pick(logits[-1:], temperature, generator).tolist()
    _synchronize(device)
    return Generation(
        new_tokens=new_tokens, seconds=time.perf_counter() - began, target_forwards=len(new_tokens)
    )


# ----------------------------------------------------------------------------------------
# evaluation


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
    seed: int = 0,
    baseline: bool = False,
    per_prompt: bool = False,
) -> dict[str, Any]:
    """Speculative decoding of every prompt; returns tau and friends as plain JSON-able numbers.

    tau is the mean acceptance length (tokens per verify forward, bonus included, as in the DFlash
    paper); acceptance_rate[k-1] the fraction of rounds whose block index k was accepted.
    `baseline` also decodes every prompt autoregressively for the speedup (and, greedy, checks that
    both outputs are identical). The drafter is put in eval mode for the call and restored after.
    """
    check_drafter_fits(drafter, target_model.config)
    context = getattr(target_model.config.get_text_config(), "max_position_embeddings", None)
    _check_lengths(prompts, max_new_tokens, context)
    stops = stop_token_ids(tokenizer, target_model)
    device = target_model.get_input_embeddings().weight.device
    # One generator per evaluation: the same seed gives the same samples on every call.
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    was_training = drafter.training
    drafter.eval()
    try:
        runs = [
            speculative_generate(
                drafter, target_model, p.input_ids, max_new_tokens, stops, temperature, generator
            )
            for p in prompts
        ]
    finally:
        drafter.train(was_training)
    lengths = [n for run in runs for n in run.acceptance_lengths]
    drafted = [sum(column) for column in zip(*(run.drafted for run in runs), strict=True)]
    accepted = [sum(column) for column in zip(*(run.accepted for run in runs), strict=True)]
    new_tokens = sum(len(run.new_tokens) for run in runs)
    seconds = sum(run.seconds for run in runs)
    result: dict[str, Any] = {
        "tau": statistics.fmean(lengths) if lengths else 0.0,
        "acceptance_rate": [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)],
        "acceptance_length_counts": [lengths.count(n) for n in range(1, drafter.block_size + 1)],
        "tokens_per_target_forward": new_tokens / sum(run.target_forwards for run in runs),
        "tokens_per_s": new_tokens / seconds,
        "num_prompts": len(prompts),
        "new_tokens": new_tokens,
        "block_size": drafter.block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }
    if baseline:
        generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        plain = [
            autoregressive_generate(target_model, p.input_ids, max_new_tokens, stops, temperature, generator)
            for p in prompts
        ]
        plain_tokens_per_s = sum(len(run.new_tokens) for run in plain) / sum(run.seconds for run in plain)
        result["autoregressive_tokens_per_s"] = plain_tokens_per_s
        result["speedup"] = result["tokens_per_s"] / plain_tokens_per_s
        if temperature <= 0:
            result["matches_autoregressive"] = all(
                s.new_tokens == a.new_tokens for s, a in zip(runs, plain, strict=True)
            )
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


class AcceptanceEvaluator:
    """`evaluate_acceptance` during training: the full target, its tokenizer and cfg.eval.num_prompts
    held-out prompts loaded once, in the training precision, and checked before the first step.

    The whole target (LM head included) lives on the evaluating rank, so enable eval.every only
    where the target fits beside the drafter.
    """

    def __init__(self, cfg: Any, device: torch.device) -> None:
        from dflash_mp.data import load_tokenizer
        from dflash_mp.trainer import resolve_precision

        dtype, _, _ = resolve_precision(cfg, device)
        trust_remote_code = cfg.model.trust_remote_code
        self.tokenizer = load_tokenizer(cfg.model.target_path, trust_remote_code=trust_remote_code)
        self.target = load_target_model(cfg.model.target_path, dtype, device, trust_remote_code)
        self.prompts = load_eval_prompts(cfg, self.tokenizer)
        self.max_new_tokens = cfg.eval.max_new_tokens
        context = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        _check_lengths(self.prompts, self.max_new_tokens, context)

    def __call__(self, drafter: DFlashDrafter) -> dict[str, Any]:
        """tau and friends of `drafter` (the bare module, not its DDP wrapper) on the held-out prompts."""
        return evaluate_acceptance(drafter, self.target, self.tokenizer, self.prompts, self.max_new_tokens)


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
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# command line


def _load_drafter(path: Path, step: int | None) -> tuple[DFlashDrafter, Path | None]:
    """(drafter, its run directory if known) from an export, a checkpoint or a run directory."""
    from dflash_mp.export import CONFIG_NAME, WEIGHTS_NAME, drafter_from_checkpoint, load_exported_drafter

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
    parser.add_argument("--out", type=Path, help="result JSON (default: RUN_DIR/eval.json, else ./eval.json)")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from dflash_mp.data import load_tokenizer
    from dflash_mp.embedded import embedded_path

    try:
        drafter, run_dir = _load_drafter(args.drafter, args.step)
        run_cfg = OmegaConf.load(run_dir / "config.yaml") if run_dir is not None else None
        target_path = args.target or (
            run_cfg.model.target_path if run_cfg is not None else str(embedded_path("target"))
        )
        prompt_files = args.prompts or (list(run_cfg.data.eval_files) if run_cfg is not None else [])
        prompt_files = prompt_files or [str(embedded_path("data/eval.jsonl"))]
        trust_remote_code = args.trust_remote_code or bool(run_cfg and run_cfg.model.trust_remote_code)
        device, dtype = resolve_device(args.device, args.dtype)
        tokenizer = load_tokenizer(target_path, trust_remote_code=trust_remote_code)
        target = load_target_model(target_path, dtype, device, trust_remote_code)
        prompts = load_prompts(prompt_files, tokenizer, limit=args.num_prompts)
        # The drafter runs in the target's dtype, as an inference engine loads it.
        drafter = drafter.to(device=device, dtype=dtype)
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
