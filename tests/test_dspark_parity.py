"""DSpark's heads and loss terms against speculators 0.9.0's (`speculators.models.dspark`), fp32, CPU.

Same weights in both: the Markov bias of every head type (teacher-forced over a block, and step by
step as decoding runs it), the confidence logits, the per-position CE, KL and TV, the confidence
BCE against 1 - TV, the accept-rate metrics, the position weights and the teacher-forced previous
tokens and teacher positions. speculators divides a term by the count of scored positions, this
project by the sum of their decayed weights (the DFlash loss's normalisation, as ModelOpt's
DSpark): the sums before that division are compared.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from dflash_mp.models.dspark import ConfidenceHead, MarkovHead, previous_tokens
from dflash_mp.objective.dspark_loss import DSparkLossWeights, dspark_labels, dspark_metrics_stats
from tests.dspark_autograd_reference import reduce_terms, row_terms
from tests.speculators_reference import speculators_module

VOCAB, RANK, HIDDEN, BLOCK, BLOCKS = 50, 6, 12, 4, 5


def _reference_heads():
    return speculators_module("models.dspark.model_definitions")


def _random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return module


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_bias_equals_the_reference(head_type: str) -> None:
    reference_module = _reference_heads()
    ours = _random_(MarkovHead(VOCAB, RANK, HIDDEN, head_type), seed=1)
    reference = reference_module.MarkovHead(
        verifier_vocab_size=VOCAB,
        draft_vocab_size=VOCAB,
        markov_rank=RANK,
        hidden_size=HIDDEN,
        head_type=head_type,
    )
    reference.load_state_dict(ours.state_dict(), strict=True)  # the same parameter names
    generator = torch.Generator().manual_seed(2)
    prev = torch.randint(0, VOCAB, (BLOCKS, BLOCK), generator=generator)
    hidden = torch.randn(BLOCKS, BLOCK, HIDDEN, generator=generator)
    expected = reference.block_bias(prev_token_ids=prev, hidden_states=hidden)
    got = ours.bias(ours.features(ours.embed(prev), hidden))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.abs().max() > 0.1  # a bias that could tell the heads apart
    # Decoding runs the head one position at a time; the rnn state carries over.
    state, steps = None, []
    for k in range(BLOCK):
        features, state = ours.step(ours.embed(prev[:, k]), hidden[:, k], state)
        steps.append(ours.bias(features))
    torch.testing.assert_close(torch.stack(steps, dim=1), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_logits_equal_the_reference(with_markov: bool) -> None:
    reference_module = _reference_heads()
    ours = _random_(ConfidenceHead(HIDDEN + (RANK if with_markov else 0)), seed=3)
    reference = reference_module.ConfidenceHead(HIDDEN + (RANK if with_markov else 0))
    reference.load_state_dict(ours.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(BLOCKS, BLOCK, HIDDEN, generator=generator)
    prev_emb = torch.randn(BLOCKS, BLOCK, RANK, generator=generator)
    features = torch.cat([hidden, prev_emb], dim=-1) if with_markov else hidden
    torch.testing.assert_close(
        ours(hidden, prev_emb if with_markov else None), reference(features), rtol=0, atol=0
    )


def _loss_inputs():
    generator = torch.Generator().manual_seed(5)
    rows = BLOCKS * BLOCK
    hidden = torch.randn(rows, HIDDEN, generator=generator)
    teacher = torch.randn(rows, HIDDEN, generator=generator)
    head = torch.randn(VOCAB, HIDDEN, generator=generator)
    markov = torch.randn(rows, RANK, generator=generator)
    w2 = torch.randn(VOCAB, RANK, generator=generator) * 0.3
    mask = (torch.rand(rows, generator=generator) > 0.3).float()
    confidence = torch.randn(rows, generator=generator)
    return hidden, teacher, head, markov, w2, mask, confidence


def test_loss_terms_equal_the_reference() -> None:
    eager = speculators_module("losses.eager")
    losses = speculators_module("losses")
    hidden, teacher, head, markov, w2, mask, _ = _loss_inputs()
    logits = (hidden @ head.T + markov @ w2.T)[None]  # speculators: DFlash logits + Markov bias
    targets = (teacher @ head.T)[None]
    labels = targets[0].argmax(-1)  # speculators' CE reads the teacher's argmax as the label
    terms, correct = row_terms(hidden, markov, teacher, labels, head, w2, chunk_rows=7)
    torch.testing.assert_close(terms[:, 0], eager.ce_loss(logits, targets)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms[:, 1], eager.kl_div_loss(logits, targets)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(terms[:, 2], eager.tv_loss(logits, targets)[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(correct, logits[0].argmax(-1) == labels)
    # The reduction: the same decayed sum (sample_from_anchor: exp(-k/gamma) from position 0).
    gamma = 3.0
    pos_idx = (torch.arange(mask.numel()) % BLOCK)[None]
    decay = losses.dflash_loss_decay(pos_idx.float(), gamma, sample_from_anchor=True)[0]
    weights = mask * decay
    alphas = DSparkLossWeights(ce=0.0, kl=1.0, tv=0.0, confidence=0.0)
    loss, values, _ = reduce_terms(terms, None, weights, alphas)
    for index, name in enumerate(("ce", "kl_div", "tv")):
        fn = getattr(eager, f"{name}_loss")
        expected = losses.loss_function(
            logits,
            targets,
            mask[None],
            pos_idx,
            fn,
            partial(losses.dflash_loss_decay, gamma=gamma, sample_from_anchor=True),
        )
        torch.testing.assert_close(
            values[index] * weights.sum(), expected * (mask.sum() + 1e-5), rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(loss, values[1])


def test_confidence_bce_and_accept_metrics_equal_the_reference() -> None:
    eager = speculators_module("losses.eager")
    metrics = speculators_module("models.dspark.metrics")
    hidden, teacher, head, markov, w2, mask, confidence = _loss_inputs()
    logits = (hidden @ head.T + markov @ w2.T)[None]
    targets = (teacher @ head.T)[None]
    gamma = 3.0
    reference_loss, reference = metrics.compute_metrics(
        logits,
        targets,
        confidence[None],
        mask[None],
        BLOCK,
        loss_config={"kl_div": (eager.kl_div_loss, 1.0)},
        tv_loss_fn=eager.tv_loss,
        gamma=gamma,
        confidence_head_alpha=1.0,
        sample_from_anchor=True,
    )
    terms, _ = row_terms(hidden, markov, teacher, targets[0].argmax(-1), head, w2)
    decay = torch.exp(-(torch.arange(mask.numel()) % BLOCK).float() / gamma)
    weights = mask * decay
    loss, values, accept = reduce_terms(
        terms, confidence, weights, DSparkLossWeights(ce=0, kl=1, tv=0, confidence=1)
    )
    torch.testing.assert_close(
        values[3] * weights.sum(),
        reference["confidence_loss_sum"] * (mask.sum() + 1e-8),
        rtol=1e-5,
        atol=1e-6,
    )
    scale = weights.sum() / mask.sum()  # the two normalisations, term by term
    torch.testing.assert_close(loss * scale, reference_loss, rtol=1e-5, atol=1e-6)
    stats = dspark_metrics_stats(
        accept.view(BLOCKS, BLOCK), confidence.view(BLOCKS, BLOCK), mask.view(BLOCKS, BLOCK) > 0, values
    )
    # After the four terms: accept sum, predicted sum, |error| sum, scored count, accept_len sum, ...
    torch.testing.assert_close(stats[4], reference["accept_rate_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[5], reference["confidence_pred_mean_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[6], reference["confidence_abs_error_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[8], reference["accept_len_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[10], reference["accept_len_total"], rtol=0, atol=0)


def test_dpace_loss_equals_the_reference() -> None:
    """train.position_weights=dpace: CE, KL and TV each weighted by D-PACE from its own values, the
    BCE on the decay, all divided by the scored count (the reference's reduction under D-PACE too)."""
    eager = speculators_module("losses.eager")
    metrics = speculators_module("models.dspark.metrics")
    hidden, teacher, head, markov, w2, mask, confidence = _loss_inputs()
    gamma, alpha, alphas = 3.0, 0.4, DSparkLossWeights(ce=0.2, kl=0.7, tv=1.3, confidence=0.9)
    ours_hidden = hidden.clone().requires_grad_(True)
    reference_hidden = hidden.clone().requires_grad_(True)
    logits = (reference_hidden @ head.T + markov @ w2.T)[None]
    targets = (teacher @ head.T)[None]
    reference_loss, reference = metrics.compute_metrics(
        logits,
        targets,
        confidence[None],
        mask[None],
        BLOCK,
        loss_config={
            "ce": (eager.ce_loss, alphas.ce),
            "kl_div": (eager.kl_div_loss, alphas.kl),
            "tv": (eager.tv_loss, alphas.tv),
        },
        tv_loss_fn=eager.tv_loss,
        gamma=gamma,
        confidence_head_alpha=alphas.confidence,
        per_position_loss_weight="dpace",
        dpace_alpha=alpha,
        sample_from_anchor=True,
    )
    terms, _ = row_terms(ours_hidden, markov, teacher, targets[0].argmax(-1), head, w2, chunk_rows=7)
    weights = mask * torch.exp(-(torch.arange(mask.numel()) % BLOCK).float() / gamma)
    loss, values, _ = reduce_terms(terms, confidence, weights, alphas, dpace_alpha=alpha, block_size=BLOCK)
    count = mask.sum()
    names = ("ce_loss_sum", "kl_div_loss_sum", "tv_loss_sum")
    for index, name in enumerate(names):  # the sums, before the reference's count + 1e-5
        torch.testing.assert_close(
            values[index] * count, reference[name] * (count + 1e-5), rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(
        values[3] * count, reference["confidence_loss_sum"] * (count + 1e-8), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)  # up to the epsilons
    # The D-PACE weights differ from the decay's, and carry no gradient in either.
    decayed, _, _ = reduce_terms(terms, confidence, weights, alphas)
    assert not torch.allclose(decayed, loss)
    loss.backward()
    reference_loss.backward()
    torch.testing.assert_close(ours_hidden.grad, reference_hidden.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_previous_tokens_and_teacher_positions_follow_the_reference(sample_from_anchor: bool) -> None:
    utils = speculators_module("models.dflash.utils")
    losses = speculators_module("losses")
    seq_len, gamma = 24, 2.0
    input_ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(6))
    anchors = torch.tensor([[2, 7, 11, 15]])
    batch = SimpleNamespace(
        input_ids=input_ids,
        loss_mask=torch.ones(1, seq_len, dtype=torch.long),
        lengths=torch.tensor([seq_len]),
    )
    labels, weights, positions = dspark_labels(
        batch, anchors, torch.ones_like(anchors, dtype=torch.bool), BLOCK, gamma, sample_from_anchor
    )
    # speculators' DSpark forward: block tokens at the anchored indices, teacher logits at those
    # indices (sample_from_anchor) or one before, previous tokens as its Markov input.
    indices = utils.get_base_indices_for_anchored_blocks(anchors[0], BLOCK)
    block_tokens = input_ids[0, indices].view(-1, BLOCK)
    expected_prev = (
        block_tokens if sample_from_anchor else torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], 1)
    )
    got_prev = previous_tokens(labels[0], input_ids[0, anchors[0]], sample_from_anchor)
    assert torch.equal(got_prev, expected_prev)
    expected_teacher = indices if sample_from_anchor else indices - 1
    assert torch.equal((positions - 1).flatten(), expected_teacher)
    pos_idx = (torch.arange(indices.numel()) % BLOCK).float()
    expected_weights = losses.dflash_loss_decay(pos_idx, gamma, sample_from_anchor=sample_from_anchor)
    torch.testing.assert_close(weights.flatten(), expected_weights)
