"""Config validation: every problem named with its field and the valid range, all at once."""

import pytest

from dflash_mp.config import ConfigError, compose_config, default_target_layer_ids, to_dataclass, validate


def _cfg(*overrides: str):
    return to_dataclass(compose_config(list(overrides)))


def test_the_embedded_default_is_valid():
    validate(_cfg(), world_size=3)


def test_all_problems_are_reported_at_once(tmp_path):
    cfg = _cfg(
        "optim.lr=-1",
        "model.block_size=1",
        "model.target_layer_ids=[0,99]",
        f"data.train_files=[{tmp_path}/missing.jsonl]",
        "model.draft_layers=40",
        "data.on_bad_record=ignore",
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=3)
    message = str(info.value)
    for expected in (
        "optim.lr=-1",
        "(0, 1)",
        "model.block_size=1",
        "data.train_files[0]",
        "does not exist",
        "model.draft_layers=40",
        "[1, 6]",
        "data.on_bad_record='ignore'",
    ):
        assert expected in message, expected


def test_target_layer_ids_outside_the_target():
    with pytest.raises(
        ConfigError, match=r"model.target_layer_ids=\[0, 99\].*outside the target's layers \[0, 5\]"
    ):
        validate(_cfg("model.target_layer_ids=[0,99]"), world_size=3)


def test_world_size_must_match_the_topology():
    with pytest.raises(ConfigError, match="WORLD_SIZE is 4"):
        validate(_cfg("topology.targets=2", "topology.drafters=1"), world_size=4)


def test_unknown_keys_are_rejected_by_the_schema():
    with pytest.raises(Exception, match="max_step"):
        _cfg("train.max_step=5")


def test_default_layer_choice_matches_dflash():
    # Evenly spaced from layer 1 to L-3; one draft layer takes L//2 (DESIGN §3).
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    from dflash.model import build_target_layer_ids

    for layers in (6, 28, 36, 64):
        for draft in (1, 2, 3, 5):
            assert default_target_layer_ids(layers, draft) == build_target_layer_ids(layers, draft)


@pytest.mark.parametrize(("block_size", "gamma"), [(16, 7.0), (8, 4.0), (4, 2.5)])
def test_gamma_follows_the_block_size_unless_set(block_size, gamma):
    # The embedded experiment sets its own gamma; null asks for the rule.
    assert _cfg(f"model.block_size={block_size}", "train.gamma=null").train.gamma == gamma
    assert _cfg(f"model.block_size={block_size}", "train.gamma=5.5").train.gamma == 5.5


def test_a_non_positive_gamma_is_refused():
    with pytest.raises(ConfigError, match="train.gamma=0"):
        validate(_cfg("train.gamma=0"), world_size=3)
