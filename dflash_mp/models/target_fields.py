"""The target's config.json under the field names the trainer reads, where a family names them its
own way: transformers' own aliases of the family's config class (`attribute_map`: `n_layer` for
`num_hidden_layers`, `d_model` for `hidden_size`, `moe_num_experts` for `num_experts`) and, for a
config without a layer count (NemotronH), the length of its list of one type per layer.

Nothing is imported for a config that has the fields already (the usual case).
"""

from __future__ import annotations

from typing import Any

# What the trainer reads from the target's (text) config without a default.
REQUIRED_TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


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


def _attribute_map(model_type: Any) -> dict[str, str]:
    """The aliases of `model_type`'s config class ({} for a type transformers does not know)."""
    if not isinstance(model_type, str):
        return {}
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})
    except (KeyError, ImportError, ValueError):
        return {}
