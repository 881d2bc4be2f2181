"""What training evaluates every eval.every steps (`AcceptanceEvaluator`: tau on the held-out
prompts and on each of eval.benchmarks), and the preflight's check that it will fit the target's
context (`eval_context_problem`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dflash_mp.config.precision import resolve_precision
from dflash_mp.config.schema import read_target_config
from dflash_mp.data import load_tokenizer
from dflash_mp.evaluation.acceptance import (
    check_prompt_lengths,
    evaluate_acceptance,
    load_target_model,
    require_room_for_target,
)
from dflash_mp.evaluation.benchmark_table import TrainingBenchmarks
from dflash_mp.evaluation.prompts import has_held_out_prompts, load_eval_prompts

if TYPE_CHECKING:
    from dflash_mp.models.drafter import DFlashDrafter


def eval_context_problem(cfg: Any) -> str | None:
    """The preflight's eval check: why eval.every's decoding would not fit the target's context
    (None: it fits, or eval.every=0). The same rule the evaluator applies when the drafter starts,
    known here before any worker does."""
    context = read_target_config(cfg.model.target_path).get("max_position_embeddings")
    if not cfg.eval.every or context is None:
        return None
    tokenizer = load_tokenizer(
        cfg.model.target_path, cfg.model.trust_remote_code, require_chat_template=not cfg.data.chat_template
    )
    prompts = load_eval_prompts(cfg, tokenizer) if has_held_out_prompts(cfg) else []
    prompts += TrainingBenchmarks(cfg, tokenizer).first_turn_prompts()
    if not prompts:
        return "no held-out prompts in data.eval_files: add prompts or set eval.every=0"
    longest = max(prompts, key=lambda p: len(p.input_ids))
    new_tokens = cfg.eval.max_new_tokens
    if len(longest.input_ids) + new_tokens <= context:
        return None
    return (
        f"eval.every={cfg.eval.every} decodes eval.max_new_tokens={new_tokens} tokens after prompts of "
        f"up to {len(longest.input_ids)} tokens ({longest.source}), {len(longest.input_ids) + new_tokens} "
        f"positions, beyond the target's max_position_embeddings={context} (model.target_path="
        f"{cfg.model.target_path}): set eval.max_new_tokens<={context - len(longest.input_ids)}, use "
        "shorter prompts in data.eval_files or eval.benchmarks, or eval.every=0"
    )


# ----------------------------------------------------------------------------------------
# evaluation


class AcceptanceEvaluator:
    """`evaluate_acceptance` during training: the full target, its tokenizer and cfg.eval.num_prompts
    held-out prompts loaded once, in the training precision, and checked before the first step.

    The whole target (LM head included) lives on the evaluating rank, so eval.every works only
    where the target fits beside the drafter; on CUDA that is checked before the target is read.
    """

    def __init__(self, cfg: Any, device: torch.device) -> None:
        dtype, _, _ = resolve_precision(cfg, device)
        if device.type == "cuda":  # before minutes of reading a target that cannot fit
            require_room_for_target(cfg.model.target_path, dtype, device, torch.cuda.mem_get_info(device)[0])
        trust_remote_code = cfg.model.trust_remote_code
        self.tokenizer = load_tokenizer(
            cfg.model.target_path, trust_remote_code, require_chat_template=not cfg.data.chat_template
        )
        self.target = load_target_model(cfg.model.target_path, dtype, device, trust_remote_code)
        self.prompts = load_eval_prompts(cfg, self.tokenizer) if has_held_out_prompts(cfg) else []
        self.benchmarks = TrainingBenchmarks(cfg, self.tokenizer)
        self.max_new_tokens = cfg.eval.max_new_tokens
        context = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        check_prompt_lengths(
            self.prompts + self.benchmarks.first_turn_prompts(), self.max_new_tokens, context
        )

    def __call__(self, drafter: DFlashDrafter) -> dict[str, Any]:
        """tau and friends of `drafter` (the bare module, not its DDP wrapper) on the held-out prompts."""
        return evaluate_acceptance(drafter, self.target, self.tokenizer, self.prompts, self.max_new_tokens)

    def measure(self, drafter: DFlashDrafter) -> dict[str, float]:
        """What an evaluation step logs: tau on the held-out prompts, tau/<name> on each eval.benchmarks."""
        self.acceptance_rate: list[float] = []  # per block position, of the held-out prompts
        taus = {}
        if self.prompts:
            result = self(drafter)
            taus["tau"], self.acceptance_rate = result["tau"], list(result["acceptance_rate"])
        return taus | self.benchmarks.taus(drafter, self.target)
