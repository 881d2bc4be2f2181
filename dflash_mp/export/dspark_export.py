"""A DSpark drafter's export in speculators' format, the one vLLM serves (`"method": "dspark"`).

vLLM's DSpark drafter (`vllm/model_executor/models/qwen3_dspark.py`) loads speculators checkpoints:
a `config.json` whose `speculators_model_type` is "dspark" (speculators' `DSparkSpeculatorConfig`:
the draft layers' Qwen3 config under `transformer_layer_config`, the DFlash fields, the DSpark head
fields and `speculators_config` with the verifier and the proposal length) and weights named as
speculators' `DSparkDraftModel` saves them: the DFlash layers (`layers.*`, `norm`, `fc`,
`hidden_norm`), `markov_head.markov_w1/markov_w2` (plus `gate_proj`/`joint_proj` for the gated and
rnn heads) and `confidence_head.proj`. The embedding and LM head are the target's and not saved,
as speculators leaves them out for a full-vocabulary draft. tests/test_dspark_export.py loads an
export into speculators' `DSparkDraftModel` with strict key and shape checks.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import Qwen3Config

from dflash_mp.models.drafter_config import SCALING_DEFAULTS
from dflash_mp.models.dspark_fields import DSPARK_FIELDS

SPECULATORS_VERSION = "0.9.0"
# Drafter config keys that are this project's, not a Qwen3 layer's (they travel as DSpark fields).
_OWN_KEYS = ("dflash_config", "architectures", "auto_map", "num_target_layers", "block_size")


def dspark_config(drafter: Any, dtype_name: str, verifier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The speculators config.json of a DSpark drafter (`drafter.arch == "dspark"`); `verifier`:
    {"name_or_path", "architectures"} of the target (unknown here: null and [])."""
    config = drafter.config
    dflash = dict(config.dflash_config)
    scaled = {key: dflash[key] for key in SCALING_DEFAULTS if key in dflash}
    if scaled:  # speculators' DSpark and vLLM's loader have no field for them
        raise ValueError(
            f"a DSpark drafter with {scaled} cannot be exported in speculators' format, which has no "
            "embedding or logit scaling: serve a target without them (docs/drafter.md: DSpark)"
        )
    layer = {key: value for key, value in config.to_dict().items() if key not in _OWN_KEYS}
    layer.update(model_type="qwen3", dtype=dtype_name)
    drafts = int(dflash["block_size"]) - (0 if dflash["sample_from_anchor"] else 1)
    return {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": drafts,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": dict(verifier or {"name_or_path": None, "architectures": []}),
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(config.vocab_size),
        "block_size": int(dflash["block_size"]),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [int(i) for i in dflash["target_layer_ids"]],
        "mask_token_id": int(dflash["mask_token_id"]),
        # This project's sliding layers see both sides of the query (docs/drafter.md).
        "sliding_window_non_causal": "sliding_attention" in (config.layer_types or []),
        **{key: dflash[key] for key in DSPARK_FIELDS},
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def dspark_config_json(drafter: Any, dtype_name: str, verifier: dict[str, Any] | None = None) -> str:
    return json.dumps(dspark_config(drafter, dtype_name, verifier), indent=2, sort_keys=True) + "\n"


def is_speculators_dspark(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == "dspark"


def drafter_config_from_speculators(config: dict[str, Any]) -> Qwen3Config:
    """The drafter config (as `build_drafter_config` makes it) of a speculators DSpark config.json."""
    layer = dict(config["transformer_layer_config"])
    layer.pop("model_type", None)
    dflash = {
        "target_layer_ids": list(config["aux_hidden_state_layer_ids"]),
        "block_size": int(config["block_size"]),
        "mask_token_id": int(config["mask_token_id"]),
        **{key: config[key] for key in DSPARK_FIELDS},
    }
    return Qwen3Config(**layer, architectures=["DSparkSpeculator"], dflash_config=dflash)
