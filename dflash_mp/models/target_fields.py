"""The target's config.json under the field names the trainer reads, where a family names them its
own way: transformers' own aliases of the family's config class (`attribute_map`: `n_layer` for
`num_hidden_layers`, `d_model` for `hidden_size`, `moe_num_experts` for `num_experts`) and, for a
config without a layer count (NemotronH), the length of its list of one type per layer.

Nothing is imported for a config that has the fields already (the usual case). `field` reads one
field the same way from a dict or a config object: what recognises a mixture of experts
(`expert_count`, `experts_per_token`: ERNIE's `moe_num_experts` and `moe_k` are aliases of
`num_experts` and `num_experts_per_tok`) and a state-space model, for the plan's costs and the
kernels the doctor names.
"""

from __future__ import annotations

from typing import Any

# What the trainer reads from the target's (text) config without a default.
REQUIRED_TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# transformers' standard names of the routed-expert count (each family's aliases: `field`).
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# The size of a state-space (Mamba) layer's state: NemotronH, Jamba, Bamba, Falcon-H1, Zamba, Mamba.
STATE_SPACE_FIELDS = ("ssm_state_size", "mamba_d_state", "state_size")


def with_standard_names(text: dict[str, Any]) -> dict[str, Any]:
    """`text` (a text config as a dict), where it lacks a field of REQUIRED_TARGET_FIELDS, with each
    alias it holds copied to the standard name, and the layer count from the layer-type list as
    the last resort. The file's own fields win; none is made up from a class default."""
    if all(text.get(key) is not None for key in REQUIRED_TARGET_FIELDS):
        return text
    aliases = _attribute_map(text.get("model_type"))
    filled = dict(text)
    for standard, alias in aliases.items():
        if filled.get(standard) is None and isinstance(alias, str) and text.get(alias) is not None:
            filled[standard] = text[alias]
    if filled.get("num_hidden_layers") is None:
        layer_types = text.get(aliases.get("layer_types", "layer_types"))
        if isinstance(layer_types, list) and layer_types:
            filled["num_hidden_layers"] = len(layer_types)
    return filled


def field(config: Any, name: str) -> Any:
    """`config`'s field `name` (a dict or a config object): its own, else under its family's alias
    (`attribute_map`: ERNIE's `moe_num_experts` for `num_experts`); None when it has neither."""
    if isinstance(config, dict):
        value, model_type = config.get(name), config.get("model_type")
    else:
        value, model_type = getattr(config, name, None), getattr(config, "model_type", None)
    if value is not None:
        return value
    alias = _attribute_map(model_type).get(name)
    if not isinstance(alias, str):
        return None
    return config.get(alias) if isinstance(config, dict) else getattr(config, alias, None)


def expert_count(config: Any) -> int:
    """How many routed experts a target of `config` has per MoE layer; 0 for a dense one. A config
    whose list of layer types names its MLP layers says which are MoE ("moe"): NemotronH's class
    default of 8 experts on a pattern without MoE layers is no MoE."""
    layer_types = field(config, "layer_types") or []
    if isinstance(layer_types, list) and "mlp" in layer_types and "moe" not in layer_types:
        return 0
    return next((int(n) for key in EXPERT_COUNT_FIELDS if isinstance(n := field(config, key), int) and n), 0)


def experts_per_token(config: Any) -> int:
    """The routed experts each token runs (top-k; ERNIE's `moe_k`); 1 where the config names none."""
    return int(field(config, "num_experts_per_tok") or 1)


def has_state_space(config: Any) -> bool:
    """Mamba / state-space mixers (transformers lists NemotronH's as "linear_attention" layers)."""
    return any(field(config, key) for key in STATE_SPACE_FIELDS)


def _attribute_map(model_type: Any) -> dict[str, str]:
    """The aliases of `model_type`'s config class ({} for a type transformers does not know)."""
    if not isinstance(model_type, str):
        return {}
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})
    except (KeyError, ImportError, ValueError):
        return {}
