"""An XPress drafter trains through the DrafterTrainer and decodes with its own algorithm in eval:
K Jacobi passes over the drafter's logits (models/xpress.py), greedy or at a temperature."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_mp.evaluation.acceptance import stop_token_ids
from dflash_mp.evaluation.decoding import _propose, autoregressive_generate, speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from dflash_mp.models.xpress import refined_logits
from dflash_mp.runtime.roles import make_feature_extractor
from dflash_mp.training.features import Features
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def setup() -> dict:
    cfg = embedded_config("model.arch=xpress", "model.xpress_rank=8", "data.num_anchors=16")
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], NEW_TOKENS, steps=12)
    return {"cfg": cfg, "target": target, "tokenizer": tokenizer, "prompts": prompts, "trainer": trainer}


def test_training_logs_the_xpress_terms(setup: dict) -> None:
    cfg, trainer = setup["cfg"], setup["trainer"]
    assert trainer.drafter.arch == "xpress" and trainer.drafter.num_jacobi_passes == 6
    # One more step, to read its record: the reference's three terms, finite and positive.
    input_ids = torch.tensor([setup["prompts"][0].input_ids])
    batch = Features(
        index=99,
        epoch=99,
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids),
        lengths=torch.tensor([input_ids.shape[1]]),
        sample_ids=torch.zeros(1, dtype=torch.long),
        hidden_states=make_feature_extractor(cfg, torch.float32, torch.device("cpu"))(input_ids).clone(),
    )
    trainer.micro_step(batch, last_of_step=True)
    record = trainer.optimizer_step()
    terms = [record[name] for name in ("tf_loss", "consistency_loss", "base_anchor_loss")]
    assert all(math.isfinite(t) and t > 0 for t in terms), record
    assert record["loss"] == pytest.approx(terms[0] + 0.3 * terms[1] + 0.6 * terms[2], rel=1e-5)
    # The refiner trained: its mixer left its zero init.
    assert trainer.drafter.refiner_head.mix_l.abs().sum() > 0


def test_proposals_come_from_the_jacobi_passes(setup: dict) -> None:
    target, drafter = setup["target"], setup["trainer"].drafter.eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a refiner that moves the argmax, so the test can tell the passes ran
        for parameter in drafter.refiner_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    prompt = setup["prompts"][0].input_ids
    layer_ids, head = drafter.target_layer_ids, target.get_output_embeddings()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
    first, before, start = prompt[-1], prompt[-2], len(prompt) - 1
    context = features[:start]
    size = 3  # fewer than the block: the drafter still drafts the whole block, and proposes 2
    proposals, _ = _propose(drafter, target, context, first, start, size, 0.0, None, before_first=before)

    # The same block by hand: the drafter's hidden states, then 6 passes of the refiner.
    block = torch.full((1, drafter.block_size), drafter.mask_token_id)
    block[0, 0] = first
    embeddings = target.get_input_embeddings()(block)
    mask = torch.ones(1, 1, drafter.block_size, start + drafter.block_size, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter(
            context[None],
            embeddings,
            torch.arange(start)[None],
            torch.arange(start, start + drafter.block_size)[None],
            mask,
        )
        base = drafter.logits(hidden, head)
        refined = refined_logits(
            drafter.refiner_head, base, hidden, torch.tensor([first]), torch.tensor([before]), 6
        )
    assert proposals == refined[0, 1:size].argmax(-1).tolist()
    assert refined[0, 1:].argmax(-1).tolist() != base[0, 1:].argmax(-1).tolist()

    drafter.num_jacobi_passes = 0  # K = 0: the drafter's own argmax
    plain, _ = _propose(drafter, target, context, first, start, size, 0.0, None, before_first=before)
    drafter.num_jacobi_passes = 6
    assert plain == base[0, 1:size].argmax(-1).tolist()

    # At a temperature the proposals are drawn from the refined logits' distribution.
    sampled, probs = _propose(
        drafter,
        target,
        context,
        first,
        start,
        size,
        1.0,
        torch.Generator().manual_seed(1),
        before_first=before,
    )
    assert probs is not None and probs.shape == (size - 1, base.shape[-1])
    torch.testing.assert_close(probs, torch.softmax(refined[0, 1:size].float(), -1))
    assert all(probs[k, token] > 0 for k, token in enumerate(sampled))


def test_speculative_decoding_with_xpress_is_the_targets_greedy(setup: dict) -> None:
    target, drafter, tokenizer = setup["target"], setup["trainer"].drafter.eval(), setup["tokenizer"]
    stops = stop_token_ids(tokenizer, target)
    prompt = setup["prompts"][2].input_ids
    speculative = speculative_generate(drafter, target, prompt, NEW_TOKENS, stops)
    assert speculative.new_tokens == autoregressive_generate(target, prompt, NEW_TOKENS, stops).new_tokens
    assert len(speculative.drafted) == drafter.block_size - 1 and speculative.acceptance_lengths
    sampled = speculative_generate(
        drafter,
        target,
        prompt,
        NEW_TOKENS,
        stops,
        temperature=1.0,
        generator=torch.Generator().manual_seed(2),
    )
    assert 0 < len(sampled.new_tokens) <= NEW_TOKENS


def test_bad_xpress_fields_are_refused_naming_the_key_and_the_fix() -> None:
    from dflash_mp.config.schema import ConfigError, compose_config
    from dflash_mp.config.validation import validate

    bad = compose_config(
        [
            "model.arch=xpress",
            "model.xpress_rank=0",
            "model.num_jacobi_passes=-1",
            "model.xpress_consistency_weight=-0.5",
        ]
    )
    with pytest.raises(ConfigError) as refused:
        validate(bad, world_size=3)
    message = str(refused.value)
    assert "model.xpress_rank=0: must be an integer >= 1" in message
    assert "model.num_jacobi_passes=-1: must be an integer >= 0" in message
    assert "model.xpress_consistency_weight=-0.5: must be a number >= 0" in message
    with pytest.raises(ConfigError, match="model.arch='xpres'.*'xpress'"):
        validate(compose_config(["model.arch=xpres"]), world_size=3)
