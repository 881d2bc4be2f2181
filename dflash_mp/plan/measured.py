"""What the benchmark measured: stage rates and peak memories read from bench/bench.py's JSON.

Values come from the JSON's `sections` (the raw measurements), not from its printed summary:
rates in samples/s (one sample = one sequence), peaks as torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_mp.plan import PlanError
from dflash_mp.plan.costs import ModelShape, Workload, target_weight_bytes

SCHEMA = "dflash_mp.bench/1"
STAGE_SECTIONS = "setup,target_only,drafter_only"
# Memory per GPU by device name, first match wins (GH200 before H200: its name's "480GB" counts CPU
# memory too, and its GPU comes with 96 or 144 GB, so the flag must say).
_GPU_MEMORY_GB = (
    ("GH200", None),
    ("H200", 141.0),
    ("H100 NVL", 94.0),
    ("H100", 80.0),
    ("H800", 80.0),
    ("B200", 180.0),
)


@dataclass(frozen=True)
class BenchRecord:
    """One benchmark run: its shape and the numbers the plan uses (None where not measured)."""

    path: str
    shape: ModelShape
    workload: Workload
    device: str
    device_name: str
    world_size: int
    target_parallel: int
    target_rate: float | None
    target_mfu: float | None
    drafter_rate: float | None
    colocated_rate_per_gpu: float | None
    pipeline_efficiency: float | None
    target_peak_gb: float | None
    drafter_peak_gb: float | None
    colocated_peak_gb: float | None
    sections: dict[str, Any]

    def missing(self, section: str, flag: str) -> PlanError:
        """The error for a rate this run did not measure: why, and the two ways out."""
        status = self.sections.get(section, {})
        why = f"{status.get('status', 'not run')}" + (f": {status['reason']}" if status.get("reason") else "")
        return PlanError(
            f"--bench {self.path}: no {section} rate (section {section}: {why}). Rerun the benchmark "
            f"with its stage sections (`make bench BENCH_RANKS=1 BENCH_ARGS='--sections {STAGE_SECTIONS}'`, "
            f"one GPU), or pass {flag}"
        )


def gpu_memory_gb(device_name: str) -> float | None:
    """A GPU's memory from its name (a known model, else "...80GB" in the name); None if unknown."""
    for model, memory in _GPU_MEMORY_GB:
        if model in device_name.upper():
            return memory
    stated = re.search(r"(\d+)\s*GB", device_name, flags=re.IGNORECASE)
    return float(stated.group(1)) if stated else None


def _ok(sections: dict[str, Any], name: str) -> dict[str, Any] | None:
    section = sections.get(name)
    return section if isinstance(section, dict) and section.get("status") == "ok" else None


def _peak_gb(sections: dict[str, Any], name: str, rank: str) -> float | None:
    section = _ok(sections, name) or {}
    return (section.get("per_rank", {}).get(rank, {}).get("memory") or {}).get("peak_allocated_gb")


def _role_rank(roles: dict[str, str], role: str) -> str:
    return next((rank for rank, played in roles.items() if role in played.split("+")), "0")


def _read_json(path: Path, flag: str, schema: str, producer: str, how_to_write: str) -> dict[str, Any]:
    """A benchmark's JSON; a file that is missing, not JSON or not `producer`'s is refused."""
    if not path.is_file():
        raise PlanError(f"{flag} {path}: no such file; write one with {how_to_write}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{flag} {path}: not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("schema") != schema:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise PlanError(f"{flag} {path}: not a {producer} result (schema {found!r}, expected {schema!r})")
    return data


def read_bench(path: str | Path) -> BenchRecord:
    """Parse a benchmark JSON; a file that is missing, not JSON or not the benchmark's is refused."""
    path = Path(path)
    data = _read_json(path, "--bench", SCHEMA, "bench/bench.py", "`make bench` (see BENCHMARKS.md)")
    try:
        shape_json, setup, sections = data["shape"], data["setup"], data["sections"]
        shape, workload = _bench_shape(shape_json, setup)
    except (KeyError, TypeError) as e:
        raise PlanError(f"--bench {path}: lacks the benchmark's shape/setup/sections ({e!r} missing)") from e

    world_size = int(setup.get("world_size", 2))
    target_rate = (_ok(sections, "target_only") or {}).get("samples_per_s")
    drafter_rate = (_ok(sections, "drafter_only") or {}).get("samples_per_s")
    # Each colocated rank reports its own rate, which is the rate per GPU.
    colocated_ranks = (_ok(sections, "colocated") or {}).get("per_rank", {})
    colocated_rates = [r["samples_per_s"] for r in colocated_ranks.values() if r.get("samples_per_s")]
    colocated_rate = sum(colocated_rates) / len(colocated_rates) if colocated_rates else None
    target_peak = drafter_peak = colocated_peak = None
    if setup.get("device") == "cuda":
        colocated_peaks = [_peak_gb(sections, "colocated", rank) for rank in colocated_ranks]
        colocated_peak = max((p for p in colocated_peaks if p), default=None)
        roles = setup.get("roles") or {"0": "target", "1": "drafter"}
        target_peak, drafter_peak = _stage_peaks(sections, roles, world_size, shape, workload)
    return BenchRecord(
        path=str(path),
        shape=shape,
        workload=workload,
        device=str(setup.get("device", "")),
        device_name=str(setup.get("device_name", "")),
        world_size=world_size,
        target_parallel=int(setup.get("target_parallel", 1)),
        target_rate=target_rate,
        target_mfu=(_ok(sections, "target_only") or {}).get("mfu"),
        drafter_rate=drafter_rate,
        colocated_rate_per_gpu=colocated_rate,
        pipeline_efficiency=_pipeline_efficiency(sections, target_rate, drafter_rate),
        target_peak_gb=target_peak,
        drafter_peak_gb=drafter_peak,
        colocated_peak_gb=colocated_peak,
        sections=sections,
    )


def _bench_shape(shape_json: dict[str, Any], setup: dict[str, Any]) -> tuple[ModelShape, Workload]:
    shape = ModelShape(
        hidden=shape_json["hidden"],
        layers=shape_json["layers"],
        heads=shape_json["heads"],
        kv_heads=shape_json["kv_heads"],
        head_dim=shape_json["head_dim"],
        intermediate=shape_json["intermediate"],
        vocab=shape_json["vocab"],
        name=f"{shape_json.get('name', 'bench')} (benchmark shape)",
    )
    workload = Workload(
        seq_len=shape_json["seq_len"],
        num_anchors=shape_json["num_anchors"],
        block_size=shape_json["block_size"],
        draft_layers=shape_json["draft_layers"],
        micro_batch=setup.get("micro_batch", 1),
    )
    return shape, workload


def _pipeline_efficiency(
    sections: dict[str, Any], target_rate: float | None, drafter_rate: float | None
) -> float | None:
    # The benchmark records it against the layout's stage capacities (all replicas, all drafters);
    # JSONs without it were 1 + 1, where that is the slower of the two rates.
    pipeline = _ok(sections, "pipeline") or {}
    efficiency = pipeline.get("efficiency")
    pipeline_rate = pipeline.get("samples_per_s")
    if efficiency is None and pipeline_rate and target_rate and drafter_rate:
        efficiency = pipeline_rate / min(target_rate, drafter_rate)
    return efficiency


def _stage_peaks(
    sections: dict[str, Any], roles: dict[str, str], world_size: int, shape: ModelShape, workload: Workload
) -> tuple[float | None, float | None]:
    """The target rank's and the drafter rank's peak GB of a GPU run (None where not measured)."""
    if world_size == 1:
        # One process held both models: its drafter peak includes the target's weights, and its
        # target peak the drafter's training state (which depends on the section order): the
        # former is subtracted, the latter is not used.
        peak = _peak_gb(sections, "drafter_only", "0")
        return None, (peak - target_weight_bytes(shape, workload) / 1e9 if peak else None)
    target_rank, drafter_rank = _role_rank(roles, "target"), _role_rank(roles, "drafter")
    target_peak = _peak_gb(sections, "pipeline", target_rank) or _peak_gb(
        sections, "target_only", target_rank
    )
    drafter_peak = _peak_gb(sections, "pipeline", drafter_rank) or _peak_gb(
        sections, "drafter_only", drafter_rank
    )
    return target_peak, drafter_peak


FAMILIES_SCHEMA = "dflash_mp.bench.target_families/1"


@dataclass(frozen=True)
class FamilyRecord:
    """One entry of bench/target_families.py's JSON: the target stage of one family's shape on one GPU."""

    path: str
    entry: str  # the key under "shapes", e.g. "qwen3.5-9b"
    model_type: str
    config: dict[str, Any]  # the config numbers it ran (the rest: transformers' defaults)
    seq_len: int
    layers_run: int
    params_run: int  # parameters of the layers run (every expert)
    active_params_run: int  # routed experts counted at top-k / experts
    weights_gb: float  # embedding + layers run + final norm, as built
    flops_per_forward: float  # active-parameter matmuls + softmax attention, per sequence
    target_ms: float  # the target stage per sequence: fast kernels, compiled layers
    mfu: float | None
    peak_gb: float | None
    kernels: dict[str, str]
    device_name: str

    def where(self) -> str:
        return f"{self.path} entry {self.entry!r}"


def read_families(path: str | Path) -> dict[str, FamilyRecord]:
    """The measured entries of a target-families JSON (failed or skipped ones left out)."""
    path = Path(path)
    write_it = "`python bench/target_families.py` (BENCHMARKS.md)"
    data = _read_json(path, "--families", FAMILIES_SCHEMA, "bench/target_families.py", write_it)
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    records = {}
    for entry, shape in (data.get("shapes") or {}).items():
        if not isinstance(shape, dict) or shape.get("status") != "ok":
            continue
        try:
            stage = shape["variants"]["target_stage"]
            per_call = int(shape.get("batch", 1))  # sequences per timed call (bench's --batch)
            records[entry] = FamilyRecord(
                path=shown,
                entry=entry,
                model_type=shape["model_type"],
                config=dict(shape["config"]),
                seq_len=int(shape["seq_len"]),
                layers_run=int(shape["layers_run"]),
                params_run=int(shape["params_layers_run"]),
                active_params_run=int(shape["active_params_layers_run"]),
                weights_gb=float(shape["weights_gb"]),
                flops_per_forward=(
                    float(shape["matmul_flops_per_forward"])
                    + float(shape.get("attention_flops_per_forward") or 0)
                )
                / per_call,
                target_ms=float(stage["ms"]) / per_call,
                mfu=stage.get("mfu"),
                peak_gb=stage.get("peak_allocated_gb"),
                kernels=dict(shape.get("kernels") or {}),
                device_name=str(data.get("device_name", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"--families {path}: entry {entry!r} lacks {e!r}") from e
    return records
