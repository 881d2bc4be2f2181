"""The benchmark's headline numbers: `summarize`, a pure function of the sections (`table` prints them)."""

from __future__ import annotations

from collections.abc import Callable

from layout import layout_of, rank_of

# The sections that run the layout itself (colocated is another layout; target_parallel_check
# holds a one-GPU reference beside the shard; profile watches one step): memory per GPU is theirs.
LAYOUT_SECTIONS = ("setup", "drafter_only", "target_only", "pipeline", "transport")
TP_CHECK_KEYS = (
    "max_rel_diff",
    "max_abs_diff",
    "within_tolerance",
    "tp_samples_per_s",
    "tp1_samples_per_s",
    "tp_speedup",
    "tp_scaling_efficiency",
)


def _get(d: dict, *keys):
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def per_gpu_rates(
    target_rate: float | None, drafter_rate: float | None, colocated: float | None, projection: dict | None
) -> dict:
    """Samples/s per GPU: measured colocated next to the stage rates and what splits of them imply.

    A GPU that runs both stages back to back would do 1 / (1/target + 1/drafter) if nothing but the
    two stages cost time; the best 8-GPU split (T targets, 8-T drafters) does best_samples_per_s / 8.
    """
    ideal = 1 / (1 / target_rate + 1 / drafter_rate) if target_rate and drafter_rate else None
    best = projection["best_samples_per_s"] / 8 if projection else None
    return {
        "colocated_measured": colocated,
        "target_stage": target_rate,
        "drafter_stage": drafter_rate,
        "colocated_from_stage_rates": ideal,
        "best_split_of_8": best,
        "best_split": projection["best_split"] if projection else None,
        "colocated_measured_over_from_stages": colocated / ideal if colocated and ideal else None,
        "best_split_over_colocated_measured": best / colocated if best and colocated else None,
    }


def _stage_total(section: dict | None, key: str, rate: float | None, count: int) -> float | None:
    """Samples/s of all `count` replicas (target) or drafter ranks: the sum of what each reported
    under `key` (per_replica / per_rank), or `count` x the top-level rate (JSONs before layouts)."""
    reported = [
        v["samples_per_s"] for v in ((section or {}).get(key) or {}).values() if "samples_per_s" in (v or {})
    ]
    if len(reported) == count:
        return sum(reported)
    return rate * count if rate else None


def projection_of_8(target_rate: float, drafter_rate: float, target_parallel: int = 1) -> dict:
    """Idealised (no DDP or transport cost): T target GPUs (replicas of `target_parallel`, each at
    `target_rate`) + 8-T drafters, vs 8 colocated GPUs (TP=1: the replica's rate / its GPUs)."""
    k = target_parallel
    splits = [
        {"targets": t, "drafters": 8 - t, "samples_per_s": min(t // k * target_rate, (8 - t) * drafter_rate)}
        for t in range(k, 8, k)
    ]
    best = max(splits, key=lambda x: x["samples_per_s"])
    return {
        "note": "standalone rates x GPUs, no communication cost: an upper bound to compare splits",
        "best_split": f"{best['targets']}t{best['drafters']}d",
        "best_samples_per_s": best["samples_per_s"],
        "colocated_8_gpus_samples_per_s": 8 / (k / target_rate + 1 / drafter_rate),
        "target_parallel": k,
        "splits": splits,
    }


def peak_memory_gib(merged: dict) -> dict:
    """Each timed section's peak GiB (allocated, reserved; the GPU ranks that ran it: the role's
    rank, colocated's highest) beside dflash_mp.plan.memory's prediction for that rank."""
    s, setup = merged["sections"], merged["setup"]
    predicted = setup.get("memory_prediction") or {}
    single = setup.get("world_size") == 1
    # One rank holds both roles' objects in every section (only colocated is one GPU's pair),
    # unless setup built no target (drafter sections alone): then it holds a drafter rank's.
    both = single and _get(s, "setup", "target") is not None
    ranks = {
        "target_only": (rank_of(setup, "target"), None if single else "target_rank"),
        "drafter_only": (rank_of(setup, "drafter"), "colocated" if both else "drafter_rank"),
        "colocated": ("*", "colocated"),  # every rank ran it: the highest
    }
    result = {}
    for section, (rank, model) in ranks.items():
        per_rank = _get(s, section, "per_rank") or {}
        reports = [(e or {}).get("memory") or {} for r, e in per_rank.items() if rank in ("*", r)]
        peaks = [r for r in reports if r.get("peak_allocated_gib") is not None]
        top = max(peaks, key=lambda r: r["peak_allocated_gib"]) if peaks else {}
        result[section] = {
            "allocated": top.get("peak_allocated_gib"),
            "reserved": top.get("peak_reserved_gib"),
            "predicted": _get(predicted, model, "peak_gib") if model else None,
            "device_total": top.get("device_total_gib"),
        }
    return result


def _matmul_tflops(s: dict) -> tuple[dict, dict]:
    """Each rank's measured matmul peak and its sustained rate (TFLOP/s)."""
    per_rank = (_get(s, "matmul_peak", "per_rank") or {}).items()
    peaks = {r: v.get("tflops") for r, v in per_rank if isinstance(v, dict)}
    sustained = {
        r: v.get("sustained_tflops")
        for r, v in per_rank
        if isinstance(v, dict) and v.get("sustained_tflops") is not None
    }
    return peaks, sustained


def _colocated_rate(s: dict, world: int) -> float | None:
    """Samples/s of every rank running the colocated pair (2 ranks under DDP, or the one rank alone),
    also written into the section with its tokens/s and its rate per GPU."""
    per_rank = [
        v["samples_per_s"]
        for v in (_get(s, "colocated", "per_rank") or {}).values()
        if "samples_per_s" in (v or {})
    ]
    if len(per_rank) != world:
        return None
    rate = sum(per_rank)
    s["colocated"]["samples_per_s_total"] = rate
    # Real tokens: chat-shaped rows (--data chat*) hold fewer than seq_len.
    s["colocated"]["tokens_per_s_total"] = sum(
        v.get("tokens_per_s", 0.0) for v in s["colocated"]["per_rank"].values()
    )
    s["colocated"]["samples_per_s_per_gpu"] = rate / world
    return rate


def _pipeline(
    s: dict,
    layout: dict,
    target_rate: float | None,
    drafter_rate: float | None,
    system_mfu: Callable[[float | None], float | None],
) -> dict:
    """The pipeline against the layout's stage capacities (every replica's rate and every drafter
    rank's, summed): its efficiency, also written into the section, and which stage bounds it."""
    rate = _get(s, "pipeline", "samples_per_s")
    targets = _stage_total(s.get("target_only"), "per_replica", target_rate, len(layout["replicas"]))
    drafters = _stage_total(s.get("drafter_only"), "per_rank", drafter_rate, layout["drafters"])
    bottleneck = min(targets, drafters) if targets and drafters else None
    efficiency = rate / bottleneck if rate and bottleneck else None
    if efficiency is not None:
        s["pipeline"]["efficiency"] = efficiency
        s["pipeline"]["efficiency_definition"] = (
            "pipeline samples/s / min(target-only samples/s of all replicas, drafter-only samples/s "
            "of all drafter ranks)"
        )
    return {
        "samples_per_s": rate,
        "tokens_per_s": _get(s, "pipeline", "tokens_per_s"),
        "efficiency": efficiency,
        "bottleneck": None if not bottleneck else ("target" if targets <= drafters else "drafter"),
        "targets_samples_per_s": targets,
        "drafters_samples_per_s": drafters,
        "system_mfu": system_mfu(rate),
        "target_busy_frac": _get(s, "pipeline", "target_busy_frac"),
        "drafter_busy_frac": _get(s, "pipeline", "drafter_busy_frac"),
    }


def _useful_flops_per_sample(s: dict, micro_batch: int) -> float | None:
    """The target's forward and the drafter's step per sample."""
    target_flops = _get(s, "setup", "target", "flops_per_seq")
    drafter_flops_mb = _get(s, "setup", "drafter", "flops_per_micro_batch")
    if target_flops is None or not drafter_flops_mb:
        return None
    return target_flops + drafter_flops_mb / micro_batch


def _peak_memory_gb(s: dict, setup: dict) -> dict:
    """The peak of each role's rank in its own section and in the pipeline, and of colocated's two."""
    target_rank, drafter_rank = rank_of(setup, "target"), rank_of(setup, "drafter")
    memory = {}
    for label, section, rank in (
        ("target_only", "target_only", target_rank),
        ("target_in_pipeline", "pipeline", target_rank),
        ("drafter_only", "drafter_only", drafter_rank),
        ("drafter_in_pipeline", "pipeline", drafter_rank),
        ("colocated_rank0", "colocated", "0"),
        ("colocated_rank1", "colocated", "1"),
    ):
        report = _get(s, section, "per_rank", rank, "memory") or {}
        memory[label] = report.get("peak_allocated_gb", report.get("host_peak_rss_gb"))
    return memory


def _peak_memory_gb_per_gpu(s: dict) -> dict[str, float]:
    """Every rank's highest peak over the layout's own sections (LAYOUT_SECTIONS)."""
    peaks: dict[str, float] = {}
    for name in LAYOUT_SECTIONS:
        for rank, entry in ((s.get(name) or {}).get("per_rank") or {}).items():
            report = (entry or {}).get("memory") or {}
            peak = report.get("peak_allocated_gb", report.get("host_peak_rss_gb"))
            if peak is not None:
                peaks[rank] = max(peaks.get(rank, 0.0), peak)
    return peaks


def _recompiles_after_warmup(s: dict) -> tuple[dict, dict]:
    """Recompilations after the warmup: per timed section, and per pipeline rank."""
    per_section = {
        "drafter_only": _get(s, "drafter_only", "recompiles_after_warmup"),
        "target_only": _get(s, "target_only", "recompiles_after_warmup"),
        "pipeline_drafter": _get(s, "pipeline", "recompiles_after_warmup"),
        "colocated_rank0": _get(s, "colocated", "per_rank", "0", "recompiles_after_warmup"),
        "colocated_rank1": _get(s, "colocated", "per_rank", "1", "recompiles_after_warmup"),
    }
    pipeline_per_rank = {
        rank: entry.get("recompiles_after_warmup", entry.get("target_recompiles_after_warmup"))
        for rank, entry in (_get(s, "pipeline", "per_rank") or {}).items()
        if "recompiles_after_warmup" in entry or "target_recompiles_after_warmup" in entry
    }
    return per_section, pipeline_per_rank


def _picked(section: dict | None, keys: tuple[str, ...]) -> dict:
    return {key: _get(section, key) for key in keys}


def summarize(merged: dict) -> dict:
    """Headline numbers (a pure function of the sections; None where a section did not run)."""
    s, setup = merged["sections"], merged["setup"]
    layout = layout_of(setup)
    k, world = layout["target_parallel"], setup.get("world_size", 2)
    peaks, sustained = _matmul_tflops(s)
    target_rate = _get(s, "target_only", "samples_per_s")
    drafter_rate = _get(s, "drafter_only", "samples_per_s")
    colocated_rate = _colocated_rate(s, world)
    per_sample = _useful_flops_per_sample(s, setup["micro_batch"])
    total_peak = sum(peaks.values()) * 1e12 if len(peaks) == world and all(peaks.values()) else None

    def system_mfu(rate: float | None) -> float | None:
        return rate * per_sample / total_peak if rate and per_sample and total_peak else None

    pipeline = _pipeline(s, layout, target_rate, drafter_rate, system_mfu)
    pipeline_rate = pipeline["samples_per_s"]

    recompiles, pipeline_recompiles = _recompiles_after_warmup(s)
    projection = projection_of_8(target_rate, drafter_rate, k) if target_rate and drafter_rate else None
    drafter_only = s.get("drafter_only")
    summary = {
        "layout": layout["name"],
        "matmul_peak_tflops": peaks,
        "matmul_sustained_tflops": sustained,
        "target_only": {"samples_per_s": target_rate} | _picked(s.get("target_only"), ("ms_per_seq", "mfu")),
        "drafter_only": {"samples_per_s": drafter_rate}
        | _picked(
            drafter_only,
            ("ms_per_step", "mfu", "mfu_head_as_trainable", "mfu_at_sustained_matmul_rate"),
        )
        | _picked(_get(drafter_only, "power"), ("energy_j_per_step", "mean_power_w", "power_capped_share")),
        "transport": _picked(s.get("transport"), ("gb_per_s", "msgs_per_s", "raw_gb_per_s", "raw_gib_per_s")),
        "pipeline": pipeline,
        "colocated": {
            "samples_per_s": colocated_rate,
            "system_mfu": system_mfu(colocated_rate),
            "pipeline_over_colocated": pipeline_rate / colocated_rate
            if pipeline_rate and colocated_rate
            else None,
        },
        "target_parallel_check": {
            key: (s.get("target_parallel_check") or {}).get(key) for key in TP_CHECK_KEYS
        },
        # A replica's rate per GPU it takes.
        "per_gpu": per_gpu_rates(
            target_rate / k if target_rate else None,
            drafter_rate,
            colocated_rate / world if colocated_rate is not None else None,
            projection,
        ),
        "peak_memory_gb": _peak_memory_gb(s, setup),
        # GiB, as the GPU's size and the preflight's prediction are given.
        "peak_memory_gib": peak_memory_gib(merged),
        "peak_memory_gb_per_gpu": _peak_memory_gb_per_gpu(s),
        "peak_memory_kind": "torch.cuda.max_memory_allocated"
        if setup["device"] == "cuda"
        else "host peak RSS (CPU run)",
        "time_to_first_step_s": {
            "drafter_cold_compile": _get(s, "drafter_only", "first_step_s"),
            "process_start_to_first_drafter_step": _get(s, "drafter_only", "process_start_to_first_step_s"),
            "pipeline": _get(s, "pipeline", "time_to_first_step_s"),
            "colocated_rank0": _get(s, "colocated", "per_rank", "0", "first_step_s"),
        },
        "recompiles_after_warmup": recompiles,
        "recompiles_after_warmup_pipeline_per_rank": pipeline_recompiles,
        "useful_flops_per_sample": per_sample,
        "projection_8_gpus": projection,
        "profile": _picked(
            s.get("profile"),
            ("wall_ms_per_step", "device_ms_per_step", "idle_ms_per_step", "phases_ms_per_step"),
        ),
        "statuses": {name: sec.get("status") for name, sec in s.items()},
    }
    if setup.get("world_size") == 1:
        summary["peak_memory_note"] = (
            "1 rank plays both roles: each section's peak includes the other role's resident objects"
        )
    return summary
