"""A trained DFlash 2 drafter end to end: training metrics, export, and decoding with the selector.

The reference's `dflash_generate`, reading our export, must produce the same tokens and acceptance
lengths as our decoding loop (greedy), and its rejection sampling over the K candidates must agree
with ours draw for draw.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from dflash import model as reference

from dflash_mp.evaluation.acceptance import evaluate_acceptance, stop_token_ids
from dflash_mp.evaluation.decoding import _rejection_sample, speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from dflash_mp.export.hf import export_drafter, load_exported_drafter
from dflash_mp.runtime.roles import make_feature_extractor
from dflash_mp.training.features import Features
from dflash_mp.training.trainer import DrafterTrainer
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens

OVERRIDES = ("data.num_anchors=32", "model.arch=dflash2", "model.selector_rank=32")
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cfg = embedded_config(*OVERRIDES)
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)[:4]
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], NEW_TOKENS, steps=150)
    export = export_drafter(trainer.drafter, tmp_path_factory.mktemp("dflash2") / "export")
    return {
        "export": export,
        "target": target,
        "tokenizer": tokenizer,
        "prompts": prompts,
        "trainer": trainer,
    }


def test_reference_decoding_of_our_dflash2_export_matches_our_eval(
    trained: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # a CPU run
    draft_model, info = reference.DFlash2DraftModel.from_pretrained(
        trained["export"], dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = load_exported_drafter(trained["export"]).float().eval()
    # Trained: the pair scores are live, so the walk is not the unary argmax by construction.
    assert ours.candidate_selector.successor_codebook.abs().max() > 0
    target, stops = trained["target"], stop_token_ids(trained["tokenizer"], trained["target"])
    long_blocks = 0
    for prompt in trained["prompts"]:
        expected = reference.dflash_generate(
            draft_model.eval(), target, torch.tensor([prompt.input_ids]), NEW_TOKENS, stops, return_stats=True
        )
        got = speculative_generate(ours, target, prompt.input_ids, NEW_TOKENS, stops)
        assert got.new_tokens == expected.output_ids[0, len(prompt.input_ids) :].tolist(), prompt.source
        assert got.acceptance_lengths == expected.acceptance_lengths, prompt.source
        long_blocks += max(expected.acceptance_lengths) > 4
    assert long_blocks >= 2  # the trained prompts: the comparison covered accepted drafts


def test_sampled_decoding_through_the_selector_matches_the_reference_when_nearly_greedy(
    trained: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a tiny temperature q is one-hot on the walk's pick: the sampled path (q over K candidates,
    rejection sampling) must then decode what greedy decoding and the reference's sampling do."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    draft_model = reference.DFlash2DraftModel.from_pretrained(trained["export"], dtype=torch.float32).eval()
    ours = load_exported_drafter(trained["export"]).float().eval()
    target, stops = trained["target"], stop_token_ids(trained["tokenizer"], trained["target"])
    generator = torch.Generator().manual_seed(0)
    for prompt in trained["prompts"][:2]:
        expected = reference.dflash_generate(
            draft_model,
            target,
            torch.tensor([prompt.input_ids]),
            24,
            stops,
            temperature=1e-3,
            return_stats=True,
        )
        sampled = speculative_generate(ours, target, prompt.input_ids, 24, stops, 1e-3, generator)
        greedy = speculative_generate(ours, target, prompt.input_ids, 24, stops)
        assert (
            sampled.new_tokens
            == greedy.new_tokens
            == expected.output_ids[0, len(prompt.input_ids) :].tolist()
        )
        assert sampled.acceptance_lengths == greedy.acceptance_lengths == expected.acceptance_lengths
    result = evaluate_acceptance(
        ours, target, trained["tokenizer"], trained["prompts"][:2], 24, temperature=0.7
    )
    assert result["tau"] >= 1 and len(result["acceptance_rate"]) == ours.block_size - 1


@pytest.mark.parametrize("seed", range(6))
def test_rejection_sampling_over_candidates_draws_what_the_reference_draws(seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    steps, vocab, top_k = 5, 30, 4
    candidates = torch.stack([torch.randperm(vocab, generator=generator)[:top_k] for _ in range(steps)])
    q = torch.softmax(torch.randn(steps, top_k, generator=generator), -1)
    tokens = candidates.gather(-1, torch.multinomial(q, 1, generator=generator))[:, 0]
    # A target that mostly agrees, so that acceptance runs vary with the draws.
    target_logits = torch.randn(steps + 1, vocab, generator=generator)
    target_logits[torch.arange(steps), tokens] += 3.0
    target_probs = torch.softmax(target_logits, -1)
    torch.manual_seed(seed)
    expected = reference._rejection_sample(tokens[None], target_probs[None], q[None], candidates[None])
    dense_q = torch.zeros(steps, vocab).scatter_add_(-1, candidates, q)
    torch.manual_seed(seed)
    got = _rejection_sample(tokens, dense_q, target_probs, None)
    assert got == (expected[0], int(expected[1]))


def test_dflash2_training_reports_selector_metrics_and_starts_as_dflash() -> None:
    records = {}
    for arch in ("dflash", "dflash2"):
        cfg = embedded_config("data.num_anchors=16", f"model.arch={arch}", "model.selector_rank=16")
        input_ids = torch.randint(3, 150, (2, 40), generator=torch.Generator().manual_seed(0))
        loss_mask = (torch.arange(40) >= 10).long().expand(2, -1)
        hidden_states = make_feature_extractor(cfg, torch.float32, torch.device("cpu"))(input_ids).clone()
        trainer = DrafterTrainer(cfg, torch.device("cpu"), 2)
        batch = Features(0, 0, input_ids, loss_mask, torch.tensor([40, 40]), torch.arange(2), hidden_states)
        trainer.micro_step(batch, last_of_step=True)
        records[arch] = trainer.optimizer_step()
    dflash, dflash2 = records["dflash"], records["dflash2"]
    block = len(dflash2["acc"])
    for key in ("topk_recall", "selector_acc", "accept_selector", "accept_unary"):
        assert len(dflash2[key]) == block and all(0.0 <= x <= 1.0 for x in dflash2[key]), key
    assert "topk_recall" not in dflash
    # Step 0: identity convolutions, a no-op selector; loss = DFlash loss + alpha * selector term.
    assert dflash2["acc"] == dflash["acc"]
    assert dflash2["loss"] == pytest.approx(dflash["loss"] + dflash2["selector_loss"], rel=1e-5)
    assert dflash2["accept_selector"] == dflash2["accept_unary"]
    assert dflash2["selector_loss"] > 0


def test_unary_evaluation_bypasses_the_selector(
    trained: dict, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`eval --unary` decodes a DFlash 2 export with the LM head alone (BENCHMARKS.md's served vs
    unary comparison): the selector's walk is never called, and tau is the selector-free loop's."""
    from dflash_mp.eval import main
    from dflash_mp.models.dflash2 import CandidateSelector

    out = tmp_path / "unary.json"
    common = ["--num-prompts", "4", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]
    ours = load_exported_drafter(trained["export"]).float().eval()
    ours.candidate_selector = None
    target, stops = trained["target"], stop_token_ids(trained["tokenizer"], trained["target"])
    lengths = [
        speculative_generate(ours, target, prompt.input_ids, NEW_TOKENS, stops).acceptance_lengths
        for prompt in trained["prompts"]
    ]

    def no_walk(*args, **kwargs):
        raise AssertionError("--unary must not walk the selector")

    monkeypatch.setattr(CandidateSelector, "walk", no_walk)
    assert main([str(trained["export"]), *common, "--dtype", "float32", "--unary", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["tau"] == pytest.approx(
        sum(map(sum, lengths)) / sum(map(len, lengths))
    )
    with pytest.raises(AssertionError, match="must not walk"):  # without --unary the selector serves
        main([str(trained["export"]), *common, "--dtype", "float32", "--out", str(out)])
