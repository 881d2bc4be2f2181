"""Config validation: every problem named with its field and the valid range, all at once."""

import json
import subprocess
import sys

import pytest

from dflash_mp.config.schema import ConfigError, compose_config, default_target_layer_ids, to_dataclass
from dflash_mp.config.validation import validate

# Qwen/Qwen3-8B's config.json, the fields the preflight reads: a stand-in without weights.
QWEN3_8B_SHAPE = {
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}


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
        "train.max_nonfinite_in_a_row=-1",
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
        "train.max_nonfinite_in_a_row=-1: must be >= 0 (0: no limit)",
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
    # Evenly spaced from layer 1 to L-3; one draft layer takes L//2 (docs/DESIGN.md §3).
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    from dflash.model import build_target_layer_ids

    for layers in (6, 28, 36, 64):
        for draft in (1, 2, 3, 5):
            reference = build_target_layer_ids(layers, draft)
            if len(set(reference)) == len(reference):
                assert default_target_layer_ids(layers, draft) == reference
    # Too shallow for distinct layers in [1, L-3]: widen instead of repeating (the reference gives [1, 1]).
    assert default_target_layer_ids(4, 2) == [1, 2]
    assert default_target_layer_ids(4, 3) == [1, 2, 3]


def test_paper_recipe_checkpoints_and_needs_held_out_prompts_for_a_real_target(tmp_path):
    """experiment=paper evaluates tau on the user's held-out prompts, never the embedded toy ones."""
    target = tmp_path / "Qwen3-8B"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_8B_SHAPE))
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    common = ("experiment=paper", f"model.target_path={target}", f"data.train_files=[{data}]")
    cfg = _cfg(*common)
    assert cfg.train.checkpoint_every > 0 and cfg.eval.every > 0
    with pytest.raises(ConfigError, match=r"data.eval_files is empty: set data.eval_files="):
        validate(cfg, world_size=8)
    validate(_cfg(*common, f"data.eval_files=[{data}]"), world_size=8)
    validate(_cfg(*common, "eval.every=0"), world_size=8)


def test_dflash2_settings_are_validated_against_the_target():
    validate(_cfg("model.arch=dflash2"), world_size=3)
    cfg = _cfg(
        "model.arch=dflash2",
        "model.conv_group_size=24",
        "model.selector_top_k=500",
        "model.selector_rank=0",
        "model.selector_loss_alpha=-1",
        "model.selector_gold_outside_top_k=keep",
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=3)
    message = str(info.value)
    for expected in (
        "model.conv_group_size=24: must divide the target's hidden size 64 (e.g. 8)",
        "model.selector_top_k=500: exceeds the target's vocab_size 159",
        "model.selector_rank=0: must be >= 1",
        "model.selector_loss_alpha=-1",
        "model.selector_gold_outside_top_k='keep': must be one of 'drop', 'inject'",
    ):
        assert expected in message, expected
    with pytest.raises(ConfigError, match="model.arch='dflash3': must be one of 'dflash', 'dflash2'"):
        validate(_cfg("model.arch=dflash3"), world_size=3)


@pytest.mark.parametrize(("block_size", "gamma"), [(16, 7.0), (8, 4.0), (4, 2.5)])
def test_gamma_follows_the_block_size_unless_set(block_size, gamma):
    # The embedded experiment sets its own gamma; null asks for the rule.
    assert _cfg(f"model.block_size={block_size}", "train.gamma=null").train.gamma == gamma
    assert _cfg(f"model.block_size={block_size}", "train.gamma=5.5").train.gamma == 5.5


def test_a_non_positive_gamma_is_refused():
    with pytest.raises(ConfigError, match="train.gamma=0"):
        validate(_cfg("train.gamma=0"), world_size=3)


@pytest.mark.parametrize(
    ("entry", "override", "named"),
    [
        ("dflash_mp.train", "optim.lrr=1", "optim.lrr"),  # no such key
        ("dflash_mp.train", "topology=nope", "topology/nope"),  # no such group option
        ("dflash_mp.launch run", "optim.lr=abc", "optim.lr"),  # the wrong type
        ("dflash_mp.launch doctor", "optim.lrr=1", "optim.lrr"),
    ],
)
def test_overrides_hydra_cannot_compose_exit_2_naming_them_on_every_entry_point(
    tmp_path, entry, override, named
):
    """A config error exits 2 (the exit-code table), also where Hydra refuses the command line itself."""
    from tests.conftest import REPO, job_env

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", *entry.split(), f"run_dir={run}", override]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "heartbeats").exists()  # no worker started


@pytest.mark.parametrize(
    ("override", "named"), [("train.max_steps=-5", "train.max_steps=-5"), ("optim.lrr=1", "optim.lrr")]
)
def test_the_reference_trainer_refuses_a_bad_config_with_exit_2(override, named, capsys):
    from dflash_mp import reference

    with pytest.raises(SystemExit) as exit_info:
        reference.main([override])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
