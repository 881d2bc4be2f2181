"""train.position_weights=dpace against speculators 0.9.0, the reference D-PACE (fp32, CPU): the
weights bit for bit, the loss and its gradient as speculators composes them, the DFlash 2 selector
term, and the config's checks. The packed normalisation is in tests/test_packing.py."""

from __future__ import annotations

from functools import cache, partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.objective import selector_loss as selector_module
from dflash_mp.objective.draft_blocks import loss_decay
from dflash_mp.objective.lm_head_loss import chunked_lm_head_loss, lm_head_loss_and_candidates
from dflash_mp.objective.position_weights import dpace_alpha_of, dpace_weights
from tests.speculators_reference import speculators_module


@cache
def _reference():
    """speculators' losses.utils, imported once, when a test needs it (a missing speculators skips that
    test alone, not the module's other tests)."""
    return speculators_module("losses.utils")


BLOCK, VOCAB, HIDDEN = 8, 40, 16


def _problem(seed: int = 0, batch: int = 2, blocks: int = 6):
    """hidden [B, N*Bs, H] (grad), head [V, H], labels [B, N, Bs], decay weights [B, N, Bs] with
    unscored positions anywhere in a block (not only at its end) and index 0 unscored."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, blocks * BLOCK, HIDDEN, generator=generator).requires_grad_()
    head = torch.randn(VOCAB, HIDDEN, generator=generator) / 2
    labels = torch.randint(0, VOCAB, (batch, blocks, BLOCK), generator=generator)
    scored = torch.rand(batch, blocks, BLOCK, generator=generator) > 0.25
    scored[0, 0] = True  # one whole block
    scored[..., 0] = False
    return hidden, head, labels, loss_decay(BLOCK, 7.0, torch.device("cpu")) * scored


def _reference_weights_of_block(
    ce_by_block: torch.Tensor, scored: torch.Tensor, alpha: float
) -> torch.Tensor:
    """speculators' D-PACE on blocks [N, Bs] laid out as its packed [1, N*Bs] row."""
    mask = scored.reshape(1, -1).float()
    block_size = ce_by_block.shape[-1]
    reference = _reference()
    return reference.dpace_loss_decay(
        torch.arange(mask.shape[1]) % block_size,
        loss_mask=mask,
        block_size=block_size,
        dpace_alpha=alpha,
        elementwise_loss=ce_by_block.reshape(1, -1) * mask,  # as its loss_function hands it over
    ).view_as(ce_by_block)


@pytest.mark.parametrize("alpha", [0.5, 0.3, 1.0])
def test_dpace_weights_are_speculators_bit_for_bit(alpha: float) -> None:
    generator = torch.Generator().manual_seed(1)
    ce = torch.rand(12, BLOCK, generator=generator) * 6
    scored = torch.rand(12, BLOCK, generator=generator) > 0.2
    scored[:, 0] = False  # the anchor
    expected = _reference_weights_of_block(ce, scored, alpha)
    ours = dpace_weights(ce[:, 1:], scored[:, 1:], alpha)  # the loss sees block indices 1..Bs-1
    assert torch.equal(ours, expected[:, 1:])
    assert not expected[:, 0].any() and not ours[~scored[:, 1:]].any()
    # Within a fully scored block a position weighs at least what every later one does.
    full = scored[:, 1:].all(-1)
    if full.any():
        assert (ours[full][:, :-1] >= ours[full][:, 1:]).all()
    assert not dpace_weights(ce.requires_grad_()[:, 1:], scored[:, 1:], alpha).requires_grad


def test_dpace_loss_and_gradient_are_speculators_loss_function() -> None:
    hidden, head, labels, weights = _problem()
    loss, stats = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=7, dpace_alpha=0.5)
    loss.backward()
    ours_grad = hidden.grad.clone()

    # speculators: one packed row, CE of the logits per token, D-PACE as its decay_fn.
    hidden.grad = None
    logits = (hidden @ head.T).reshape(1, -1, VOCAB)
    mask = (weights > 0).reshape(1, -1)

    def cross_entropy(logits, targets):
        return F.cross_entropy(logits[0], targets[0], reduction="none")[None]

    decay_fn = partial(_reference().dpace_loss_decay, loss_mask=mask, block_size=BLOCK, dpace_alpha=0.5)
    pos_idx = (torch.arange(mask.shape[1]) % BLOCK)[None]
    expected = _reference().loss_function(
        logits, labels.reshape(1, -1), mask, pos_idx, loss_fn=cross_entropy, decay_fn=decay_fn
    )
    expected.backward()
    # Its denominator is the scored count plus 1e-5: a relative 2e-7 here.
    assert stats["weight_sum"].item() == mask.sum().item()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_grad, hidden.grad, rtol=1e-5, atol=1e-7)

    decay, _ = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=7)
    assert abs(decay.item() - loss.item()) > 1e-3 * loss.item()  # dpace is not the decay


def test_the_selector_term_takes_dpace_of_its_own_ce(monkeypatch) -> None:
    """DFlash 2: the selector's weights are D-PACE of the selector's CE over its scored rows (a
    dropped label is unscored), and the term shares the LM-head loss's denominator."""
    from tests.test_selector_loss import _problem as selector_problem

    seen = {}

    def spy(ce, scored, alpha):
        weights = dpace_weights(ce, scored, alpha)
        seen.update(ce=ce.detach(), scored=scored, weights=weights)
        return weights

    monkeypatch.setattr(selector_module, "dpace_weights", spy)
    selector, head, hidden, labels, weights = selector_problem()
    top_k = selector.top_k
    _, stats, candidates = lm_head_loss_and_candidates(hidden, head, labels, weights, top_k, dpace_alpha=0.5)
    weight_sum = stats["weight_sum"]
    assert weight_sum.item() == (weights > 0).sum().item()  # both terms over the scored count
    term, _ = selector_module.selector_loss(
        selector, hidden, head, candidates, labels, weights, weight_sum, "drop", dpace_alpha=0.5
    )
    steps = labels.shape[-1] - 1
    assert seen["ce"].shape[-1] == steps and seen["scored"].any() and not seen["scored"].all()
    pad = torch.zeros(seen["ce"].shape[0], 1)  # the anchor column speculators' blocks carry
    expected = _reference_weights_of_block(
        torch.cat([pad, seen["ce"]], -1), torch.cat([pad.bool(), seen["scored"]], -1), 0.5
    )
    assert torch.equal(seen["weights"], expected[:, 1:])
    torch.testing.assert_close(term, (seen["weights"] * seen["ce"]).sum() / weight_sum)


def test_position_weights_and_alpha_are_checked_by_name() -> None:
    cfg = to_dataclass(compose_config(["train.position_weights=dpace", "train.dpace_alpha=0.25"]))
    assert dpace_alpha_of(cfg.train) == 0.25
    assert dpace_alpha_of(to_dataclass(compose_config([])).train) is None  # decay by default
    for override, named in (
        ("train.position_weights=dpce", "train.position_weights='dpce': must be one of 'decay', 'dpace'"),
        ("train.dpace_alpha=0", "train.dpace_alpha=0.0: must be in (0, 1]"),
        ("train.dpace_alpha=1.5", "train.dpace_alpha=1.5: must be in (0, 1]"),
    ):
        with pytest.raises(ConfigError) as refused:
            validate(compose_config([override]))
        assert named in str(refused.value)
    with pytest.raises(ValueError, match="train.dpace_alpha"):
        dpace_weights(torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match="train.position_weights"):
        dpace_alpha_of(SimpleNamespace(position_weights="x", dpace_alpha=0.5))


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_trainer_trains_with_dpace_for_both_archs(arch: str) -> None:
    """train.position_weights reaches the loss of a training step (DFlash and DFlash 2)."""
    from dflash_mp.training.trainer import DrafterTrainer
    from tests.test_trainer import _micro_batch

    records = {}
    for weights in ("decay", "dpace"):
        overrides = [f"model.arch={arch}", "train.max_steps=2", "train.micro_batch_size=2"]
        cfg = to_dataclass(compose_config([*overrides, f"train.position_weights={weights}"]))
        trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=2)
        trainer.micro_step(_micro_batch(cfg), last_of_step=True)
        records[weights] = trainer.optimizer_step()
    assert not records["dpace"]["skipped"] and records["dpace"]["grad_norm"] > 0
    assert abs(records["dpace"]["loss"] - records["decay"]["loss"]) > 1e-3
    if arch == "dflash2":
        assert records["dpace"]["selector_loss"] != records["decay"]["selector_loss"]
