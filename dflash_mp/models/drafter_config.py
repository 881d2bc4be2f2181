"""The drafter's config: the target's layer shapes plus the DFlash fields, as the reference,
SGLang and vLLM read them (docs/DESIGN.md §3), and the checks a bad one fails."""

from __future__ import annotations

import re
from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from dflash_mp.models.dspark_fields import DSPARK_DEFAULTS, DSPARK_FIELDS, dspark_field_problems
from dflash_mp.models.qwen3_layers import rotary_embedding
from dflash_mp.models.target_fields import REQUIRED_TARGET_FIELDS, with_standard_names

# Target-config keys the drafter copies as they are (the head geometry, the MLP width, the norm
# epsilon, the activation and RoPE are derived: `drafter_geometry`).
_COPIED_KEYS = ("hidden_size", "attention_bias", "max_position_embeddings", "vocab_size", "initializer_range")
# The norm epsilon under the names families give it (transformers has no alias for it): RMS or
# layer norm, `_eps` or `_epsilon` (Llama 4's norm_eps, Cohere's layer_norm_eps, NemotronH's
# layer_norm_epsilon).
_NORM_EPSILON = re.compile(r"((rms_|layer_)?norm_)?eps(ilon)?")
# A field naming the dense MLP's width beside an experts' intermediate_size (Llama 4's intermediate_size_mlp).
_DENSE_WIDTH = re.compile(r"(dense|mlp)_intermediate_size|intermediate_size_(dense|mlp)")
# The rope_parameters keys the drafter keeps: its RoPE rotates the whole head (the reference and
# SGLang always do; vLLM would honour a partial_rotary_factor, docs/TARGETS.md), and its positions
# are 1-D text positions, for which multimodal RoPE (mrope_section) equals plain RoPE.
_DROPPED_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")

ARCHITECTURES = {
    "dflash": "DFlashDraftModel",
    "dflash2": "DFlash2DraftModel",
    "xpress": "XPressDraftModel",
    "dspark": "DSparkSpeculator",
}
# dflash_config fields of a DFlash 2 drafter (the reference, vLLM and the MLX loader read them there).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# dflash_config fields of an XPress drafter (speculators' XPressSpeculatorConfig names; models/xpress.py).
XPRESS_FIELDS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
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
    embedding_multiplier; Granite divides its logits by logits_scaling, Cohere multiplies them by
    logit_scale and Falcon-H1 by lm_head_multiplier; Gemma 2 soft-caps them at its
    final_logit_softcapping. Other targets scale nothing."""
    gemma = str(target.get("model_type", "")).startswith("gemma")
    embedding = target.get("embedding_multiplier") or (float(target["hidden_size"]) ** 0.5 if gemma else 1.0)
    logits_scaling = target.get("logits_scaling")
    output = float(target.get("logit_scale") or 1.0) * float(target.get("lm_head_multiplier") or 1.0)
    return {
        "input_embedding_scale": float(embedding),
        "output_multiplier": output / float(logits_scaling) if logits_scaling else output,
        "final_logit_softcapping": target.get("final_logit_softcapping") or None,
    }


def norm_epsilon(target: dict[str, Any]) -> float | None:
    """The target's norm epsilon, under whichever of its names the config uses (`_NORM_EPSILON`)."""
    found = [v for k, v in target.items() if _NORM_EPSILON.fullmatch(k) and isinstance(v, (int, float))]
    return float(found[0]) if found else None


def mlp_width(target: dict[str, Any]) -> int:
    """The drafter's MLP width: the target's dense MLP width (a field naming it beside an experts'
    intermediate_size, else intermediate_size); 3 x hidden_size where that is narrower than the
    hidden size (an experts' width: MiniMax-M2, OLMoE) or absent (Qwen3.5-MoE)."""
    hidden = int(target["hidden_size"])
    dense = [v for k, v in target.items() if _DENSE_WIDTH.fullmatch(k) and isinstance(v, int)]
    width = dense[0] if dense else target.get("intermediate_size")
    return int(width) if isinstance(width, int) and width >= hidden else 3 * hidden


def drafter_rope(target: dict[str, Any]) -> dict[str, Any]:
    """The drafter's rope_parameters from the target's (docs/TARGETS.md).

    A per-layer-type dict (Gemma 3 under transformers 5) gives its full-attention entry, the
    RoPE of the target's global layers; legacy rope_theta/rope_scaling are read as transformers
    4 wrote them; the keys of `_DROPPED_ROPE_KEYS` are left out.
    """
    params = target.get("rope_parameters")
    if params is None:
        params = dict(target.get("rope_scaling") or {})
        params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
        params["rope_theta"] = float(target.get("rope_theta") or 10000.0)
    elif params and all(isinstance(value, dict) for value in params.values()):
        if "full_attention" not in params:
            raise ValueError(
                f"rope_parameters is per layer type ({sorted(params)}) without a full_attention entry, "
                "the RoPE the drafter's layers take"
            )
        params = params["full_attention"]
    params = {key: value for key, value in params.items() if key not in _DROPPED_ROPE_KEYS}
    params.setdefault("rope_type", "default")
    return params


def drafter_geometry(target: dict[str, Any]) -> dict[str, Any]:
    """What a drafter layer takes from the target's text config (a config.json dict).

    Heads as the target's attention has them; an MLA target (DeepSeek-V3, Kimi) has no plain
    heads (its head_dim is the RoPE slice, 64), so the drafter gets heads of MLA's value width
    (v_head_dim, 128) filling hidden_size, and up to 8 KV heads.
    The MLP width is the target's dense one, else 3 x hidden_size (Qwen3.5-MoE has only expert
    widths; 3 x is Qwen3-30B-A3B's ratio). The activation is SiLU whatever the target's MLP uses:
    SGLang and vLLM build DFlash layers with SiLU only.
    """
    fields = {key: target[key] for key in _COPIED_KEYS if target.get(key) is not None}
    hidden, heads = int(target["hidden_size"]), int(target["num_attention_heads"])
    if target.get("kv_lora_rank") or target.get("qk_rope_head_dim"):
        head_dim = int(target.get("v_head_dim") or 128)
        if hidden % head_dim:
            raise ValueError(
                f"hidden_size {hidden} of an MLA target is not a multiple of its v_head_dim {head_dim}, "
                "the drafter's head width"
            )
        heads = hidden // head_dim
        kv_heads = next(n for n in (8, 4, 2, 1) if heads % n == 0)
        fields.update(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    else:
        fields.update(
            # Older configs omit head_dim; Qwen3Config's default (128) would then be wrong.
            head_dim=int(target.get("head_dim") or hidden // heads),
            num_attention_heads=heads,
            num_key_value_heads=int(target.get("num_key_value_heads") or heads),
        )
    fields["intermediate_size"] = mlp_width(target)
    if (epsilon := norm_epsilon(target)) is not None:
        fields["rms_norm_eps"] = epsilon
    fields["hidden_act"] = "silu"
    fields["rope_parameters"] = drafter_rope(target)
    if problem := _partial_rotation_problem(target, fields["head_dim"]):
        raise ValueError(problem)
    return fields


def _partial_rotation_problem(target: dict[str, Any], head_dim: int) -> str | None:
    """Why the target's RoPE cannot rotate the drafter's whole head: per-frequency factors (longrope's
    short_factor and long_factor) sized for the target's partial rotation (Phi-4-mini: 0.75 of
    128 dims, 48 factors). Dropping the factor rotates 64 frequencies; no reader can build that."""
    params = target.get("rope_parameters") or target.get("rope_scaling") or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", target.get("partial_rotary_factor"))
    if not isinstance(factor, (int, float)) or factor >= 1:
        return None
    frequencies = int(head_dim * factor) // 2
    sized = sorted(k for k, v in params.items() if isinstance(v, list) and len(v) == frequencies)
    if not sized:
        return None
    return (
        f"the target's {params.get('rope_type') or params.get('type')} RoPE has {' and '.join(sized)} "
        f"of {frequencies} entries, one per frequency of its partial rotation (partial_rotary_factor "
        f"{factor} of head_dim {head_dim}); the drafter rotates its whole head ({head_dim // 2} "
        "frequencies), as the reference and SGLang always do, so no drafter RoPE can be built from "
        "them that every reader builds alike"
    )


def _rope_problem(config: Qwen3Config) -> str | None:
    """Why the drafter's rotary embedding cannot be built from `config`, if it cannot."""
    # Per-frequency factor lists (longrope's) shown by their length: the message stays one short line.
    rope = {k: f"<{len(v)} values>" if isinstance(v, list) else v for k, v in config.rope_parameters.items()}
    try:
        frequencies = rotary_embedding(config).inv_freq.numel()
    except Exception as error:  # noqa: BLE001 - KeyError, ValueError, RuntimeError (a size mismatch), ...
        cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return f"the target's RoPE {rope} does not build a drafter rotary embedding ({cause})"
    if 2 * frequencies != config.head_dim:
        return (
            f"the target's RoPE {rope} rotates {2 * frequencies} of the drafter's {config.head_dim} head dims"
        )
    return None


def _text_fields(target_config: dict[str, Any] | PretrainedConfig) -> dict[str, Any]:
    """The target's text config as a dict under the trainer's field names (config/target_fields.py);
    a config object also gives what it derives (NemotronH's layer count is a property)."""
    if not isinstance(target_config, PretrainedConfig):
        return with_standard_names(dict(target_config.get("text_config", target_config)))
    text = target_config.get_text_config()
    fields = text.to_dict()
    for key in REQUIRED_TARGET_FIELDS:
        if fields.get(key) is None:
            fields[key] = getattr(text, key, None)
    return with_standard_names(fields)


def drafter_arch(config: PretrainedConfig) -> str:
    """The drafter architecture of `config`: "dflash2" when it carries the DFlash 2 fields, "xpress"
    the XPress ones, else "dflash"."""
    dflash = getattr(config, "dflash_config", None) or {}
    if all(key in dflash for key in XPRESS_FIELDS):
        return "xpress"
    if all(key in dflash for key in DSPARK_FIELDS):
        return "dspark"
    return "dflash2" if all(key in dflash for key in DFLASH2_FIELDS) else "dflash"


def _shape_problems(
    target: dict[str, Any],
    draft_layers: int,
    target_layer_ids: list[int],
    block_size: int,
    mask_token_id: int,
) -> list[str]:
    """What is wrong with the drafter's depth, the target layers it reads, its block and mask token."""
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
    return problems


def _arch_fields(
    problems: list[str],
    target: dict[str, Any],
    arch: str,
    dflash2: dict[str, int] | None,
    xpress: dict[str, int] | None,
    dspark: dict[str, Any] | None,
) -> dict[str, Any]:
    """The architecture's own dflash_config fields (none for DFlash); their problems go to `problems`."""
    extra: dict[str, Any] = {}
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
    elif arch == "xpress":
        extra = {key: int((xpress or {}).get(key, 0)) for key in XPRESS_FIELDS}
        if min(extra["xpress_rank"], extra["xpress_mlp_ratio"]) < 1 or extra["num_jacobi_passes"] < 0:
            problems.append(
                f"arch xpress needs positive xpress_rank and xpress_mlp_ratio and num_jacobi_passes >= 0, "
                f"got {xpress}"
            )
    elif arch == "dspark":  # models/dspark.py; unset fields take speculators' defaults
        extra = {**DSPARK_DEFAULTS, **(dspark or {})}
        problems += [f"arch dspark: {problem}" for problem in dspark_field_problems(extra)]
    elif arch != "dflash":
        problems.append(f"arch {arch!r} must be one of {sorted(ARCHITECTURES)}")
    return extra


def _check_layer_types(
    problems: list[str], layer_types: list[str], draft_layers: int, sliding_window: int | None
) -> None:
    """One known attention kind per draft layer, and a window where a layer slides."""
    if len(layer_types) != draft_layers or any(kind not in LAYER_TYPES for kind in layer_types):
        problems.append(
            f"layer_types {layer_types} must name one of {LAYER_TYPES} per draft layer ({draft_layers})"
        )
    sliding = "sliding_attention" in layer_types
    if sliding and not (isinstance(sliding_window, int) and sliding_window >= 1):
        problems.append(f"sliding_window must be >= 1 for sliding_attention layers, got {sliding_window}")


def _non_default_scaling(
    problems: list[str], target: dict[str, Any], scaling: dict[str, float | None] | None
) -> dict[str, float | None]:
    """The scaling fields that differ from SCALING_DEFAULTS: the ones asked for, else the target's."""
    scaling = dict(scaling or {})
    if unknown := sorted(set(scaling) - set(SCALING_DEFAULTS)):
        problems.append(f"unknown scaling fields {unknown}: known are {list(SCALING_DEFAULTS)}")
    derived = target_scaling(target)
    scaling = {key: derived[key] if scaling.get(key) is None else scaling[key] for key in SCALING_DEFAULTS}
    if (scaling["final_logit_softcapping"] or 0) <= 0:  # 0 asks for no cap, whatever the target does
        scaling["final_logit_softcapping"] = None
    return {key: value for key, value in scaling.items() if value != SCALING_DEFAULTS[key]}


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
    xpress: dict[str, int] | None = None,
    dspark: dict[str, Any] | None = None,
) -> Qwen3Config:
    """The drafter's config: the target's layer shapes, `draft_layers` layers and the DFlash fields.

    `arch="dflash2"` adds `dflash2` (conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k) to `dflash_config`, `arch="xpress"` adds `xpress` (XPRESS_FIELDS). `layer_types` (one per draft layer, null: all full
    attention) and `sliding_window` go to the top level, where the reference reads them;
    `scaling` (keys of SCALING_DEFAULTS; null or absent: what the target does, `target_scaling`)
    goes to `dflash_config`, only the non-default values, so a Qwen3 target's export is unchanged.
    """
    target = _text_fields(target_config)
    num_target_layers = int(target["num_hidden_layers"])
    problems = _shape_problems(target, draft_layers, target_layer_ids, block_size, mask_token_id)
    extra = _arch_fields(problems, target, arch, dflash2, xpress, dspark)
    layer_types = list(layer_types) if layer_types else ["full_attention"] * draft_layers
    sliding = "sliding_attention" in layer_types
    _check_layer_types(problems, layer_types, draft_layers, sliding_window)
    scaling = _non_default_scaling(problems, target, scaling)
    try:
        fields = drafter_geometry(target)
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise ValueError("invalid drafter config: " + "; ".join(problems))

    if sliding:  # Qwen3Config drops sliding_window unless use_sliding_window is set
        fields.update(use_sliding_window=True, sliding_window=int(sliding_window))
    config = Qwen3Config(
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
    if problem := _rope_problem(config):
        raise ValueError(f"invalid drafter config: {problem}")
    return config
