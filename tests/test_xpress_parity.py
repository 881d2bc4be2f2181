"""XPress (model.arch=xpress) against speculators 0.9.0's XPress, in fp32 on CPU, with the same weights.

The reference's own `XPressDraftModel.forward` runs its refiner passes and loss terms on backbone
outputs we hand it (its `_backbone_forward` is replaced by one returning them), and its refiner's
`block_bias` is recorded: so its teacher-forced pass, its Jacobi rounds and each loss term are the
reference's code, not a copy of it.
"""

from __future__ import annotations

import pytest
import torch
from speculators_reference import speculators_module
from transformers import Qwen3Config

from dflash_mp.models.xpress import XPressRefiner, jacobi_rounds, refined_logits, teacher_forced
from dflash_mp.objective.draft_blocks import loss_decay
from dflash_mp.objective.xpress_loss import XPressWeights, xpress_terms


def ref(name: str):
    """speculators 0.9.0's module `name` (the test skips, naming the install, without it)."""
    return speculators_module(name)


VOCAB, HIDDEN, BLOCK, RANK, RATIO, BLOCKS, GAMMA = 37, 16, 5, 6, 2, 4, 3.0


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (the mixer too: its init is zero, which would hide its math)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module


def reference_model():
    config_module, xpress = ref("config"), ref("models.xpress")
    config_module.reload_schemas()  # what the package's __init__ does once its models are registered
    layer = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    layer._attn_implementation = "eager"
    config = xpress.XPressSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=VOCAB,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=[0, 1],
        mask_token_id=VOCAB - 1,
        xpress_rank=RANK,
        xpress_mlp_ratio=RATIO,
        speculators_config=config_module.SpeculatorsConfig(
            algorithm="xpress",
            proposal_methods=[
                ref("proposals.greedy").GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)
            ],
            default_proposal_method="greedy",
            verifier=config_module.VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    model = xpress.XPressDraftModel(config).eval()
    _randomised(model.refiner_head, 1)
    return model


def ours_from(reference) -> XPressRefiner:
    ours = XPressRefiner(HIDDEN, VOCAB, BLOCK, RANK, RATIO)
    ours.load_state_dict(reference.refiner_head.state_dict(), strict=True)
    return ours


class Case:
    """One packed sequence of two documents with BLOCKS anchored blocks, as the reference reads it."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        length = 40
        self.input_ids = torch.randint(0, VOCAB - 1, (1, length), generator=g)
        self.document_ids = (torch.arange(length) >= 20).long()[None]
        # Anchors: one at a document's first token (its predecessor is another document's).
        self.anchors = torch.tensor([3, 11, 20, 30])
        self.indices = (self.anchors[:, None] + torch.arange(BLOCK)).flatten()
        self.hidden = torch.randn(1, BLOCKS * BLOCK, HIDDEN, generator=g)
        self.base = torch.randn(1, BLOCKS * BLOCK, VOCAB, generator=g) * 2
        self.targets = torch.randn(1, BLOCKS * BLOCK, VOCAB, generator=g)
        mask = (torch.rand(BLOCKS, BLOCK, generator=g) < 0.8).float()
        mask[:, 0] = 0  # the anchor's own slot is never scored
        mask[1, 2:] = 0
        self.mask = mask.view(1, -1)

    # Our side's view of the same blocks.
    def labels(self) -> torch.Tensor:
        return self.input_ids[0, self.indices].view(BLOCKS, BLOCK)

    def before_anchor(self) -> torch.Tensor:
        previous = self.input_ids[0, self.anchors - 1]
        same_document = self.document_ids[0, self.anchors - 1] == self.document_ids[0, self.anchors]
        # A document's first token has nothing before it: the reference stands the anchor in.
        return torch.where(same_document, previous, self.input_ids[0, self.anchors])


def run_reference(model, case: Case, **kwargs) -> tuple[torch.Tensor, dict, list]:
    """The reference's forward on `case`'s backbone outputs; returns (loss, metrics, recorded biases)."""
    model._backbone_forward = lambda *a, **k: (
        case.hidden,
        case.base,
        case.targets,
        case.mask,
        case.indices,
    )
    biases = []
    head = model.refiner_head
    original = head.block_bias

    def recording(*args, **kw):
        out = original(*args, **kw)
        biases.append(out)
        return out

    head.block_bias = recording
    _, loss, metrics = model(
        hidden_states=None,
        input_ids=case.input_ids,
        loss_mask=None,
        verifier_last_hidden_states=None,
        document_ids=case.document_ids,
        loss_config=ref("losses").resolve_loss_config("ce", "eager"),
        gamma=GAMMA,
        max_anchors=BLOCKS,
        ce_from_data=True,
        **kwargs,
    )
    return loss, metrics, biases


def run_ours(refiner: XPressRefiner, case: Case, weights: XPressWeights) -> tuple:
    mask = case.mask.view(BLOCKS, BLOCK).bool()
    decay = loss_decay(BLOCK, GAMMA, torch.device("cpu")).expand(BLOCKS, BLOCK) * mask
    return xpress_terms(
        refiner,
        case.base.view(BLOCKS, BLOCK, VOCAB),
        case.hidden.view(BLOCKS, BLOCK, HIDDEN),
        case.labels(),
        case.before_anchor(),
        mask,
        decay,
        weights,
    )


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.view_as(actual), rtol=0, atol=0)


def test_refiner_bias_equals_the_reference_head():
    reference = _randomised(
        ref("models.xpress.model_definitions").XPressRefinerHead(
            verifier_vocab_size=VOCAB,
            draft_vocab_size=VOCAB,
            hidden_size=HIDDEN,
            block_size=BLOCK,
            rank=RANK,
            mlp_ratio=RATIO,
        ),
        2,
    )
    ours = XPressRefiner(HIDDEN, VOCAB, BLOCK, RANK, RATIO)
    ours.load_state_dict(reference.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, BLOCK, HIDDEN, generator=g)
    prev = torch.randint(0, VOCAB, (7, BLOCK), generator=g)
    exact(ours.hidden_cache(hidden), reference.hidden_cache(hidden))
    bias = ours.block_bias(prev, ours.hidden_cache(hidden))
    exact(bias, reference.block_bias(prev, hidden_states=hidden))
    # Causal: changing the token before position 2 leaves positions 0 and 1 alone.
    changed = prev.clone()
    changed[:, 2] = (changed[:, 2] + 1) % VOCAB
    other = ours.block_bias(changed, ours.hidden_cache(hidden))
    exact(other[:, :2], bias[:, :2])
    assert not torch.equal(other[:, 2], bias[:, 2])


@pytest.mark.parametrize(
    ("weights", "reference_kwargs"),
    [
        (XPressWeights(), {}),
        (
            XPressWeights(0.5, 2, 0.25, True),
            dict(
                consistency_weight=0.5,
                consistency_passes=2,
                base_anchor_weight=0.25,
                base_anchor_full_weight=True,
            ),
        ),
        (
            XPressWeights(0.3, 3, 0.6, False, dpace_alpha=0.4),
            dict(per_position_loss_weight="dpace", dpace_alpha=0.4),
        ),
        (XPressWeights(0.0, 3, 0.0), dict(consistency_weight=0.0, base_anchor_weight=0.0)),
    ],
    ids=["defaults", "weights-full-anchor", "dpace", "teacher-forced-only"],
)
def test_passes_and_loss_terms_equal_the_reference(weights, reference_kwargs):
    model = reference_model()
    case = Case(4)
    loss, metrics, biases = run_reference(model, case, **reference_kwargs)
    ours_loss, terms, correct = run_ours(ours_from(model), case, weights)

    base = case.base.view(BLOCKS, BLOCK, VOCAB)
    cache = ours_from(model).hidden_cache(case.hidden.view(BLOCKS, BLOCK, HIDDEN))
    teacher = teacher_forced(ours_from(model), base, cache, case.labels(), case.before_anchor())
    exact(teacher, base + biases[0])  # the teacher-forced pass
    mask = case.mask.view(BLOCKS, BLOCK).bool()
    assert torch.equal(correct, ((base + biases[0]).argmax(-1) == case.labels()) & mask)
    exact(terms["tf_loss"], metrics["tf_loss_sum"])
    rounds = weights.consistency_passes if weights.consistency_weight > 0 else 0
    assert len(biases) == 1 + rounds
    if rounds:
        exact(terms["consistency_loss"], metrics["consistency_loss_sum"])
        ours_rounds = jacobi_rounds(
            ours_from(model), base, cache, case.labels()[:, 0], case.before_anchor(), rounds
        )
        for mine, bias in zip(ours_rounds, biases[1:], strict=True):
            exact(mine, base + bias)
    else:
        assert "consistency_loss_sum" not in metrics and "consistency_loss" not in terms
    if weights.base_anchor_weight > 0:
        exact(terms["base_anchor_loss"], metrics["base_anchor_loss_sum"])
    else:
        assert "base_anchor_loss" not in terms
    exact(ours_loss, loss)
    assert loss.item() > 0


def test_final_logits_after_k_passes_equal_the_reference_rounds():
    """Inference's K passes are the reference's consistency rounds: K = 6 rounds there, the sixth's
    logits (what the block is proposed from) equal ours; K = 0 proposes from the drafter's own."""
    model = reference_model()
    case = Case(5)
    _, _, biases = run_reference(model, case, consistency_passes=6)
    ours = ours_from(model)
    base = case.base.view(BLOCKS, BLOCK, VOCAB)
    hidden = case.hidden.view(BLOCKS, BLOCK, HIDDEN)
    final = refined_logits(ours, base, hidden, case.labels()[:, 0], case.before_anchor(), 6)
    exact(final, base + biases[-1])
    assert not torch.equal(final.argmax(-1), base.argmax(-1))  # the passes changed the proposals
    exact(refined_logits(ours, base, hidden, case.labels()[:, 0], case.before_anchor(), 0), base)
