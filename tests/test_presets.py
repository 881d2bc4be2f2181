"""The experiment presets: each composes, validates and builds its drafter against a stand-in of
its target; a real target under the embedded experiment is refused on every entry point."""

import json
import shutil

import pytest

from dflash_mp.config.schema import CONF_DIR, ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.embedded import embedded_path, target_dir
from dflash_mp.launch import doctor, rank
from dflash_mp.runtime import watchdog
from dflash_mp.training.recipe import build_drafter

# num_hidden_layers of each preset's real target (its config.json; text_config for Qwen3.5/3.6).
TARGET_LAYERS = {
    "paper": 36,
    "qwen3-4b": 36,
    "qwen3-8b": 36,
    "field-recipe": 36,  # Qwen3-8B with the field's recipe (speculators issue #979)
    "qwen3.5-4b": 32,
    "qwen3.5-9b": 32,
    "qwen3.5-27b": 64,
    "qwen3-coder-30b-a3b": 48,
    "qwen3.5-35b-a3b": 40,
    "qwen3.6-35b-a3b": 40,
    "gpt-oss-20b": 24,
    "gpt-oss-120b": 36,
    "llama3.1-8b": 32,
}


def _stand_in_target(tmp_path, num_layers: int):
    """The embedded tiny target (its tokenizer and shapes) claiming the real target's depth."""
    target = tmp_path / "target"
    shutil.copytree(target_dir(), target)
    config = json.loads((target / "config.json").read_text())
    config.pop("layer_types", None)  # one per layer: it would disagree with the new depth
    config |= {"num_hidden_layers": num_layers, "max_position_embeddings": 40960}
    (target / "config.json").write_text(json.dumps(config))
    return target


def _data() -> tuple[str, str]:
    return f"data.train_files=[{embedded_path('data/train.jsonl')}]", (
        f"data.eval_files=[{embedded_path('data/eval.jsonl')}]"
    )


def test_every_target_preset_is_listed_here():
    presets = {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}
    assert presets - {"embedded", "smoke", "custom"} == set(TARGET_LAYERS)


@pytest.mark.parametrize("preset", sorted(TARGET_LAYERS))
def test_a_preset_validates_and_builds_its_drafter(tmp_path, preset):
    num_layers = TARGET_LAYERS[preset]
    target = _stand_in_target(tmp_path, num_layers)
    cfg = to_dataclass(compose_config([f"experiment={preset}", f"model.target_path={target}", *_data()]))
    validate(cfg, world_size=8)
    m = cfg.model
    assert cfg.preset == preset and m.target_layer_ids is not None
    assert all(0 <= i < num_layers for i in m.target_layer_ids)
    # The paper's recipe, not the embedded one (arXiv 2602.06036); optim=muon: speculators' lr.
    lr = {"adamw": 6e-4, "muon": 1e-3}[cfg.optim.name]
    assert (cfg.optim.lr, cfg.data.max_length, cfg.data.num_anchors, cfg.train.epochs) == (lr, 3072, 512, 6)
    assert cfg.train.gamma == (7.0 if m.block_size == 16 else 4.0)
    drafter = build_drafter(cfg)
    assert drafter.block_size == m.block_size
    drafter = drafter.config
    assert drafter.num_hidden_layers == m.draft_layers and drafter.num_target_layers == num_layers
    assert drafter.dflash_config["target_layer_ids"] == list(m.target_layer_ids)
    assert drafter.layer_types == (
        list(m.layer_types) if m.layer_types else ["full_attention"] * m.draft_layers
    )


def test_custom_needs_a_target_and_data_then_spaces_the_layers_evenly(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate(to_dataclass(compose_config(["experiment=custom"])), world_size=8)
    assert "model.target_path='': no config.json there" in str(info.value)
    target = _stand_in_target(tmp_path, 28)
    cfg = to_dataclass(compose_config(["experiment=custom", f"model.target_path={target}", *_data()]))
    validate(cfg, world_size=8)
    assert build_drafter(cfg).config.dflash_config["target_layer_ids"] == [1, 7, 13, 19, 25]


def _refusal_named(message: str) -> None:
    assert "under experiment=embedded" in message
    assert "data.max_length=128" in message and "experiment=custom" in message
    assert "qwen3-8b" in message and "gpt-oss-20b" in message


def test_a_real_target_under_the_embedded_experiment_is_refused(tmp_path):
    target = _stand_in_target(tmp_path, 36)
    with pytest.raises(ConfigError) as info:
        validate(to_dataclass(compose_config([f"model.target_path={target}"])), world_size=3)
    _refusal_named(str(info.value))
    validate(to_dataclass(compose_config()), world_size=3)  # the embedded default is untouched


def test_the_refusal_holds_under_the_launcher_and_under_plain_torchrun(tmp_path, monkeypatch, capsys):
    target = _stand_in_target(tmp_path, 36)
    dict_cfg = compose_config([f"model.target_path={target}", f"run_dir={tmp_path / 'run'}"])
    # The launcher's preflight, before it starts torchrun.
    failed = [c.message for c in doctor.failed(doctor.preflight(dict_cfg, tmp_path / "run"))]
    _refusal_named("\n".join(failed))
    # Every torchrun rank validates before it joins a process group.
    monkeypatch.setattr(watchdog, "die_with_agent", lambda: None)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        rank.run_rank(dict_cfg)
    assert exit_info.value.code == rank.EXIT_PREFLIGHT
    _refusal_named(capsys.readouterr().err)


def test_the_field_recipe_is_qwen3_8b_with_dpace_sliding_windows_and_muon(tmp_path):
    target = _stand_in_target(tmp_path, TARGET_LAYERS["field-recipe"])
    cfg = to_dataclass(compose_config(["experiment=field-recipe", f"model.target_path={target}", *_data()]))
    validate(cfg, world_size=8)
    paper = to_dataclass(compose_config(["experiment=qwen3-8b", f"model.target_path={target}", *_data()]))
    assert (cfg.train.position_weights, cfg.train.dpace_alpha) == ("dpace", 0.5)
    assert (cfg.optim.name, cfg.optim.muon_adjust_lr) == ("muon", "match_rms_adamw")
    for key in ("draft_layers", "block_size", "target_layer_ids"):
        assert getattr(cfg.model, key) == getattr(paper.model, key), key
    drafter = build_drafter(cfg).config  # what the export writes to config.json
    assert drafter.layer_types == ["sliding_attention"] * cfg.model.draft_layers
    assert drafter.sliding_window == 2048 and drafter.use_sliding_window
