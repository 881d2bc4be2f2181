"""The drafter in HF format (`config.json`, `model.safetensors`, `modeling_dflash.py`), which the
reference `dflash`, `AutoModel(..., trust_remote_code=True)`, SGLang and vLLM load (docs/evaluation-and-serving.md: Serve it).

An export is written to a temporary directory beside its destination, synced, and only then swapped
in, so a crash mid-export never leaves a half-written drafter where a reader expects one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_mp.export import dspark_export, modeling_dflash
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import ARCHITECTURES
from dflash_mp.run.checkpoint import fsync_path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# The self-contained modelling file that `AutoModel.from_pretrained(..., trust_remote_code=True)` runs.
MODELING_NAME = "modeling_dflash.py"


# Files readable by every user (a shared model directory), as the directory itself.
FILE_MODE, DIR_MODE = 0o644, 0o755


def _config_json(drafter: DFlashDrafter, dtype: torch.dtype) -> str:
    """The drafter's config.json for every reader, not only transformers 5.

    The DFlash fields go both under dflash_config and at the top level: z-lab/dflash's loader
    reads block_size only at the top level, MLX readers take mask_token_id from there (else 0).
    rope_theta/rope_scaling are repeated beside rope_parameters for transformers-4 readers, and
    is_causal is written as false: a reader that infers it from the layer type may not.
    """
    config = drafter.config.to_dict()
    config["architectures"] = [ARCHITECTURES[drafter.arch]]
    config["auto_map"] = {"AutoModel": f"{Path(MODELING_NAME).stem}.{ARCHITECTURES[drafter.arch]}"}
    for key, value in config["dflash_config"].items():
        config[key] = value
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    # Without is_causal false the DFlash 2 reference makes sliding-attention layers causal.
    config["is_causal"] = False
    dtype_name = str(dtype).removeprefix("torch.")
    # transformers 5 reads `dtype`; older readers (and serving engines) still read `torch_dtype`.
    config["dtype"] = dtype_name
    config["torch_dtype"] = dtype_name
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype | None = torch.bfloat16,
    verifier: dict | None = None,
) -> Path:
    """Write the drafter to `out_dir` in HF format, replacing any previous export only once complete.

    `dtype` None keeps the parameters' own dtype. Pass the unwrapped module (not DDP / compiled).
    `verifier`: a DSpark export's target (speculators_format.target_verifier); None writes it null.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous().clone()
        for name, tensor in drafter.state_dict().items()
    }
    saved_dtype = next(iter(state.values())).dtype
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        files = [staging / CONFIG_NAME, staging / WEIGHTS_NAME]
        if drafter.arch == "dspark":  # speculators' format, which vLLM serves (dspark_export.py)
            dtype_name = str(saved_dtype).removeprefix("torch.")
            (staging / CONFIG_NAME).write_text(
                dspark_export.dspark_config_json(drafter, dtype_name, verifier)
            )
        else:
            (staging / CONFIG_NAME).write_text(_config_json(drafter, saved_dtype))
            shutil.copyfile(modeling_dflash.__file__, staging / MODELING_NAME)
            files.append(staging / MODELING_NAME)
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt"})
        for path in files:
            path.chmod(FILE_MODE)
            fsync_path(path)
        staging.chmod(DIR_MODE)  # mkdtemp made it private
        fsync_path(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # A directory cannot be renamed over a non-empty one: move the old export aside (into an empty
    # placeholder, which rename may replace), put the new one in place, then delete the old one.
    previous = None
    if out_dir.exists():
        previous = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, previous)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        if previous is not None:
            os.replace(previous, out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_path(out_dir.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return out_dir


def load_exported_drafter(path: str | Path) -> DFlashDrafter:
    """A drafter from an export directory, with parameters in the dtype they were saved in."""
    path = Path(path)
    config = Qwen3Config.from_json_file(path / CONFIG_NAME)
    if dspark_export.is_speculators_dspark(config.to_dict()):
        config = dspark_export.drafter_config_from_speculators(json.loads((path / CONFIG_NAME).read_text()))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_file(path / WEIGHTS_NAME), strict=True, assign=True)
    return drafter


def drafter_from_checkpoint(
    run_dir: str | Path, step: int | None = None, checkpoint_dir: str | Path | None = None
) -> DFlashDrafter:
    """The drafter of a checkpoint of `run_dir`: `checkpoint_dir`, else step `step`, else the newest.

    Its config is rebuilt from RUN_DIR/config.yaml the way training built it, so the checkpoint's
    tensors (the bare state dict) load with strict key and shape checks.
    """
    from omegaconf import OmegaConf

    from dflash_mp.config.schema import to_dataclass
    from dflash_mp.run import checkpoint
    from dflash_mp.training.recipe import build_drafter

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no config.yaml: give the run directory the checkpoint belongs to"
        )
    if checkpoint_dir is None:
        found = {
            int(path.name.removeprefix("step_")): path
            for path in checkpoint.complete_checkpoints(run_dir / "checkpoints")
        }
        if not found:
            raise FileNotFoundError(f"no complete checkpoint in {run_dir / 'checkpoints'}")
        step = max(found) if step is None else step
        if step not in found:
            raise FileNotFoundError(
                f"no complete checkpoint of step {step} in {run_dir}; there are steps {sorted(found)}"
            )
        checkpoint_dir = found[step]
    drafter = build_drafter(to_dataclass(OmegaConf.load(config_path)))
    drafter.load_state_dict(load_file(Path(checkpoint_dir) / "drafter.safetensors"), strict=True)
    return drafter


def vllm_path_note(out_dir: str | Path) -> str | None:
    """A note for an export whose path lacks "dflash": vLLM 0.33 infers the DFlash method from the
    draft model's path alone (`SpeculativeConfig.__post_init__`) and would otherwise load it as an
    independent draft model."""
    if "dflash" in str(out_dir).lower():
        return None
    return (
        f"note: vLLM detects a DFlash drafter by 'dflash' in its path, which {out_dir} lacks: pass "
        '"method": "dflash" in --speculative-config, or export to a path that contains it '
        "(docs/evaluation-and-serving.md: Serve it)"
    )
