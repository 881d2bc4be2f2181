"""How the DFlash 2 loss terms enter a training step: the selector term scaled by
model.selector_loss_alpha, and both terms divided alike by train.grad_accum."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.objective.lm_head_loss import chunked_lm_head_loss
from dflash_mp.training.trainer import DrafterTrainer
from tests.block_problems import loss_problem
from tests.test_trainer import _micro_batch


def _trainer(*overrides: str) -> DrafterTrainer:
    cfg = to_dataclass(
        compose_config(["model.arch=dflash2", "train.max_steps=4", "train.micro_batch_size=2", *overrides])
    )
    return DrafterTrainer(cfg, torch.device("cpu"), total_steps=4)


def _one_micro_step(trainer: DrafterTrainer, batch) -> tuple[dict[str, torch.Tensor], dict]:
    """The gradients of one micro-batch (same init: same train.seed), then the step's record."""
    trainer.micro_step(batch, last_of_step=True)
    grads = {name: p.grad.clone() for name, p in trainer.drafter.named_parameters() if p.grad is not None}
    return grads, trainer.optimizer_step()


@pytest.fixture(scope="module")
def batch():
    return _micro_batch(_trainer().cfg)


def test_the_selector_term_is_scaled_by_alpha_in_the_loss_and_the_gradient(batch):
    grads, records = {}, {}
    for alpha in (0.0, 0.5, 1.0):
        grads[alpha], records[alpha] = _one_micro_step(_trainer(f"model.selector_loss_alpha={alpha}"), batch)
    # loss = DFlash term + alpha * selector term; the logged selector_loss is the term itself.
    term = records[0.5]["selector_loss"]
    assert term > 0.1 and records[0.0]["selector_loss"] == pytest.approx(term, rel=1e-6)
    for alpha in (0.5, 1.0):
        assert records[alpha]["loss"] == pytest.approx(records[0.0]["loss"] + alpha * term, rel=1e-5)
    # The gradient is affine in alpha, and the selector term does move it.
    successor = "candidate_selector.successor_codebook"
    assert not grads[0.0][successor].any() and grads[1.0][successor].abs().sum() > 0
    for name, at_zero in grads[0.0].items():
        midpoint = (at_zero + grads[1.0][name]) / 2
        torch.testing.assert_close(grads[0.5][name], midpoint, rtol=1e-4, atol=1e-7, msg=name)


def test_grad_accum_divides_both_terms_alike(batch):
    # A micro-batch of a step of A contributes 1/A of its gradient: the LM-head term (its fused
    # backward must apply the upstream 1/A) as well as the selector term.
    alone, _ = _one_micro_step(_trainer("train.grad_accum=1"), batch)
    trainer = _trainer("train.grad_accum=4")
    trainer.micro_step(batch, last_of_step=False)
    for name, p in trainer.drafter.named_parameters():
        if name in alone:
            torch.testing.assert_close(p.grad, alone[name] / 4, rtol=1e-4, atol=1e-8, msg=name)


def test_the_fused_lm_head_backward_applies_the_upstream_gradient():
    hidden, head, labels, weights = loss_problem()
    loss, _ = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=7)
    hidden_grad, head_grad = torch.autograd.grad(loss, (hidden, head))
    loss, _ = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=7)
    scaled_hidden_grad, scaled_head_grad = torch.autograd.grad(-0.25 * loss, (hidden, head))
    torch.testing.assert_close(scaled_hidden_grad, -0.25 * hidden_grad)
    torch.testing.assert_close(scaled_head_grad, -0.25 * head_grad)
