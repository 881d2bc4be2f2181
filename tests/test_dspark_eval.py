"""A DSpark drafter decoding in eval: its proposals are the Markov chain over the block, greedy
decoding stays the target's own, and tau counts B drafts per block (sample_from_anchor)."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.evaluation.acceptance import evaluate_acceptance, stop_token_ids
from dflash_mp.evaluation.decoding import _propose, autoregressive_generate, speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def trained() -> dict:
    cfg = embedded_config(
        "data.num_anchors=32", "model.arch=dspark", "model.markov_rank=16", "model.markov_head_type=rnn"
    )
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)[:3]
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], NEW_TOKENS, steps=40)
    return {"drafter": trainer.drafter.eval(), "target": target, "tokenizer": tokenizer, "prompts": prompts}


def test_proposals_are_the_markov_chain_over_the_block(trained: dict) -> None:
    drafter, target = trained["drafter"], trained["target"]
    prompt = trained["prompts"][0].input_ids
    with torch.inference_mode():
        output = target(torch.tensor([prompt]), output_hidden_states=True)
        features = torch.cat([output.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)[0]
        first, start, size = prompt[-1], len(prompt) - 1, drafter.block_size
        proposals, probs = _propose(drafter, target, features[:-1], first, start, size, 0.0, None)
        # By hand: the drafter's hidden states, then one Markov step per position fed the last pick.
        head = target.get_output_embeddings()
        block = torch.full((1, size), drafter.mask_token_id)
        block[0, 0] = first
        embeddings = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
        hidden = drafter(
            features[None, :-1],
            embeddings,
            torch.arange(start)[None],
            torch.arange(start, start + size)[None],
            torch.ones(1, 1, size, start + size, dtype=torch.bool),
        )[0]
        base = drafter.logits(hidden, head)
        markov, previous, state, expected = drafter.markov_head, torch.tensor([first]), None, []
        for k in range(size):
            features_k, state = markov.step(markov.embed(previous), hidden[k : k + 1], state)
            previous = (base[k : k + 1] + markov.bias(features_k)).argmax(-1)
            expected.append(int(previous))
    assert probs is None and len(proposals) == size  # sample_from_anchor: every row proposes
    assert proposals == expected
    # The bias matters: the chain is not the backbone's argmax everywhere.
    assert markov.markov_w2.weight.abs().max() > 0


def test_greedy_decoding_is_the_targets_and_accepts_drafts(trained: dict) -> None:
    drafter, target, tokenizer = trained["drafter"], trained["target"], trained["tokenizer"]
    stops = stop_token_ids(tokenizer, target)
    accepted = 0
    for prompt in trained["prompts"][:2]:
        plain = autoregressive_generate(target, prompt.input_ids, NEW_TOKENS, stops)
        got = speculative_generate(drafter, target, prompt.input_ids, NEW_TOKENS, stops)
        assert got.new_tokens == plain.new_tokens, prompt.source
        assert len(got.drafted) == drafter.block_size  # B drafts per block
        accepted += max(got.acceptance_lengths)
    assert accepted > 4  # trained on these prompts: drafts were accepted


def test_eval_reports_tau_with_sampling(trained: dict) -> None:
    result = evaluate_acceptance(
        trained["drafter"],
        trained["target"],
        trained["tokenizer"],
        trained["prompts"],
        max_new_tokens=16,
        temperature=1.0,
        seed=0,
    )
    assert result["tau"] >= 1.0
    assert len(result["acceptance_rate"]) == trained["drafter"].block_size
