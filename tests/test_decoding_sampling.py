"""Speculative sampling with top-k/top-p: the cut distribution, exactness of the acceptance rule,
and the same samples as the reference `dflash_generate` from the same seed."""

from __future__ import annotations

import time

import pytest
import torch
from dflash import model as reference
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from dflash_mp.evaluation import decoding
from dflash_mp.evaluation.acceptance import stop_token_ids
from dflash_mp.evaluation.decoding import _rejection_sample, sampling_probs, speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from dflash_mp.export.hf import export_drafter, load_exported_drafter
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens

NEW_TOKENS = 40


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (20, 1.0), (0, 0.9), (20, 0.95), (3, 0.5)])
def test_the_cut_is_transformers_and_the_references(top_k: int, top_p: float) -> None:
    logits = torch.randn(6, 151, generator=torch.Generator().manual_seed(top_k))
    ours = sampling_probs(logits, 0.7, top_k, top_p)
    scores = logits / 0.7
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    assert torch.allclose(ours, torch.softmax(scores, dim=-1), atol=1e-6)
    assert torch.equal(ours, reference._sampling_probs(logits, 0.7, top_p, top_k))
    kept = (ours > 0).sum(-1)
    assert (kept <= (top_k or 151)).all() and torch.allclose(ours.sum(-1), torch.ones(6))


def test_rejection_sampling_of_cut_distributions_emits_the_cut_target_distribution() -> None:
    # Two block positions: the first emitted token must follow the cut p, whatever q proposes.
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 0.3, 1.0, 0.2, 0.1, 0.0]])
    draft_logits = torch.tensor([[0.0, 1.0, 2.0, 1.0, 0.5, 0.0]])
    p = sampling_probs(target_logits, 1.0, top_k=4, top_p=0.85)
    q = sampling_probs(draft_logits, 1.0, top_k=4, top_p=0.85)
    # Cut to tokens {0, 1, 2} and {1, 2, 3}: q proposes token 3, which p never emits.
    assert (p[0] > 0).tolist() == [True] * 3 + [False] * 3 and (q[0] > 0).tolist()[:4] == [
        False,
        True,
        True,
        True,
    ]
    trials, counts = 20000, torch.zeros(6)
    for _ in range(trials):
        proposal = torch.multinomial(q[0], 1, generator=generator)
        accepted, next_token = _rejection_sample(proposal, q, p, generator)
        counts[int(proposal) if accepted else next_token] += 1
    assert counts[p[0] == 0].sum() == 0  # never a token outside the target's cut
    assert torch.allclose(counts / trials, p[0], atol=0.015)


@pytest.fixture(scope="module")
def trained() -> dict:
    cfg = embedded_config("data.num_anchors=32")
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)[:3]
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], NEW_TOKENS, steps=150)
    return {"target": target, "tokenizer": tokenizer, "prompts": prompts, "drafter": trainer.drafter.eval()}


class TargetAsDrafter:
    """A stand-in for `decoding._propose` that proposes the target's own samples with the target's
    own cut distributions: q == p, so every proposal must be accepted."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)  # the tokens before the current block's first
        self.last: tuple[int, int, list[int]] | None = None

    @torch.inference_mode()
    def __call__(
        self, drafter, target, features, first_token, start, size, temperature, generator, top_k, top_p,
        before_first=None,
    ):  # fmt: skip
        if self.last is not None:  # the block before: its first token, then what was accepted of it
            before, previous_first, proposals = self.last
            self.tokens = self.tokens[:before] + [previous_first] + proposals[: start - before - 1]
        assert len(self.tokens) == start
        sequence, proposals, rows = [*self.tokens, first_token], [], []
        for _ in range(size - 1):
            logits = target(input_ids=torch.tensor([sequence])).logits[0, -1:]
            probs = sampling_probs(logits, temperature, top_k, top_p)
            proposals.append(int(torch.multinomial(probs, 1, generator=generator)))
            rows.append(probs[0])
            sequence.append(proposals[-1])
        self.last = (start, first_token, proposals)
        return proposals, torch.stack(rows)


def test_a_drafter_equal_to_the_target_has_every_proposal_accepted(
    trained: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, drafter, prompt = trained["target"], trained["drafter"], trained["prompts"][0]
    stops = stop_token_ids(trained["tokenizer"], target)
    monkeypatch.setattr(decoding, "_propose", TargetAsDrafter(prompt.input_ids))
    generator = torch.Generator().manual_seed(1)
    run = speculative_generate(
        drafter, target, prompt.input_ids, NEW_TOKENS, stops, 1.0, generator, top_k=20, top_p=0.9
    )
    block = drafter.block_size
    assert run.acceptance_lengths[:-1] == [block] * (len(run.acceptance_lengths) - 1), run.acceptance_lengths
    assert run.accepted == run.drafted


def test_sampled_decoding_equals_the_references_from_the_same_seed(
    trained: dict, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our loop draws from its generator in the reference's order (prefill sample, draft samples,
    acceptance uniforms, residual or bonus sample), so on CPU the same seed gives the same tokens."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # a CPU run
    out = export_drafter(trained["drafter"], tmp_path / "export")
    theirs = reference.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_exported_drafter(out).float().eval()
    target, stops = trained["target"], stop_token_ids(trained["tokenizer"], trained["target"])
    longest = 0
    for seed, (top_k, top_p) in enumerate([(20, 0.9), (3, 0.7), (0, 0.8)]):
        for prompt in trained["prompts"]:
            torch.manual_seed(seed)
            expected = reference.dflash_generate(
                theirs, target, torch.tensor([prompt.input_ids]), NEW_TOKENS, stops,
                temperature=1.0, top_p=top_p, top_k=top_k, return_stats=True,
            )  # fmt: skip
            got = speculative_generate(
                ours, target, prompt.input_ids, NEW_TOKENS, stops, 1.0,
                torch.Generator().manual_seed(seed), top_k=top_k, top_p=top_p,
            )  # fmt: skip
            assert got.new_tokens == expected.output_ids[0, len(prompt.input_ids) :].tolist(), prompt.source
            assert got.acceptance_lengths == expected.acceptance_lengths, prompt.source
            longest = max(longest, *got.acceptance_lengths)
    assert longest > 1  # some proposals were accepted, so the comparison covered acceptances too
