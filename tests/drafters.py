"""Drafters for the speculative-decoding tests, on the embedded tiny target.

`train_on_target_tokens` fits a drafter to the target's own greedy continuations of some prompts,
fed as token ids (no text round trip), so that speculative decoding of those prompts accepts long
blocks: that is what makes equality and reference-parity checks of the decoding loop meaningful.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_mp.config.schema import RootConfig, compose_config, to_dataclass
from dflash_mp.data import load_tokenizer
from dflash_mp.evaluation.acceptance import load_target_model, stop_token_ids
from dflash_mp.evaluation.decoding import autoregressive_generate
from dflash_mp.evaluation.prompts import Prompt
from dflash_mp.runtime.roles import make_feature_extractor
from dflash_mp.training.features import Features
from dflash_mp.training.trainer import DrafterTrainer


def embedded_config(*overrides: str) -> RootConfig:
    return to_dataclass(compose_config(list(overrides)))


def embedded_target(cfg: RootConfig) -> tuple[torch.nn.Module, Any]:
    """The full tiny target (fp32, CPU) and its tokenizer."""
    return load_target_model(cfg.model.target_path, torch.float32, "cpu"), load_tokenizer(
        cfg.model.target_path
    )


def train_on_target_tokens(
    cfg: RootConfig,
    target: torch.nn.Module,
    tokenizer: Any,
    prompts: list[Prompt],
    max_new_tokens: int,
    steps: int,
) -> DrafterTrainer:
    """A drafter trained for `steps` steps on [prompt ; target's greedy continuation] of `prompts`."""
    stops = stop_token_ids(tokenizer, target)
    sequences = [
        p.input_ids + autoregressive_generate(target, p.input_ids, max_new_tokens, stops).new_tokens
        for p in prompts
    ]
    length = min(map(len, sequences))  # equal lengths: no padding to mask
    input_ids = torch.tensor([s[:length] for s in sequences])
    loss_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        loss_mask[row, len(prompt.input_ids) :] = 1
    hidden_states = make_feature_extractor(cfg, torch.float32, torch.device("cpu"))(input_ids)
    trainer = DrafterTrainer(cfg, torch.device("cpu"), steps)
    for step in range(steps):
        batch = Features(
            index=step,
            epoch=step,  # fresh anchors every step
            input_ids=input_ids,
            loss_mask=loss_mask,
            lengths=torch.full((len(prompts),), length),
            sample_ids=torch.arange(len(prompts)),
            hidden_states=hidden_states.clone(),
        )
        trainer.micro_step(batch, last_of_step=True)
        trainer.optimizer_step()
    return trainer
