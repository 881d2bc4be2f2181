"""What each family of the matrix (tests/target_families.py) is, read from its config alone: the
kernels the doctor names agree with what `use_fast_kernels` applies to the built decoder, every MoE
naming is seen as MoE, and the plan counts the active experts. No weights: configs and meta models."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash_mp.models import linear_attention, target_kernels
from dflash_mp.models.moe_experts import EXPERTS_IMPLEMENTATION
from dflash_mp.models.target_fields import with_standard_names
from dflash_mp.models.target_structure import find_decoder
from dflash_mp.plan.costs import is_dense, shape_from_hf_config, target_flops, target_params
from tests.target_families import FAMILIES, family_config

MOE = {
    "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next", "gpt_oss", "deepseek_v3", "glm4_moe",
    "llama4", "ernie4_5_moe", "minimax_m2",
}  # fmt: skip
LINEAR_ATTENTION = {"qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next"}
STATE_SPACE = {"nemotron_h"}
OWN_EXPERTS = {"llama4": "Llama4TextModel's own"}  # batched matmuls that take no other implementation


def _text_config(name: str):
    return family_config(name).get_text_config()


def _meta_decoder(name: str) -> torch.nn.Module:
    """The decoder the target ranks build for `name`, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[name].model_class)(family_config(name))
    return find_decoder(model, 4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_doctor_names_what_use_fast_kernels_applies(name: str) -> None:
    """describe_kernels (the doctor, before loading) and use_fast_kernels (the loaded decoder) come
    from one decision, kernel_kinds: the same kinds, the same attention and experts."""
    config = _text_config(name)
    groups = {"experts": MOE, "linear_attention": LINEAR_ATTENTION, "state_space": STATE_SPACE}
    kinds = {"attention"} | {kind for kind, names in groups.items() if name in names}
    for packed in (False, True):
        described = target_kernels.describe_kernels(config, on_gpu=True, packed_rows=packed)
        assert set(described) == kinds, (name, described)
        if name in MOE:
            assert described["experts"] == OWN_EXPERTS.get(name, EXPERTS_IMPLEMENTATION)
        decoder = _meta_decoder(name)
        # What use_fast_kernels decides for this decoder on a GPU (fla's forward where it applies).
        fast = linear_attention.fast_path_model(config) and name in LINEAR_ATTENTION
        assert described == target_kernels.kernel_kinds(decoder.config, type(decoder), True, packed, fast)
        applied = target_kernels.use_fast_kernels(decoder, packed_rows=packed)  # meta: CPU's labels
        assert set(applied) == kinds
        assert (applied["attention"], applied.get("experts")) == (
            described["attention"],
            described.get("experts"),
        )
        if name in MOE and name not in OWN_EXPERTS:
            assert decoder.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert ("packed rows: one row per document" in described.get("state_space", "")) == (name in STATE_SPACE)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_moe_naming_is_moe(name: str) -> None:
    """num_experts, num_local_experts, n_routed_experts, ERNIE's moe_num_experts; NemotronH's class
    default of 8 experts on a pattern without MoE layers is none. Config object and config.json alike."""
    config = _text_config(name)
    assert target_kernels.is_moe(config) == (name in MOE)
    assert target_kernels.is_moe(config.to_dict()) == (name in MOE)
    assert is_dense(config.to_dict()) != (name in MOE | LINEAR_ATTENTION | STATE_SPACE | {"deepseek_v3"})


def _attention(c) -> int:
    return 2 * c.hidden_size * c.head_dim * (c.num_attention_heads + c.num_key_value_heads)


def _gated_mlp(hidden: int, width: int) -> int:
    return 3 * hidden * width


def _ernie(c) -> list[tuple[int, int]]:
    """(all, active) per layer: dense layers before moe_layer_start_index; an MoE layer's router,
    its score-correction bias, moe_num_experts experts of moe_intermediate_size (moe_k run), shared ones."""
    h, e, k, width = c.hidden_size, c.moe_num_experts, c.moe_k, c.moe_intermediate_size
    base = _attention(c) + 2 * h
    shared = _gated_mlp(h, width * c.moe_num_shared_experts) + e * h + e
    experts = e * _gated_mlp(h, width)
    dense = base + _gated_mlp(h, c.intermediate_size)
    moe = (base + shared + experts, base + shared + experts * k // e)
    return [(dense, dense) if i < c.moe_layer_start_index else moe for i in range(c.num_hidden_layers)]


def _minimax_m2(c) -> list[tuple[int, int]]:
    """Every layer MoE: num_local_experts experts of intermediate_size, q/k norms over all heads."""
    h, e, k = c.hidden_size, c.num_local_experts, c.num_experts_per_tok
    base = _attention(c) + 2 * h + c.head_dim * (c.num_attention_heads + c.num_key_value_heads) + e * h
    experts = e * _gated_mlp(h, c.intermediate_size)
    return [(base + experts, base + experts * k // e)] * c.num_hidden_layers


def _llama4(c) -> list[tuple[int, int]]:
    """Every interleave_moe_layer_step-th layer MoE (experts and a shared expert of
    intermediate_size), the others dense of intermediate_size_mlp."""
    h, e, k = c.hidden_size, c.num_local_experts, c.num_experts_per_tok
    base = _attention(c) + 2 * h
    dense = base + _gated_mlp(h, c.intermediate_size_mlp)
    shared = _gated_mlp(h, c.intermediate_size) + e * h
    experts = e * _gated_mlp(h, c.intermediate_size)
    moe = (base + shared + experts, base + shared + experts * k // e)
    step = c.interleave_moe_layer_step
    return [moe if (i + 1) % step == 0 else (dense, dense) for i in range(c.num_hidden_layers)]


@pytest.mark.parametrize(
    "name, layers", [("ernie4_5_moe", _ernie), ("minimax_m2", _minimax_m2), ("llama4", _llama4)]
)
def test_the_plan_counts_the_active_experts(name: str, layers) -> None:
    """Parameters and per-token FLOPs of the plan, from the config.json as the plan reads it."""
    config = _text_config(name)
    expected = layers(config)
    every, active = sum(a for a, _ in expected), sum(b for _, b in expected)
    assert active < every  # top-k of the experts run
    shape = shape_from_hf_config(with_standard_names(config.to_dict()), name)
    n = config.num_hidden_layers
    assert (shape.layer_params_all, shape.layer_params_active) == (every // n, active // n)
    embeddings = 2 * config.vocab_size * config.hidden_size  # untied
    assert target_params(shape) == embeddings + n * (every // n) + config.hidden_size
    attention = 2 * 1 * shape.heads * shape.head_dim * n
    assert target_flops(shape, n, 1) == 2 * n * (active // n) + attention


@pytest.mark.parametrize("name", ["llama4", "nemotron_h"])
def test_the_doctor_line(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4: its own experts, not grouped GEMM. NemotronH: Mamba-2 mixers (not gated-deltanet
    linear attention, not experts), their kernels, and one row per document for packed rows."""
    from dflash_mp.launch.doctor import check_target_kernels

    _text_config(name).save_pretrained(tmp_path)
    real_find_spec = target_kernels.importlib.util.find_spec
    monkeypatch.setattr(
        target_kernels.importlib.util,
        "find_spec",
        lambda module: None if module == "mamba_ssm" else real_find_spec(module),
    )
    message = check_target_kernels(str(tmp_path), on_gpu=True, packed_rows=True).message
    if name == "llama4":
        assert "experts: Llama4TextModel's own" in message and "grouped" not in message, message
        assert message.startswith("attention: sdpa")  # chunked attention keeps SDPA for packed rows
        return
    assert message.startswith("warning: "), message
    assert "state_space: Mamba-2 on transformers' torch fallback (install mamba-ssm" in message, message
    assert "packed rows: one row per document" in message
    assert "experts" not in message and "linear_attention" not in message
    monkeypatch.setattr(target_kernels.importlib.util, "find_spec", lambda module: object())
    message = check_target_kernels(str(tmp_path), on_gpu=True).message
    assert "state_space: Mamba-2 on mamba-ssm and causal-conv1d CUDA kernels" in message, message
    assert "one row per document" not in message and not message.startswith("warning")
