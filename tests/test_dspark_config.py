"""DSpark's config fields: bad values are refused naming the key and the fix, the target ranks send
the teacher's layer only when the loss reads it, and the loss trains both heads from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from dflash_mp.config.dspark_checks import feature_layer_ids
from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.objective.block_diffusion import drafter_loss
from dflash_mp.objective.dspark_loss import DSparkLossWeights


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        validate(to_dataclass(compose_config(["model.arch=dspark", *overrides])))
    return str(error.value)


def test_the_embedded_default_is_valid_as_dspark() -> None:
    validate(to_dataclass(compose_config(["model.arch=dspark"])))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("model.markov_rank=-1",), "model.markov_rank=-1: must be an integer >= 0"),
        (
            ("model.markov_head_type=lstm",),
            "model.markov_head_type='lstm': must be one of vanilla, gated, rnn",
        ),
        (("model.markov_rank=0",), "set model.markov_rank > 0 or model.confidence_head_with_markov=false"),
        (("model.dspark_tv_alpha=-0.5",), "model.dspark_tv_alpha=-0.5: must be a number >= 0"),
        (
            ("model.dspark_ce_alpha=0", "model.dspark_tv_alpha=0"),
            "nothing trains the draft logits; set one > 0",
        ),
        (("model.dspark_confidence_alpha=0",), "set model.enable_confidence_head=false or an alpha > 0"),
        (("model.conv_kernel_size=3",), "model.conv_kernel_size=3 is a DFlash 2 setting"),
    ],
)
def test_bad_dspark_settings_are_named(overrides: tuple[str, ...], expected: str) -> None:
    assert expected in _problems(*overrides)


def test_dpace_is_valid_as_dspark() -> None:
    validate(to_dataclass(compose_config(["model.arch=dspark", "train.position_weights=dpace"])))


def test_no_markov_head_and_a_confidence_head_of_its_own_is_valid() -> None:
    validate(
        to_dataclass(
            compose_config(
                ["model.arch=dspark", "model.markov_rank=0", "model.confidence_head_with_markov=false"]
            )
        )
    )


def test_the_teacher_layer_is_sent_only_when_the_loss_reads_it() -> None:
    cfg = to_dataclass(compose_config(["model.arch=dspark"]))
    assert feature_layer_ids([1, 2], 6, cfg.model) == [1, 2, 5]
    ce_only = to_dataclass(
        compose_config(["model.arch=dspark", "model.dspark_tv_alpha=0", "model.enable_confidence_head=false"])
    )
    assert feature_layer_ids([1, 2], 6, ce_only.model) == [1, 2]
    assert feature_layer_ids([1, 2], 6, to_dataclass(compose_config([])).model) == [1, 2]


def _tiny_loss(features_width_layers: int, dpace_alpha: float | None = None, **fields):
    """A DSpark drafter's loss on one random micro-batch whose features hold that many target layers."""
    target = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=97,
    )
    config = build_drafter_config(
        target, 1, [1], block_size=4, mask_token_id=96, arch="dspark", dspark={"markov_rank": 4, **fields}
    )
    drafter = DFlashDrafter(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 96, (2, 20), generator=generator)
    batch = SimpleNamespace(
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids),
        lengths=torch.tensor([20, 16]),
        sample_ids=torch.arange(2),
        epoch=0,
        hidden_states=torch.randn(2, 20, 32 * features_width_layers, generator=generator),
    )
    embed, head = torch.randn(97, 32, generator=generator), torch.randn(97, 32, generator=generator)
    weights = DSparkLossWeights(ce=1.0, kl=0.0, tv=0.0 if features_width_layers == 1 else 1.0, confidence=1.0)
    loss, stats = drafter_loss(
        drafter,
        embed,
        head,
        batch,
        seed=0,
        num_anchors=3,
        gamma=2.0,
        attention="sdpa",
        dspark=weights,
        dpace_alpha=dpace_alpha,
    )
    return drafter, loss, stats


def test_the_loss_trains_both_heads_from_the_teacher_layer() -> None:
    drafter, loss, stats = _tiny_loss(2)
    loss.backward()
    for name in (
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
    ):
        assert dict(drafter.named_parameters())[name].grad.abs().sum() > 0, name
    assert stats["count"][0] > 0  # sample_from_anchor: position 0 is scored
    assert 0 < float(stats["dspark"][2]) < 1  # TV to the teacher


def test_dpace_reaches_the_dspark_loss() -> None:
    _, decayed, _ = _tiny_loss(2)
    drafter, dpace, _ = _tiny_loss(2, dpace_alpha=0.5)
    assert torch.isfinite(dpace) and not torch.allclose(dpace, decayed)
    dpace.backward()
    assert dict(drafter.named_parameters())["confidence_head.proj.weight"].grad.abs().sum() > 0


def test_without_the_teacher_layer_only_the_ce_trains() -> None:
    with pytest.raises(ValueError, match="need the target's last layer in the features"):
        _tiny_loss(1)
    _, loss, _ = _tiny_loss(1, enable_confidence_head=False)
    assert torch.isfinite(loss)
