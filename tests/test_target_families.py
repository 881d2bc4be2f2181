"""Every target family users train drafters for (tests/target_families.py builds a tiny one each).

In process: the drafter's config follows what the reference and the serving engines build for the
family (docs/TARGETS.md), the preflight refuses a target it cannot follow, and the target stage's
features equal HF's `output_hidden_states`. Under torchrun (slow): each family trains, exports,
and the export loads strictly in the reference `dflash` package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from dflash.model import DFlashDraftModel

from dflash_mp.config.schema import ConfigError
from dflash_mp.config.validation import validate
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from tests.conftest import NO_PLOTS, REPO, job_env, read_metrics
from tests.drafters import embedded_config
from tests.target_families import FAMILIES, LAYER_KINDS, ensure_family_target, family_config

# A chat turn in the stock Qwen vocabulary, twice: 24 tokens, three sliding windows of 8.
TOKENS = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198] * 2])
LAST = 3


def _drafter_config(name: str, **kwargs) -> transformers.Qwen3Config:
    return build_drafter_config(family_config(name), draft_layers=1, target_layer_ids=[1, LAST],
                                block_size=4, mask_token_id=151669, **kwargs)  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_the_drafter_config_is_one_every_reader_builds_alike(name: str) -> None:
    """Full-width RoPE from the target's full-attention layers, SiLU, plain heads; the reference
    and our drafter build it, and their rotary tables are the same."""
    text = family_config(name).get_text_config().to_dict()
    config = _drafter_config(name)
    rope = config.rope_parameters
    target_rope = text["rope_parameters"]
    target_rope = target_rope.get("full_attention", target_rope)
    assert rope["rope_theta"] == target_rope["rope_theta"]
    assert rope["rope_type"] == target_rope.get("rope_type", "default")
    assert not {"partial_rotary_factor", "mrope_section", "full_attention"} & set(rope)
    assert config.hidden_act == "silu"
    assert config.hidden_size == text["hidden_size"]
    assert config.intermediate_size == text.get("intermediate_size", 3 * text["hidden_size"])
    ours, reference = DFlashDrafter(config), DFlashDraftModel(config)
    assert ours.rotary_emb.inv_freq.numel() * 2 == config.head_dim  # the whole head rotates
    torch.testing.assert_close(ours.rotary_emb.inv_freq, reference.rotary_emb.inv_freq)
    assert ours.state_dict().keys() == reference.state_dict().keys() - {"rotary_emb.inv_freq"}


def test_gemma3_nested_rope_gives_the_full_attention_entry() -> None:
    """transformers 5 saves Gemma 3's rope_parameters per layer type; copied as it was, the
    drafter's rotary raised KeyError: 'rope_type' 20 s into a job."""
    assert set(family_config("gemma3").rope_parameters) == {"full_attention", "sliding_attention"}
    config = _drafter_config("gemma3")
    full = family_config("gemma3").rope_parameters["full_attention"]
    assert config.rope_parameters == full
    DFlashDrafter(config)


def test_gemma3_gelu_target_gets_a_silu_drafter() -> None:
    """Gemma's MLP activation is `hidden_activation` (GELU tanh); SGLang and vLLM build DFlash
    MLPs with SiLU only, so the drafter's own MLP is SiLU."""
    assert family_config("gemma3").hidden_activation == "gelu_pytorch_tanh"
    assert _drafter_config("gemma3").hidden_act == "silu"


def test_an_mla_target_gives_plain_heads_of_its_value_width() -> None:
    """DeepSeek-V3's head_dim is its RoPE slice (qk_rope_head_dim): the drafter got 64-wide
    heads on a 7168-wide layer. It gets v_head_dim-wide heads filling hidden_size instead."""
    target = transformers.DeepseekV3Config()  # the published shape
    assert target.head_dim == target.qk_rope_head_dim == 64
    config = build_drafter_config(target, 5, [1, 15, 29, 43, 57], 16, 128815)
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (128, 56, 8)
    tiny = _drafter_config("deepseek_v3")
    assert (tiny.head_dim, tiny.num_attention_heads, tiny.num_key_value_heads) == (16, 2, 2)


@pytest.mark.parametrize("name", ["qwen3_5", "glm4_moe"])
def test_partial_rotary_is_not_exported(name: str, tmp_path: Path) -> None:
    """vLLM rotates head_dim * partial_rotary_factor dims when the drafter's rope_parameters carry
    it, SGLang, the reference and our training the whole head: the export leaves it out."""
    from dflash_mp.export.hf import export_drafter

    assert family_config(name).get_text_config().rope_parameters["partial_rotary_factor"] < 1
    export_drafter(DFlashDrafter(_drafter_config(name)), tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "partial_rotary_factor" not in json.dumps(exported)


def _target_with(tmp_path: Path, name: str, **text_fields) -> Path:
    """Family `name`'s config.json with text-config fields replaced, alone in a directory: the
    refusals come from the config, and with no tokenizer files the preflight skips its two reads
    of the 151k-token tokenizer (~2 CPU-s a test)."""
    path = tmp_path / name
    path.mkdir()
    config = json.loads((ensure_family_target(name) / "config.json").read_text())
    config.update(text_fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_parameters": {"rope_type": "no-such-rope", "rope_theta": 1e4}}, "no-such-rope"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            "without a full_attention entry",
        ),
        ({"kv_lora_rank": 16, "v_head_dim": 12}, "not a multiple of its v_head_dim 12"),
    ],
)
def test_the_preflight_refuses_a_target_the_drafter_cannot_follow(
    tmp_path: Path, fields: dict, message: str
) -> None:
    target = _target_with(tmp_path, "gemma3", **fields)
    with pytest.raises(ConfigError, match=rf"model.target_path='{target}'.*{message}"):
        validate(custom_recipe(target))


def custom_recipe(target: Path, *overrides: str):
    """experiment=custom (a real target's recipe), shrunk to the tiny family targets."""
    from dflash_mp.embedded import embedded_path

    return embedded_config(
        "experiment=custom",
        f"model.target_path={target}",
        "model.draft_layers=2",
        "model.block_size=8",
        "model.target_layer_ids=[1,3]",
        "topology=2t1d",
        f"data.train_files=[{embedded_path('data/train.jsonl')}]",
        "data.max_length=128",  # the tiny targets' context is 512
        "data.num_anchors=16",
        "eval.every=0",
        *overrides,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_passes_the_preflight(name: str) -> None:
    validate(custom_recipe(ensure_family_target(name)))


@pytest.mark.parametrize("name", FAMILIES)
def test_features_equal_hf_hidden_states(name: str) -> None:
    """Ids 0, 1 and 3: a sliding (gpt-oss, Gemma 3) or linear-attention layer (Qwen3.5, Next),
    another, and the last, which HF reports after the final norm; HF loads the directory with the
    class that saved it (ConditionalGeneration for the hub's multimodal layout)."""
    path = ensure_family_target(name)
    ids = [0, 1, LAST]
    assert {LAYER_KINDS[name][i] for i in ids[:2]} & {"sliding_attention", "linear_attention"} or (
        LAYER_KINDS[name] == ["full_attention"] * 4
    )
    extractor = TargetFeatureExtractor(path, ids, torch.float32, "cpu")
    model_class = getattr(transformers, FAMILIES[name].model_class)
    hf = model_class.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden_states = hf(input_ids=TOKENS, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[i + 1] for i in ids], dim=-1)
    torch.testing.assert_close(extractor(TOKENS), expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def family_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two steps of one colocated rank for every family, as the points of one Hydra sweep (`-m`):
    each point is its own torchrun job, started by one launcher process (about half the CPU of a
    plain torchrun job per family). A failed point leaves the others running; each test reads its own."""
    from dflash_mp.embedded import embedded_path

    tmp_path = tmp_path_factory.mktemp("families")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(embedded_path("data/train.jsonl").read_text().splitlines(True)[:16]))
    targets = ",".join(str(ensure_family_target(name)) for name in FAMILIES)
    overrides = [
        "experiment=custom",  # a real target's recipe, shrunk below
        "model.draft_layers=2",
        f"model.target_path={targets}",
        "model.target_layer_ids=[1,3]",
        "model.block_size=4",
        "topology=colocated",
        "topology.drafters=1",  # one rank (on CPU the launcher needs the count)
        "train.max_steps=2",
        f"data.train_files=[{train}]",
        "data.max_length=64",
        "data.num_anchors=4",
        "eval.every=0",
        NO_PLOTS,
    ]
    sweep = tmp_path / "sweep"
    job = subprocess.run(
        [sys.executable, "-m", "dflash_mp.train", "-m", *overrides],
        cwd=REPO, env=job_env() | {"DFLASH_SWEEP_DIR": str(sweep)}, capture_output=True, text=True,
        timeout=120 * len(FAMILIES),
    )  # fmt: skip
    return sweep, job


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_trains_exports_and_loads_in_the_reference(name: str, family_sweep) -> None:
    sweep, job = family_sweep
    point = json.loads((sweep / "points" / f"{list(FAMILIES).index(name)}.json").read_text())
    run = Path(point["run_dir"])  # <n>_model.target_path-<the family's target>, under the sweep
    assert f"model.target_path={ensure_family_target(name)}" in point["overrides"]
    log = (run / "logs" / "job.log").read_text() if (run / "logs" / "job.log").exists() else ""
    assert point["outcome"] == "succeeded", log[-3000:] + job.stdout[-2000:] + job.stderr[-2000:]
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    drafter, info = DFlashDraftModel.from_pretrained(str(run / "export"), output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (4, 151669, [1, 3])
