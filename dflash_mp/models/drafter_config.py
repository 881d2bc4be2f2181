"""The drafter's config: the target's layer shapes plus the DFlash fields, as the reference,
SGLang and vLLM read them (docs/DESIGN.md §3), and the checks a bad one fails."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config

# Target-config keys that fix the shape and numerics of a decoder layer; the drafter copies them.
_LAYER_SHAPE_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "max_position_embeddings",
    "vocab_size",
    "initializer_range",
)
# Both the current (`rope_parameters`) and the legacy spelling, which Qwen3Config converts itself.
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# dflash_config fields of a DFlash 2 drafter (the reference, vLLM and the MLX loader read them there).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Attention kinds of a draft layer (the reference's `layer_types` values).
LAYER_TYPES = ("full_attention", "sliding_attention")
# dflash_config fields for targets that scale embeddings or logits, with the values that change nothing.
SCALING_DEFAULTS: dict[str, float | None] = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
}


def target_scaling(target: dict[str, Any]) -> dict[str, float | None]:
    """The scaling fields as the target itself applies them (for those a config leaves null):
    Gemma multiplies its input embeddings by sqrt(hidden_size) and Granite by its
    embedding_multiplier; Granite divides its logits by logits_scaling; Gemma 2 soft-caps them at
    its final_logit_softcapping. Other targets scale nothing."""
    gemma = str(target.get("model_type", "")).startswith("gemma")
    embedding = target.get("embedding_multiplier") or (float(target["hidden_size"]) ** 0.5 if gemma else 1.0)
    logits_scaling = target.get("logits_scaling")
    return {
        "input_embedding_scale": float(embedding),
        "output_multiplier": 1.0 / float(logits_scaling) if logits_scaling else 1.0,
        "final_logit_softcapping": target.get("final_logit_softcapping") or None,
    }


def drafter_arch(config: PretrainedConfig) -> str:
    """The drafter architecture of `config`: "dflash2" when it carries the DFlash 2 fields, else "dflash"."""
    dflash = getattr(config, "dflash_config", None) or {}
    return "dflash2" if all(key in dflash for key in DFLASH2_FIELDS) else "dflash"


def build_drafter_config(
    target_config: dict[str, Any] | PretrainedConfig,
    draft_layers: int,
    target_layer_ids: list[int],
    block_size: int,
    mask_token_id: int,
    arch: str = "dflash",
    dflash2: dict[str, int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    scaling: dict[str, float | None] | None = None,
) -> Qwen3Config:
    """The drafter's config: the target's layer shapes, `draft_layers` layers and the DFlash fields.

    `arch="dflash2"` adds `dflash2` (conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k) to `dflash_config`. `layer_types` (one per draft layer, null: all full
    attention) and `sliding_window` go to the top level, where the reference reads them;
    `scaling` (keys of SCALING_DEFAULTS; null or absent: what the target does, `target_scaling`)
    goes to `dflash_config`, only the non-default values, so a Qwen3 target's export is unchanged.
    """
    if isinstance(target_config, PretrainedConfig):
        target = target_config.get_text_config().to_dict()
    else:
        target = dict(target_config.get("text_config", target_config))
    num_target_layers = int(target["num_hidden_layers"])
    problems = []
    if draft_layers < 1:
        problems.append(f"draft_layers must be >= 1, got {draft_layers}")
    if not target_layer_ids or any(not 0 <= i < num_target_layers for i in target_layer_ids):
        problems.append(
            f"target_layer_ids {target_layer_ids} must be a non-empty list of target layers "
            f"in [0, {num_target_layers - 1}]"
        )
    if block_size < 2:
        problems.append(f"block_size must be >= 2 (one known token plus masks), got {block_size}")
    if not 0 <= mask_token_id < int(target["vocab_size"]):
        problems.append(
            f"mask_token_id {mask_token_id} is outside the target vocabulary [0, {target['vocab_size']})"
        )
    extra: dict[str, int] = {}
    if arch == "dflash2":
        extra = {key: int((dflash2 or {}).get(key, 0)) for key in DFLASH2_FIELDS}
        if min(extra.values()) < 1:
            problems.append(f"arch dflash2 needs positive {', '.join(DFLASH2_FIELDS)}, got {dflash2}")
        elif int(target["hidden_size"]) % extra["conv_group_size"]:
            problems.append(
                f"conv_group_size {extra['conv_group_size']} must divide hidden_size {target['hidden_size']}"
            )
        elif extra["selector_top_k"] > int(target["vocab_size"]):
            problems.append(
                f"selector_top_k {extra['selector_top_k']} exceeds vocab_size {target['vocab_size']}"
            )
    elif arch != "dflash":
        problems.append(f"arch {arch!r} must be one of {sorted(ARCHITECTURES)}")
    layer_types = list(layer_types) if layer_types else ["full_attention"] * draft_layers
    if len(layer_types) != draft_layers or any(kind not in LAYER_TYPES for kind in layer_types):
        problems.append(
            f"layer_types {layer_types} must name one of {LAYER_TYPES} per draft layer ({draft_layers})"
        )
    sliding = "sliding_attention" in layer_types
    if sliding and not (isinstance(sliding_window, int) and sliding_window >= 1):
        problems.append(f"sliding_window must be >= 1 for sliding_attention layers, got {sliding_window}")
    scaling = dict(scaling or {})
    if unknown := sorted(set(scaling) - set(SCALING_DEFAULTS)):
        problems.append(f"unknown scaling fields {unknown}: known are {list(SCALING_DEFAULTS)}")
    derived = target_scaling(target)
    scaling = {key: derived[key] if scaling.get(key) is None else scaling[key] for key in SCALING_DEFAULTS}
    if (scaling["final_logit_softcapping"] or 0) <= 0:  # 0 asks for no cap, whatever the target does
        scaling["final_logit_softcapping"] = None
    scaling = {key: value for key, value in scaling.items() if value != SCALING_DEFAULTS[key]}
    if problems:
        raise ValueError("invalid drafter config: " + "; ".join(problems))

    fields = {key: target[key] for key in _LAYER_SHAPE_KEYS + _ROPE_KEYS if target.get(key) is not None}
    # Older configs omit head_dim; Qwen3Config's default (128) would then be wrong.
    fields["head_dim"] = target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]
    if sliding:  # Qwen3Config drops sliding_window unless use_sliding_window is set
        fields.update(use_sliding_window=True, sliding_window=int(sliding_window))
    return Qwen3Config(
        **fields,
        layer_types=layer_types,
        num_hidden_layers=draft_layers,
        architectures=[ARCHITECTURES[arch]],
        num_target_layers=num_target_layers,
        dflash_config={
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "block_size": int(block_size),
            "mask_token_id": int(mask_token_id),
            **extra,
            **{key: None if value is None else float(value) for key, value in scaling.items()},
        },
    )
