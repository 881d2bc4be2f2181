"""Every target family users train drafters for (tests/target_families.py builds a tiny one each).

In process: the drafter's config follows what the reference and the serving engines build for the
family (docs/TARGETS.md), the preflight refuses a target it cannot follow, and the target stage's
features equal HF's `output_hidden_states`. Under torchrun (slow): each family trains, exports,
and the export loads strictly in the reference `dflash` package.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from dflash.model import DFlashDraftModel
from safetensors.torch import load_file, save_file

from dflash_mp.config.schema import ConfigError, read_target_config
from dflash_mp.config.validation import validate
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.models.target_kernels import describe_kernels
from dflash_mp.models.target_structure import (
    CheckpointTensors,
    checkpoint_tensors,
    locate_decoder,
    meta_model,
)
from tests.conftest import read_metrics, run_tiny_colocated_sweep
from tests.drafters import embedded_config
from tests.target_families import (
    FAMILIES,
    LAYER_KINDS,
    REFUSED_FAMILIES,
    ensure_family_target,
    family_config,
)

# Two steps of training cost ~6 s a family: the families added for issue 50 that differ only in
# config fields the in-process tests check (Cohere, ERNIE, MiniMax-M2) are not swept; Llama 4
# (decoder below the CausalLM, own experts, chunked attention) and NemotronH (renamed embedding, no
# layer count, Mamba) are.
SWEPT = [name for name in FAMILIES if name not in ("cohere", "ernie4_5_moe", "minimax_m2")]
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
    # NemotronH's attention has no RoPE: the drafter's is the default one.
    target_rope = text.get("rope_parameters") or {"rope_theta": 10_000.0}
    target_rope = target_rope.get("full_attention", target_rope)
    assert rope["rope_theta"] == target_rope["rope_theta"]
    assert rope["rope_type"] == target_rope.get("rope_type", "default")
    assert not {"partial_rotary_factor", "mrope_section", "full_attention"} & set(rope)
    assert config.hidden_act == "silu"
    assert config.hidden_size == text["hidden_size"]
    dense = text.get("intermediate_size_mlp", text.get("intermediate_size", 0))  # Llama 4's dense width
    assert config.intermediate_size == (dense if dense >= text["hidden_size"] else 3 * text["hidden_size"])
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


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("llama4", "intermediate_size", 96),  # intermediate_size_mlp, not the experts' 64
        ("minimax_m2", "intermediate_size", 96),  # 3 x hidden, not the experts' 16
        ("cohere", "rms_norm_eps", 1e-4),  # layer_norm_eps
        ("nemotron_h", "rms_norm_eps", 1e-4),  # layer_norm_epsilon
        ("nemotron_h", "num_target_layers", 4),  # from layers_block_type
    ],
)
def test_the_drafter_takes_what_a_family_names_its_own_way(name: str, field: str, value) -> None:
    """Each of these fell back to a default (1e-6, the experts' width) or raised KeyError."""
    assert getattr(_drafter_config(name), field) == value
    target = read_target_config(str(ensure_family_target(name)))
    assert getattr(build_drafter_config(target, 1, [1, LAST], 4, 151669), field) == value


def test_cohere_logit_scale_is_the_drafters_output_multiplier() -> None:
    """Cohere multiplies its logits by logit_scale; the drafter, sharing its head, must too."""
    assert _drafter_config("cohere").dflash_config["output_multiplier"] == 0.25


def test_the_preflight_refuses_partial_longrope_in_one_line(tmp_path: Path) -> None:
    """Phi-4-mini's longrope factors are one per frequency of its 0.75 rotation: dropped, the
    factors no longer matched the head and transformers raised a RuntimeError in doctor and in
    every rank. No reader builds a whole-head drafter RoPE from them, so the preflight refuses."""
    ((family, reason),) = REFUSED_FAMILIES.values()
    target = ensure_family_target("phi4_mini")
    with pytest.raises(ConfigError) as refused:
        validate(custom_recipe(target))
    (line,) = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert f"model.target_path='{target}'" in line and reason in line, line


@pytest.mark.parametrize("name", ["ernie4_5_moe", "minimax_m2", "llama4"])
def test_moe_families_are_seen_as_moe(name: str) -> None:
    """ERNIE's expert count is moe_num_experts, which transformers aliases as num_experts; Llama 4's
    experts refuse another implementation and keep their own batched matmuls (was: a ValueError)."""
    extractor = TargetFeatureExtractor(ensure_family_target(name), [1, LAST], torch.float32, "cpu")
    kernels = extractor.use_fast_kernels()
    assert kernels["experts"] == ("Llama4TextModel's own" if name == "llama4" else "dflash_grouped_mm")
    assert "experts" in describe_kernels(family_config(name).get_text_config(), on_gpu=True)


def test_the_decoder_and_the_checkpoint_names_come_from_the_model(tmp_path: Path) -> None:
    """Llama 4's decoder sits at .model while get_decoder() is the CausalLM; NemotronH stores its
    embedding as backbone.embeddings.weight (transformers renames it to model.embeddings.weight)."""
    assert locate_decoder(meta_model(ensure_family_target("llama4")), 4) == ("model", "layers")
    nemotron = ensure_family_target("nemotron_h")
    assert checkpoint_tensors(nemotron) == CheckpointTensors("backbone.embeddings.weight", "lm_head.weight")
    assert checkpoint_tensors(ensure_family_target("gemma3")) == CheckpointTensors(
        "model.embed_tokens.weight",
        None,  # tied
    )
    tensors = load_file(nemotron / "model.safetensors")
    renamed = _copy_with(tmp_path / "renamed", nemotron, tensors, {"backbone.embeddings.weight": "emb.w"})
    assert checkpoint_tensors(renamed).embedding == "emb.w"  # the one unclaimed tensor of its shape
    missing = _copy_with(tmp_path / "missing", nemotron, tensors, {"backbone.embeddings.weight": None})
    with pytest.raises(ConfigError) as refused:
        validate(custom_recipe(missing))
    (line,) = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert "hold no input embedding (the model's model.embeddings.weight, [151936, 32])" in line, line


def _copy_with(path: Path, source: Path, tensors: dict, renames: dict) -> Path:
    """`source` with its tensors renamed (to None: left out)."""
    shutil.copytree(source, path)
    kept = {renames.get(k, k): v for k, v in tensors.items() if renames.get(k, k) is not None}
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    return path


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
    special = {"sliding_attention", "linear_attention", "chunked_attention", "mamba"}
    assert {LAYER_KINDS[name][i] for i in ids[:2]} & special or LAYER_KINDS[name] == ["full_attention"] * 4
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
    targets = ",".join(str(ensure_family_target(name)) for name in SWEPT)
    return run_tiny_colocated_sweep(
        tmp_path_factory.mktemp("families"),
        f"model.target_path={targets}",
        "model.target_layer_ids=[1,3]",
        timeout=120 * len(SWEPT),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEPT)
def test_a_family_trains_exports_and_loads_in_the_reference(name: str, family_sweep) -> None:
    sweep, job = family_sweep
    point = json.loads((sweep / "points" / f"{SWEPT.index(name)}.json").read_text())
    run = Path(point["run_dir"])  # <n>_model.target_path-<the family's target>, under the sweep
    assert f"model.target_path={ensure_family_target(name)}" in point["overrides"]
    log = (run / "logs" / "job.log").read_text() if (run / "logs" / "job.log").exists() else ""
    assert point["outcome"] == "succeeded", log[-3000:] + job.stdout[-2000:] + job.stderr[-2000:]
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    drafter, info = DFlashDraftModel.from_pretrained(str(run / "export"), output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (4, 151669, [1, 3])


class _PatternConfig(transformers.LlamaConfig):
    """Layer types derived, read-only, from a pattern of its own rather than from the layer count."""

    model_type = "dflash_mp_test_pattern"

    def __init__(self, pattern: str = "ffffff", **kwargs) -> None:
        self.pattern = pattern
        super().__init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" for _ in self.pattern]


class _PatternForCausalLM(transformers.LlamaForCausalLM):
    config_class = _PatternConfig


def test_the_preflight_refuses_a_target_that_cannot_be_cut_to_the_layers_read(tmp_path: Path) -> None:
    """The target ranks build the target cut after its last layer read: a config that cannot be cut
    is refused by the preflight, naming it, rather than by a rank after it."""
    transformers.AutoConfig.register(_PatternConfig.model_type, _PatternConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(_PatternConfig, _PatternForCausalLM, exist_ok=True)
    target = _target_with(tmp_path, "llama3", model_type=_PatternConfig.model_type, num_hidden_layers=6)
    with pytest.raises(ConfigError, match=rf"model.target_path='{target}': cut to the 4 layers .* _PatternConfig"):
        validate(custom_recipe(target))
