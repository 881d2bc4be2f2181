"""The DFlash 2 selector term and its metrics against a slow, obviously-correct version."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_mp.models.dflash2 import CandidateSelector
from dflash_mp.models.drafter import scale_logits
from dflash_mp.objective.draft_blocks import block_labels
from dflash_mp.objective.lm_head_loss import lm_head_loss_and_candidates
from dflash_mp.objective.selector_loss import (
    candidate_logits,
    pack_selector_totals,
    selector_loss,
    selector_metrics,
)

VOCAB, HIDDEN, RANK, TOP_K, BLOCK = 40, 16, 6, 4, 5


def _problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    head = torch.randn(VOCAB, HIDDEN, generator=generator)
    input_ids = torch.randint(0, VOCAB, (2, 30), generator=generator)
    loss_mask = (torch.arange(30) >= 4).long().expand(2, -1)
    anchors = torch.tensor([[4, 9, 14, 26], [5, 6, 20, 0]])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    labels, weights = block_labels(input_ids, loss_mask, torch.tensor([30, 28]), anchors, valid, BLOCK, 3.0)
    # A hidden state that points at the label half of the time, so that some labels are in the top-K.
    label_rows = (
        head[labels.flatten(1)] * (torch.rand(labels.flatten(1).shape, generator=generator) < 0.5)[..., None]
    )
    hidden = (label_rows + 0.5 * torch.randn(2, 4 * BLOCK, HIDDEN, generator=generator)).requires_grad_(True)
    return selector, head, hidden, labels, weights


def _slow(selector, head, hidden, labels, weights, gold_outside_top_k, multiplier=1.0, softcap=None):
    """Loop over every scored position: full logits, top-K, scores, K-way CE; and the two walks."""
    total, hits, right, served_ok, unary_ok = 0.0, [0] * BLOCK, [0] * BLOCK, [0] * BLOCK, [0] * BLOCK
    h = hidden.view(labels.shape[0], labels.shape[1], BLOCK, -1)
    for b in range(labels.shape[0]):
        for n in range(labels.shape[1]):
            served_prev, served_alive, unary_alive = labels[b, n, 0], True, True
            for k in range(1, BLOCK):
                logits = scale_logits(head @ h[b, n, k], multiplier, softcap)
                unary, cands = logits.topk(TOP_K)
                gold = labels[b, n, k]
                projected = selector.hidden_projection(h[b, n, k])

                def scores(prev, cands=cands, projected=projected, logits=logits):
                    pair = (
                        selector.predecessor_codebook[prev] * projected * selector.successor_codebook[cands]
                    ).sum(-1)
                    return logits[cands] + pair

                served_pick = cands[scores(served_prev).argmax()]
                served_alive = served_alive and bool(served_pick == gold)
                unary_alive = unary_alive and bool(cands[0] == gold)
                served_prev = served_pick
                if weights[b, n, k] == 0:
                    continue
                found = bool((cands == gold).any())
                teacher = scores(labels[b, n, k - 1])
                hits[k] += found
                served_ok[k] += served_alive
                unary_ok[k] += unary_alive
                if found:
                    index = int((cands == gold).nonzero())
                    right[k] += int(teacher.argmax()) == index
                elif gold_outside_top_k == "inject":
                    cands = torch.cat([cands[:-1], gold[None]])
                    teacher, index = scores(labels[b, n, k - 1], cands), TOP_K - 1
                else:
                    continue
                total = total + weights[b, n, k] * (torch.logsumexp(teacher, 0) - teacher[index])
    return total / weights.sum(), hits, right, served_ok, unary_ok


@pytest.mark.parametrize(
    ("gold_outside_top_k", "multiplier", "softcap"),
    [("drop", 1.0, None), ("inject", 1.0, None), ("drop", 0.7, 2.0), ("inject", 1.5, 3.0)],
)
def test_selector_loss_and_metrics_match_the_slow_version(
    gold_outside_top_k: str, multiplier: float, softcap: float | None
) -> None:
    selector, head, hidden, labels, weights = _problem()
    _, stats, candidates = lm_head_loss_and_candidates(
        hidden, head, labels, weights, TOP_K, chunk_tokens=7, multiplier=multiplier, softcap=softcap
    )
    loss, sel = selector_loss(
        selector,
        hidden,
        head,
        candidates,
        labels,
        weights,
        stats["weight_sum"],
        gold_outside_top_k,
        chunk_rows=5,
        multiplier=multiplier,
        softcap=softcap,
    )
    grads = torch.autograd.grad(loss, [hidden, *selector.parameters()])
    expected, hits, right, served_ok, unary_ok = _slow(
        selector, head, hidden, labels, weights, gold_outside_top_k, multiplier, softcap
    )
    expected_grads = torch.autograd.grad(expected, [hidden, *selector.parameters()])
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sel["topk_hits"].tolist() == hits and sel["selector_correct"].tolist() == right
    assert sel["served_accepted"].tolist() == served_ok and sel["unary_accepted"].tolist() == unary_ok
    # The problem exercises both branches: some labels inside the top-K, some outside.
    assert 0 < sum(hits) < int(stats["count"].sum())


def test_candidate_logits_gradients_equal_autograd_through_a_gather() -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, HIDDEN, generator=generator, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, requires_grad=True)
    candidates = torch.randint(0, VOCAB, (9, TOP_K), generator=generator)
    weights = torch.randn(9, TOP_K, generator=generator)
    got = candidate_logits(hidden, head, candidates, chunk_rows=4)
    expected = torch.einsum("mh,mkh->mk", hidden, head[candidates])
    torch.testing.assert_close(got, expected)
    got_grads = torch.autograd.grad((got * weights).sum(), [hidden, head])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, head])
    for a, b in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_candidates_are_the_sorted_top_k_of_the_head_logits() -> None:
    _, head, hidden, labels, weights = _problem(2)
    _, _, candidates = lm_head_loss_and_candidates(hidden, head, labels, weights, TOP_K, chunk_tokens=6)
    rows = hidden.detach().view(2, 4, BLOCK, -1)[:, :, 1:].reshape(-1, HIDDEN)
    assert torch.equal(candidates.ids, (rows @ head.T).topk(TOP_K).indices)
    torch.testing.assert_close(candidates.logits, (rows @ head.T).topk(TOP_K).values)


def test_fresh_selector_gives_the_unary_path_and_log_k_free_loss() -> None:
    selector, head, hidden, labels, weights = _problem(3)
    with torch.no_grad():
        selector.successor_codebook.zero_()
        _, stats, candidates = lm_head_loss_and_candidates(hidden, head, labels, weights, TOP_K)
        loss, sel = selector_loss(selector, hidden, head, candidates, labels, weights, stats["weight_sum"])
    # A zero successor codebook: the walk is the unary argmax and the selector is the unary head.
    assert torch.equal(sel["served_accepted"], sel["unary_accepted"])
    assert torch.equal(sel["selector_correct"][1:], stats["correct"][1:])
    assert math.isfinite(float(loss)) and float(loss) > 0


def test_selector_metrics_are_rates_per_block_index() -> None:
    totals = {
        "topk_hits": torch.tensor([0, 4, 2]),
        "selector_correct": torch.tensor([0, 3, 1]),
        "served_accepted": torch.tensor([0, 3, 0]),
        "unary_accepted": torch.tensor([0, 2, 0]),
        "loss": torch.tensor(3.0),
    }
    packed = pack_selector_totals(totals, 3, torch.device("cpu"))
    metrics = selector_metrics(packed, torch.tensor([0.0, 4.0, 2.0]), micro_batches=2)
    assert metrics == {
        "selector_loss": 1.5,
        "topk_recall": [1.0, 1.0],
        "selector_acc": [0.75, 0.5],
        "accept_selector": [0.75, 0.0],
        "accept_unary": [0.5, 0.0],
        "accepted_len_selector": 0.75,
        "accepted_len_unary": 0.5,
    }
    assert pack_selector_totals({}, 3, torch.device("cpu")).tolist() == [0.0] * 13
    with pytest.raises(ValueError, match="gold_outside_top_k='keep'"):
        selector_loss(
            *_problem()[:3], torch.zeros(1, TOP_K, dtype=torch.long), *_problem()[3:], torch.ones(()), "keep"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dflash2_loss_on_cuda_flex_equals_sdpa_and_a_warm_step_never_syncs() -> None:
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from dflash_mp.models.drafter import DFlashDrafter
    from dflash_mp.models.drafter_config import build_drafter_config
    from dflash_mp.objective.block_diffusion import drafter_loss

    target = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    fields = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": TOP_K}
    config = build_drafter_config(target, 2, [1, 2], BLOCK, VOCAB - 1, arch="dflash2", dflash2=fields)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (2, 60), generator=generator)
    batch = SimpleNamespace(
        input_ids=input_ids.cuda(),
        loss_mask=(torch.arange(60) >= 8).long().expand(2, -1).cuda(),
        lengths=torch.tensor([60, 51]).cuda(),
        sample_ids=torch.tensor([1, 2]).cuda(),
        epoch=0,
        hidden_states=torch.randn(2, 60, 128, generator=generator).cuda(),
    )
    embed, head = torch.randn(VOCAB, 64).cuda(), torch.randn(VOCAB, 64).cuda()
    args = {"seed": 1, "num_anchors": 8, "gamma": 4.0}
    results = {}
    for attention in ("sdpa", "flex"):
        drafter = DFlashDrafter(config, seed=0).cuda()
        live = torch.Generator().manual_seed(5)
        with torch.no_grad():  # a live selector and live convolutions, the same for both runs
            for param in [drafter.candidate_selector.successor_codebook] + [
                layer.attention_conv.kernel_projection.weight for layer in drafter.layers
            ]:
                param.copy_(0.3 * torch.randn(param.shape, generator=live))
        loss, stats = drafter_loss(drafter, embed, head, batch, attention=attention, **args)
        loss.backward()
        results[attention] = (loss.detach(), [p.grad for p in drafter.parameters()], stats["selector"])
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], atol=1e-4, rtol=1e-4)
    for flex_grad, sdpa_grad in zip(results["flex"][1], results["sdpa"][1], strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, atol=1e-4, rtol=1e-3)
    assert torch.equal(results["flex"][2]["topk_hits"], results["sdpa"][2]["topk_hits"])
    for warm in (True, False):
        torch.cuda.set_sync_debug_mode("warn" if warm else "error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = drafter_loss(
                    drafter, embed.bfloat16(), head.bfloat16(), batch, attention="flex", **args
                )
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
