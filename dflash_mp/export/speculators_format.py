"""An XPress drafter in speculators' format (docs/evaluation-and-serving.md, XPress), the format
speculators 0.9.0's `XPressDraftModel` saves and loads, and the one vLLM's speculators path reads.

config.json: `speculators_model_type: "xpress"`, the draft layers' Qwen3 config under
`transformer_layer_config`, the DFlash fields under speculators' names (`aux_hidden_state_layer_ids`
are hidden-state indices, our target layer ids + 1, as speculators' DFlash converter maps them),
the XPress fields and `speculators_config` (algorithm, greedy proposals of Bs - 1 tokens, the
verifier). model.safetensors: our state dict as it is: its names are speculators' (`layers.*`,
`fc`, `hidden_norm`, `norm`, `refiner_head.*`); the embedding and LM heads are the verifier's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import XPRESS_FIELDS

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (tests load it there)
# Keys of our config.json that are not the draft layers' own (speculators' converter drops them too).
_NOT_LAYER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def speculators_config(
    drafter: DFlashDrafter, verifier: str | None, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The config.json speculators' `XPressSpeculatorConfig` reads, for an XPress drafter."""
    if drafter.arch != "xpress":
        raise ValueError(
            f"the speculators format is written for model.arch=xpress drafters, not {drafter.arch}"
        )
    num_target_layers = int(drafter.config.num_target_layers)
    if num_target_layers - 1 in drafter.target_layer_ids:
        raise ValueError(
            f"target layer {num_target_layers - 1} is the target's last: speculators feeds it separately "
            "(verifier_last_hidden_states), not among the drafter's inputs; train with model.target_layer_ids "
            "below it to serve through speculators' format"
        )
    layers = {k: v for k, v in drafter.config.to_dict().items() if k not in _NOT_LAYER_KEYS}
    layers["model_type"] = "qwen3"
    dflash = drafter.config.dflash_config
    return {
        "speculators_model_type": "xpress",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["XPressSpeculator"],
        "transformer_layer_config": layers,
        "draft_vocab_size": int(drafter.config.vocab_size),
        "block_size": drafter.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in drafter.target_layer_ids],
        "mask_token_id": drafter.mask_token_id,
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,  # our blocks: index 0 holds the anchor, 1..Bs-1 are drafted
        **{key: int(dflash[key]) for key in XPRESS_FIELDS},
        "speculators_config": {
            "algorithm": "xpress",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def export_speculators(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    verifier: str | None,
    verifier_architectures: list[str],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json and model.safetensors in speculators' format to `out_dir` (replaced whole)."""
    config = speculators_config(drafter, verifier, verifier_architectures)
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(device="cpu", dtype=dtype).contiguous().clone()
        for name, tensor in drafter.state_dict().items()
    }
    config["transformer_layer_config"]["dtype"] = str(dtype).removeprefix("torch.")
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        staging.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def target_verifier(target_path: str) -> dict[str, Any]:
    """speculators' `verifier` for a run's target (model.target_path): its path and the
    architectures of its config.json. The XPress and DSpark exports fill their config with it."""
    target_config = json.loads((Path(target_path) / "config.json").read_text())
    return {"name_or_path": str(target_path), "architectures": list(target_config.get("architectures") or [])}


def run_verifier(run_dir: str | Path) -> dict[str, Any]:
    """`target_verifier` of the target in RUN_DIR/config.yaml."""
    from omegaconf import OmegaConf

    return target_verifier(str(OmegaConf.load(Path(run_dir) / "config.yaml").model.target_path))


def export_run_speculators(
    drafter: DFlashDrafter, run_dir: Path, out_dir: Path | None, dtype: torch.dtype
) -> Path:
    """`export_speculators` of a run's drafter to `out_dir` (default RUN_DIR/export-speculators), the
    verifier being the run's model.target_path with its config.json's architectures."""
    verifier = run_verifier(run_dir)
    return export_speculators(
        drafter,
        out_dir or Path(run_dir) / "export-speculators",
        verifier["name_or_path"],
        verifier["architectures"],
        dtype,
    )
