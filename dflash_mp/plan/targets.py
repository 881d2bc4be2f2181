"""What `--target` names, and which measurement of the target stage the plan takes for it.

`--target` is an HF directory (or its config.json), `embedded`, a preset (conf/experiment/<name>.yaml:
its model.target_path when that holds a config.json, else the shape below, and its drafter's
workload) or an entry of the target-families measurement (`--families`, bench/target_families.py).

The target stage is measured when an entry of that measurement ran this very shape (model_type,
config numbers, layers run, sequence length); scaled from the entry of the same model_type nearest
in active parameters when only the family was measured (by the FLOPs ratio: active parameters x
tokens, plus attention, at the entry's MFU); otherwise it comes from the `--bench` run (layouts.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_mp.config.schema import CONF_DIR, TargetConfigError, compose_config, read_target_config
from dflash_mp.embedded import embedded_path
from dflash_mp.plan import PlanError
from dflash_mp.plan.costs import (
    ModelShape,
    Workload,
    shape_from_hf_config,
    target_layer_params,
    target_layers_run,
)
from dflash_mp.plan.measured import FamilyRecord

# The recorded measurement, where this checkout has it (BENCHMARKS.md, "Target stage per family").
DEFAULT_FAMILIES = CONF_DIR.parent / "bench" / "results" / "h200x1-target-families.json"

# A preset's target when its model.target_path holds no config.json: an entry of the families
# measurement (its config numbers are the checkpoint's), or the checkpoint's config.json numbers.
PRESET_TARGETS: dict[str, str | dict[str, Any]] = {
    "qwen3.5-9b": "qwen3.5-9b",
    "qwen3.5-27b": "qwen3.5-27b",
    "qwen3-coder-30b-a3b": "qwen3-30b-a3b",  # Qwen3-Coder-30B-A3B has Qwen3-30B-A3B's shape
    "qwen3.5-35b-a3b": "qwen3.5-35b-a3b",
    "qwen3.6-35b-a3b": "qwen3.5-35b-a3b",  # conf/model/qwen3.6-35b-a3b.yaml: the same 40 layers of 2048
    "gpt-oss-20b": "gpt-oss-20b",
    # openai/gpt-oss-120b's config.json (also transformers' GptOssConfig defaults).
    "gpt-oss-120b": dict(
        model_type="gpt_oss", num_hidden_layers=36, hidden_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=128,
        num_experts_per_tok=4, sliding_window=128, vocab_size=201088,
    ),
    # Qwen/Qwen3-8B's config.json: the shape of the recorded stage benchmark.
    "qwen3-8b": dict(
        model_type="qwen3", num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
    ),
}  # fmt: skip
PRESET_TARGETS["paper"] = PRESET_TARGETS["qwen3-8b"]


@dataclass(frozen=True)
class PlannedTarget:
    shape: ModelShape
    config: dict[str, Any]  # the text config's numbers (model_type included)
    workload: Workload | None  # a preset's drafter and sample; None: the benchmark's
    source: str  # where the shape came from, for the output

    def refused_widths(self, widths: tuple[int, ...]) -> dict[int, str]:
        """Tensor-parallel widths whose split the target's own plan cannot make (the preflight's check)."""
        if not self.config.get("model_type"):
            return {}
        from dflash_mp.models.tensor_parallel import plan_problems

        problems = {k: plan_problems(self.config, k) for k in widths if k > 1}
        return {k: "; ".join(found) for k, found in problems.items() if found}


@dataclass(frozen=True)
class FamilyMatch:
    """The families entry the target stage comes from: this very shape, or its family's nearest."""

    record: FamilyRecord
    record_shape: ModelShape
    exact: bool


def _from_directory(directory: Path, label: str) -> tuple[dict[str, Any], str]:
    if not (directory / "config.json").is_file():
        raise PlanError(f"--target {label}: no config.json in {directory} (give the target's HF directory)")
    try:
        return read_target_config(str(directory)), f"{directory / 'config.json'}"
    except TargetConfigError as e:
        raise PlanError(f"--target {label}: {e}") from e


def _record_config(record: FamilyRecord) -> dict[str, Any]:
    return {"model_type": record.model_type, **record.config}


def resolve_target(target: str, families: dict[str, FamilyRecord], micro_batch: int = 1) -> PlannedTarget:
    """`--target` as a shape, its config and (for a preset) its workload; PlanError if unknown."""
    workload = None
    if target == "embedded":
        config, source = _from_directory(embedded_path("target"), target)
        name = "embedded"
    elif Path(target).exists():
        path = Path(target)
        directory = path.parent if path.name == "config.json" else path
        config, source = _from_directory(directory, target)
        name = directory.name
    elif (CONF_DIR / "experiment" / f"{target}.yaml").is_file():
        cfg = compose_config([f"experiment={target}"])
        workload = Workload(
            seq_len=int(cfg.data.max_length),
            num_anchors=int(cfg.data.num_anchors),
            block_size=int(cfg.model.block_size),
            draft_layers=int(cfg.model.draft_layers),
            micro_batch=micro_batch,
        )
        config, source = _preset_config(target, Path(str(cfg.model.target_path)), families)
        name = target
    elif target in families:
        config, source = _record_config(families[target]), families[target].where()
        name = target
    else:
        presets = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
        raise PlanError(
            f"--target {target}: not a directory with a config.json, 'embedded', a preset ({', '.join(presets)}) "
            f"or an entry of the families measurement ({', '.join(families) or 'none read: --families'})"
        )
    return PlannedTarget(shape_from_hf_config(config, name), config, workload, source)


def _preset_config(
    preset: str, target_path: Path, families: dict[str, FamilyRecord]
) -> tuple[dict[str, Any], str]:
    """The preset's own target when its model.target_path is there, else its known shape."""
    if (target_path / "config.json").is_file():
        return _from_directory(target_path, preset)
    known = PRESET_TARGETS.get(preset)
    if isinstance(known, dict):
        return dict(
            known
        ), f"preset {preset} (the checkpoint's config.json numbers, dflash_mp/plan/targets.py)"
    if isinstance(known, str) and known in families:
        return _record_config(families[known]), f"preset {preset}: the shape of {families[known].where()}"
    why = (
        f"its shape is entry {known!r} of the families measurement, not read"
        if known
        else "no shape known here"
    )
    raise PlanError(
        f"--target {preset}: the preset's model.target_path {target_path} has no config.json and {why}; "
        "give the target's directory (--target DIR)"
    )


def match_family(
    planned: PlannedTarget, workload: Workload, families: dict[str, FamilyRecord]
) -> FamilyMatch | None:
    """The entry of the same model_type that ran this shape, else the one nearest in active parameters."""
    shape = planned.shape
    same_type = [r for r in families.values() if r.model_type == shape.model_type]
    if not same_type:
        return None
    layers_run = target_layers_run(shape, workload)
    for record in same_type:
        numbers = all(planned.config.get(key) == value for key, value in record.config.items())
        if numbers and record.layers_run == layers_run and record.seq_len == workload.seq_len:
            return FamilyMatch(record, shape, exact=True)
    record = min(
        same_type,
        key=lambda r: abs(
            math.log(r.active_params_run / r.layers_run / target_layer_params(shape, active=True))
        ),
    )
    return FamilyMatch(record, shape_from_hf_config(_record_config(record), record.entry), exact=False)
