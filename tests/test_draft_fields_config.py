"""The draft-config fields in the export and the run config: config.json keys, validation, what a target's
own scaling gives, and a trained export with every field decoded by the reference (the fields' math:
test_draft_fields.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from dflash import model as reference_model
from dflash.model import DFlash2DraftModel, build_target_layer_ids

from dflash_mp.config.schema import ConfigError
from dflash_mp.config.validation import validate
from dflash_mp.evaluation.acceptance import stop_token_ids
from dflash_mp.evaluation.decoding import speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from dflash_mp.export.hf import export_drafter, load_exported_drafter
from dflash_mp.models.drafter_config import build_drafter_config
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens
from tests.field_drafters import BLOCK, SCALING, TARGET, VOCAB, fields_drafter

# ----------------------------------------------------------------------------- config and export


def test_default_export_is_unchanged_and_non_defaults_reach_config_json(tmp_path) -> None:
    plain = json.loads(
        (export_drafter(fields_drafter("dflash", None), tmp_path / "a") / "config.json").read_text()
    )
    for key in SCALING:
        assert key not in plain and key not in plain["dflash_config"]
    assert plain["layer_types"] == ["full_attention"] * 3 and plain["sliding_window"] is None
    assert plain["is_causal"] is False
    fields = json.loads(
        (export_drafter(fields_drafter("dflash2", 7, SCALING), tmp_path / "b") / "config.json").read_text()
    )
    assert {key: fields["dflash_config"][key] for key in SCALING} == SCALING
    assert fields["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (fields["sliding_window"], fields["use_sliding_window"], fields["is_causal"]) == (7, True, False)
    loaded = load_exported_drafter(tmp_path / "b")
    assert (loaded.layer_types, loaded.sliding_window) == (fields["layer_types"], 7)
    assert (loaded.input_embedding_scale, loaded.output_multiplier, loaded.final_logit_softcapping) == (
        2.5,
        0.6,
        1.5,
    )


def test_drafter_config_rejects_bad_layer_types_and_windows() -> None:
    layer_ids = build_target_layer_ids(TARGET.num_hidden_layers, 2)
    with pytest.raises(ValueError, match="layer_types"):
        build_drafter_config(TARGET, 2, layer_ids, BLOCK, 0, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="sliding_window"):
        build_drafter_config(TARGET, 1, layer_ids, BLOCK, 0, layer_types=["sliding_attention"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.layer_types=[sliding_attention]"], "model.layer_types"),
        (["model.layer_types=[sliding_attention,full_attention]"], "model.sliding_window"),
        (["model.sliding_window=0"], "model.sliding_window"),
        (["model.output_multiplier=0"], "model.output_multiplier"),
        (["model.input_embedding_scale=-1"], "model.input_embedding_scale"),
        (["model.final_logit_softcapping=-3"], "model.final_logit_softcapping"),
    ],
)
def test_config_validation_names_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(embedded_config(*overrides))


# ----------------------------------------------------------------------------- trained, end to end

FIELD_OVERRIDES = (
    "data.num_anchors=32",
    "model.arch=dflash2",
    "model.selector_rank=32",
    "model.layer_types=[sliding_attention,full_attention]",
    "model.sliding_window=8",
    "model.input_embedding_scale=2.0",
    "model.output_multiplier=0.8",
    "model.final_logit_softcapping=20.0",
)


@pytest.mark.slow
def test_reference_decoding_of_a_trained_export_with_every_field_matches_ours(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trained with a window shorter than the prompts and every scaling field, exported, decoded by
    the reference's `dflash_generate`: the same tokens and acceptance lengths as our decoding."""
    monkeypatch.setattr(reference_model, "_cuda_time", time.perf_counter)  # a CPU run
    cfg = embedded_config(*FIELD_OVERRIDES)
    validate(cfg)
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)[:3]
    assert min(len(prompt.input_ids) for prompt in prompts) > 8
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], 40, steps=150)
    export = export_drafter(trainer.drafter, tmp_path / "export")
    fields = json.loads((export / "config.json").read_text())
    assert fields["dflash_config"]["final_logit_softcapping"] == 20.0 and fields["sliding_window"] == 8
    draft_model = DFlash2DraftModel.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_exported_drafter(export).float().eval()
    stops = stop_token_ids(tokenizer, target)
    longest = []
    for prompt in prompts:
        expected = reference_model.dflash_generate(
            draft_model, target, torch.tensor([prompt.input_ids]), 40, stops, return_stats=True
        )
        got = speculative_generate(ours, target, prompt.input_ids, 40, stops)
        assert got.new_tokens == expected.output_ids[0, len(prompt.input_ids) :].tolist(), prompt.source
        assert got.acceptance_lengths == expected.acceptance_lengths, prompt.source
        longest.append(max(expected.acceptance_lengths))
    assert max(longest) > 3  # trained: the comparison covered accepted drafts


@pytest.mark.parametrize(
    "target_fields, expected",
    [
        ({}, {}),  # a Qwen3 target scales nothing: the export stays as it was
        (
            {"model_type": "gemma2", "final_logit_softcapping": 30.0},
            {"input_embedding_scale": 8.0, "final_logit_softcapping": 30.0},  # sqrt(64)
        ),
        (
            {"model_type": "granite", "embedding_multiplier": 12.0, "logits_scaling": 8.0},
            {"input_embedding_scale": 12.0, "output_multiplier": 0.125},
        ),
    ],
)
def test_null_scaling_fields_follow_what_the_target_does(target_fields, expected):
    target = TARGET.to_dict() | target_fields
    nulls = dict.fromkeys(SCALING)
    config = build_drafter_config(target, 2, [1, 3], BLOCK, VOCAB - 1, scaling=nulls)
    assert {key: config.dflash_config[key] for key in SCALING if key in config.dflash_config} == expected
    # Set values win over the target's, and a cap of 0 turns the target's cap off.
    chosen = build_drafter_config(
        target, 2, [1, 3], BLOCK, VOCAB - 1, scaling={**SCALING, "final_logit_softcapping": 0.0}
    )
    assert chosen.dflash_config["input_embedding_scale"] == 2.5
    assert "final_logit_softcapping" not in chosen.dflash_config


def test_config_yaml_records_the_scaling_the_run_used(tmp_path):
    import shutil

    from dflash_mp.config.schema import compose_config, run_config, to_dataclass
    from dflash_mp.embedded import target_dir

    target = tmp_path / "gemma-like"  # the embedded target, its config.json saying Gemma 2
    shutil.copytree(target_dir(), target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"model_type": "gemma2"}))
    cfg = to_dataclass(compose_config([f"model.target_path={target}", "model.output_multiplier=0.5"]))
    recorded = run_config(cfg).model
    hidden = config["hidden_size"]
    assert (recorded.input_embedding_scale, recorded.output_multiplier) == (hidden**0.5, 0.5)
    assert recorded.final_logit_softcapping is None
