"""Tiny random-weight targets of every family users train drafters for, as stock HF directories.

Each is built with transformers' own config and model classes, saved with `save_pretrained`
beside the stock Qwen tokenizer (tests/stock_qwen3.py: the vocabulary fits every family's
embedding, vocab_size 151936, and leaves room for the added mask token 151669), and cached in
$DFLASH_MP_CACHE under a digest of this file. Four layers each; `LAYER_KINDS` says what each
layer is, so tests can pick ids that hit a linear-attention, a sliding and the last layer.

    python -m tests.target_families   # build (or find) them all and print their paths
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_mp.embedded import build_once, cache_dir
from tests.stock_qwen3 import FIRST_ADDED_ID, QWEN3_VOCAB_SIZE, ensure_stock_target

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Shared by every family: 4 layers of width 32, 4 query and 2 KV heads of 8.
COMMON: dict[str, Any] = dict(
    vocab_size=QWEN3_VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=512,
    bos_token_id=FIRST_ADDED_ID,
    eos_token_id=FIRST_ADDED_ID + 2,
    pad_token_id=FIRST_ADDED_ID,
    tie_word_embeddings=False,
)
HYBRID = ["linear_attention"] * 3 + ["full_attention"]
ALTERNATING = ["sliding_attention", "full_attention"] * 2
LINEAR_ATTENTION: dict[str, Any] = dict(
    layer_types=HYBRID,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    # Qwen3.5 / Qwen3-Next rotate a quarter of each head (and the drafter must not: docs/TARGETS.md).
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)
SMALL_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@dataclass(frozen=True)
class Family:
    """One target family: transformers' config class, the class that saves it, its config fields."""

    config_class: str
    model_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    text_config_class: str | None = None  # a multimodal wrapper's text config (the fields go there)
    wrapper_fields: dict[str, Any] = field(default_factory=dict)
    kinds: tuple[str, ...] = ()  # what each layer is, where `layer_types` does not say it


_QWEN35_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**SMALL_MOE, decoder_sparse_step=1)),
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR_ATTENTION),
    "qwen3_5_vl": Family(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        LINEAR_ATTENTION,
        text_config_class="Qwen3_5TextConfig",
        wrapper_fields=dict(vision_config=_QWEN35_VISION),
    ),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(**LINEAR_ATTENTION, **SMALL_MOE, shared_expert_intermediate_size=16),
    ),
    "qwen3_5_moe_vl": Family(
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(**LINEAR_ATTENTION, **SMALL_MOE, shared_expert_intermediate_size=16),
        text_config_class="Qwen3_5MoeTextConfig",
        wrapper_fields=dict(vision_config=_QWEN35_VISION),
    ),
    "qwen3_next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(**LINEAR_ATTENTION, **SMALL_MOE, shared_expert_intermediate_size=16, decoder_sparse_step=1),
    ),
    "gpt_oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=ALTERNATING,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "gemma3": Family(
        # transformers 5 nests rope_parameters per layer type (its default).
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(layer_types=ALTERNATING, sliding_window=8, query_pre_attn_scalar=8, tie_word_embeddings=True),
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        ),
    ),
    "glm4_moe": Family(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        ),
    ),
    # Families whose structure the trainer finds from the model rather than by name (issue 50).
    "llama4": Family(
        # get_decoder() is the CausalLM itself; MoE layers (1, 3) beside dense ones of
        # intermediate_size_mlp; chunked attention on RoPE layers, no RoPE on the last.
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=96,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 1, 0],
            attention_chunk_size=8,
        ),
        kinds=("chunked_attention",) * 3 + ("full_attention",),
    ),
    "nemotron_h": Family(
        # No num_hidden_layers (the count is layers_block_type's), the embedding stored as
        # backbone.embeddings.weight, layer_norm_epsilon; Mamba-2 mixers run one row per document.
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            num_hidden_layers=None,
            layers_block_type=["mamba", "mlp", "attention", "attention"],
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            mamba_d_conv=4,
            expand=1,
            layer_norm_epsilon=1e-4,
        ),
        kinds=("mamba", "mlp", "full_attention", "full_attention"),
    ),
    "cohere": Family(
        # Logits multiplied by logit_scale; the norm epsilon is layer_norm_eps.
        "CohereConfig",
        "CohereForCausalLM",
        dict(logit_scale=0.25, layer_norm_eps=1e-4),
    ),
    "ernie4_5_moe": Family(
        # The expert count is moe_num_experts (transformers' alias: num_experts).
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
    ),
    "minimax_m2": Family(
        # intermediate_size is the experts' width (half the hidden size); half the head rotates.
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        ),
    ),
}
# Families the preflight refuses, with what the refusal says.
REFUSED_FAMILIES: dict[str, tuple[Family, str]] = {
    "phi4_mini": (
        # longrope's factors are one per frequency of a 0.75 rotation, which no drafter rotating its
        # whole head can use (docs/TARGETS.md).
        Family(
            "Phi3Config",
            "Phi3ForCausalLM",
            dict(
                partial_rotary_factor=0.75,
                original_max_position_embeddings=128,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10_000.0,
                    "short_factor": [1.0, 1.5, 2.0],
                    "long_factor": [2.0, 3.0, 4.0],
                },
            ),
        ),
        "long_factor and short_factor of 3 entries, one per frequency of its partial rotation",
    ),
}
# What each of the 4 layers is, per family (default: full attention).
LAYER_KINDS: dict[str, list[str]] = {
    name: list(family.kinds or family.fields.get("layer_types", ["full_attention"] * 4))
    for name, family in FAMILIES.items()
}
SEED = 11


def family_config(name: str) -> Any:
    """The family's transformers config (the wrapper's, for a multimodal layout)."""
    import transformers

    family = _family(name)
    fields = {**COMMON, **family.fields, "dtype": "bfloat16"}
    fields = {key: value for key, value in fields.items() if value is not None}
    if family.text_config_class is None:
        return getattr(transformers, family.config_class)(**fields)
    text_config = getattr(transformers, family.text_config_class)(**fields)
    return getattr(transformers, family.config_class)(
        text_config=text_config.to_dict(), tie_word_embeddings=False, **family.wrapper_fields
    )


def _family(name: str) -> Family:
    return FAMILIES[name] if name in FAMILIES else REFUSED_FAMILIES[name][0]


def build_family_target(name: str, out_dir: Path) -> None:
    import torch
    import transformers

    stock = ensure_stock_target()
    for file in TOKENIZER_FILES:
        shutil.copyfile(stock / file, out_dir / file)
    config = family_config(name)
    torch.manual_seed(SEED)
    model = getattr(transformers, _family(name).model_class)(config)
    model.to(torch.bfloat16).save_pretrained(out_dir)


def family_target_dir(name: str) -> Path:
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return cache_dir() / f"family-{name}-{digest[:10]}"


def ensure_family_target(name: str) -> Path:
    """The cached target of family `name`, built on first use (safe for parallel processes)."""
    return build_once(family_target_dir(name), lambda out: build_family_target(name, out))


if __name__ == "__main__":
    for family_name in [*FAMILIES, *REFUSED_FAMILIES]:
        print(family_name, ensure_family_target(family_name))
