"""DSpark's config fields: bad values are refused naming the key and the fix, and the target ranks
send the teacher's layer only when the loss reads it."""

from __future__ import annotations

import pytest

from dflash_mp.config.dspark_checks import feature_layer_ids
from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate


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
        (("train.position_weights=dpace",), "use train.position_weights=decay"),
    ],
)
def test_bad_dspark_settings_are_named(overrides: tuple[str, ...], expected: str) -> None:
    assert expected in _problems(*overrides)


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
