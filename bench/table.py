"""The benchmark's console table: the headline numbers of `summary.summarize`, memory, the profile."""

from __future__ import annotations

from layout import layout_of, rank_of
from summary import summarize


def profile_lines(section: dict) -> list[str]:
    """The profile section as table lines: device ms per step by phase, then the top kernels."""
    if section.get("status") != "ok" or "phases_ms_per_step" not in section:
        return []
    device, wall = section["device_ms_per_step"], section["wall_ms_per_step"]
    lines = [
        f"profile: drafter step ({section['steps']} profiled, {section['device']}): wall {wall:.1f} ms, "
        f"device {device:.1f} ms ({section['device_time_kind']}), idle {section['idle_ms_per_step']:.1f} ms"
    ]
    for phase, ms in section["phases_ms_per_step"].items():
        share = section["phases_share"].get(phase)
        lines.append(f"  {phase:<24} {ms:9.2f} ms  {_fmt(share, '.1%'):>6}")
    gaps = section.get("idle_gaps")
    if gaps:
        lines.append(
            f"  idle between kernels: {gaps['all_ms_per_step']:.2f} ms in {gaps['count_per_step']:.0f} gaps, "
            f"{gaps['over_50us_ms_per_step']:.2f} ms of it in {gaps['over_50us_count_per_step']:.0f} over 50 us"
        )
    lines.append("  top kernels by device time (ms/step, calls/step, phase):")
    for kernel in section.get("top_kernels") or []:
        lines.append(
            f"  {kernel['ms_per_step']:9.2f} {kernel['calls_per_step']:7.1f}  {kernel['phase']:<22} {kernel['name'][:90]}"
        )
    return lines


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec.endswith("%"):
        return f"{value:{spec}}"
    return f"{value:{spec}}{suffix}"


def _stage_rows(sm: dict, setup: dict, layout: dict) -> list[tuple[str, str, str]]:
    """The matmul rates and each stage alone: target, drafter (its power too), transport."""
    k = layout["target_parallel"]
    target_ranks = layout["replicas"][0] if layout["replicas"] else [0]
    target_label = f"r{target_ranks[0]}" if k == 1 else f"r{target_ranks[0]}-{target_ranks[-1]}, TP={k}"
    world = setup.get("world_size", 2)
    peak_ranks = list(sm["matmul_peak_tflops"]) or [str(r) for r in range(world)]
    sustained = sm.get("matmul_sustained_tflops") or {}
    target, drafter, transport = sm["target_only"], sm["drafter_only"], sm["transport"]
    return [
        (
            "matmul peak",
            "TFLOP/s " + " | ".join(f"rank{r}" for r in peak_ranks),
            " | ".join(_fmt(v, ".1f") for v in sm["matmul_peak_tflops"].values()) or "-",
        ),
        (
            "matmul sustained",
            "TFLOP/s at the power limit " + " | ".join(f"rank{r}" for r in sustained),
            " | ".join(_fmt(v, ".1f") for v in sustained.values()) or "-",
        ),
        (
            f"target only ({target_label})",
            "samples/s | ms/seq | MFU",
            f"{_fmt(target['samples_per_s'])} | {_fmt(target['ms_per_seq'], '.1f')} | {_fmt(target['mfu'], '.1%')}",
        ),
        (
            f"drafter only (r{rank_of(setup, 'drafter') or '-'})",
            "samples/s | ms/step | MFU (head as trainable)",
            f"{_fmt(drafter['samples_per_s'])} | {_fmt(drafter['ms_per_step'], '.1f')} | "
            f"{_fmt(drafter['mfu'], '.1%')} ({_fmt(drafter['mfu_head_as_trainable'], '.1%')})",
        ),
        (
            "drafter step power",
            "J/step | mean W | power-capped share",
            f"{_fmt(drafter['energy_j_per_step'], '.1f')} | {_fmt(drafter['mean_power_w'], '.0f')} | "
            f"{_fmt(drafter['power_capped_share'], '.0%')}",
        ),
        (
            "transport",
            "msgs/s | GB/s | raw GB/s",
            f"{_fmt(transport['msgs_per_s'], '.1f')} | {_fmt(transport['gb_per_s'], '.1f')} | "
            f"{_fmt(transport['raw_gb_per_s'], '.1f')}",
        ),
    ]


def _layout_rows(sm: dict, world: int, layout: dict) -> list[tuple[str, str, str]]:
    """The stages together: the pipeline, colocated, the tensor-parallel check, per GPU, on 8 GPUs."""
    k = layout["target_parallel"]
    pipeline, colocated = sm["pipeline"], sm["colocated"]
    per_gpu = sm.get("per_gpu") or {}
    projection = sm.get("projection_8_gpus")
    rows = [
        (
            f"pipeline {layout['targets']}t+{layout['drafters']}d" + (f" TP={k}" if k > 1 else ""),
            "samples/s | tokens/s | efficiency",
            f"{_fmt(pipeline['samples_per_s'])} | {_fmt(pipeline['tokens_per_s'], '.0f')} | "
            f"{_fmt(pipeline['efficiency'], '.2f')} (bottleneck {pipeline['bottleneck'] or '-'})",
        ),
        (
            "",
            "busy target | drafter, sys MFU",
            f"{_fmt(pipeline['target_busy_frac'], '.0%')} | {_fmt(pipeline['drafter_busy_frac'], '.0%')}, "
            f"{_fmt(pipeline['system_mfu'], '.1%')}",
        ),
        (
            f"colocated DDP x{world}" if world > 1 else "colocated 1 GPU",
            "samples/s total | pipeline/coloc",
            f"{_fmt(colocated['samples_per_s'])} | {_fmt(colocated['pipeline_over_colocated'], '.2f')}",
        ),
    ]
    if k > 1:
        rows.append(_tensor_parallel_row(sm.get("target_parallel_check") or {}, k))
    rows.append(
        (
            "per GPU samples/s",
            "coloc | target, drafter | ideal | split/8",
            f"{_fmt(per_gpu.get('colocated_measured'))} | {_fmt(per_gpu.get('target_stage'))}, "
            f"{_fmt(per_gpu.get('drafter_stage'))} | {_fmt(per_gpu.get('colocated_from_stage_rates'))} | "
            f"{_fmt(per_gpu.get('best_split_of_8'))} ({per_gpu.get('best_split') or '-'})",
        )
    )
    rows.append(
        (
            "8-GPU projection",
            "best split: samples/s | coloc x8",
            "-"
            if not projection
            else f"{projection['best_split']}: {projection['best_samples_per_s']:.2f} | "
            f"{projection['colocated_8_gpus_samples_per_s']:.2f} (upper bounds)",
        )
    )
    return rows


def _tensor_parallel_row(check: dict, k: int) -> tuple[str, str, str]:
    return (
        f"TP={k} vs TP=1",
        "max rel diff (ok?) | samples/s TP, TP=1 | speed-up",
        "-"
        if check.get("max_rel_diff") is None
        else f"{check['max_rel_diff']:.2e} ({'ok' if check['within_tolerance'] else 'MISMATCH'}) | "
        f"{_fmt(check['tp_samples_per_s'])}, {_fmt(check['tp1_samples_per_s'])} | "
        f"{_fmt(check['tp_speedup'], '.2f')}",
    )


def _memory_and_startup_rows(sm: dict, world: int) -> list[tuple[str, str, str]]:
    """Peak memory (by role, against the prediction, per rank), the first step, the recompiles."""
    memory_keys = ("target_in_pipeline", "drafter_in_pipeline", "colocated_rank0", "colocated_rank1")
    memory_label = "target | drafter | coloc r0, r1"
    if world == 1:  # no pipeline: the standalone sections' peaks
        memory_keys = ("target_only", "drafter_only", "colocated_rank0")
        memory_label = "target only | drafter only | colocated"
    per_rank = sm.get("peak_memory_gb_per_gpu") or {}
    return [
        (
            "peak memory GB",
            memory_label,
            " | ".join(_fmt(sm["peak_memory_gb"][k], ".1f") for k in memory_keys),
        ),
        (
            "peak GiB",
            "alloc/resv (predicted): target | drafter | coloc",
            " | ".join(
                f"{_fmt(v['allocated'], '.1f')}/{_fmt(v['reserved'], '.1f')} ({_fmt(v['predicted'], '.1f')})"
                for v in (sm.get("peak_memory_gib") or {}).values()
            )
            or "-",
        ),
        (
            "peak GB per rank",
            " | ".join(f"r{r}" for r in per_rank) or "-",
            " | ".join(_fmt(v, ".1f") for v in per_rank.values()) or "-",
        ),
        (
            "first step s",
            "drafter cold | pipeline | coloc",
            " | ".join(
                _fmt(sm["time_to_first_step_s"][k], ".1f")
                for k in ("drafter_cold_compile", "pipeline", "colocated_rank0")
            ),
        ),
        (
            "recompiles",
            "after warm-up",
            ", ".join(f"{k} {'-' if v is None else v}" for k, v in sm["recompiles_after_warmup"].items()),
        ),
    ]


def _status_lines(merged: dict) -> list[str]:
    """The sections that failed or were skipped, and an abort."""
    lines = []
    for name, section in merged["sections"].items():
        if section.get("status") == "error":
            for rank, error in (section.get("errors") or {}).items():
                lines.append(f"ERROR {name} rank {rank}: {error[:300]}")
        elif section.get("status") == "skipped":
            lines.append(f"skipped {name}: {section.get('reason')}")
    if merged.get("aborted"):
        lines.append(f"ABORTED: {merged['aborted']}")
    return lines


def print_table(merged: dict) -> None:
    sm = merged.get("summary") or summarize(merged)
    shape, setup = merged["shape"], merged["setup"]
    world = setup.get("world_size", 2)
    layout = layout_of(setup)
    rows = (
        _stage_rows(sm, setup, layout) + _layout_rows(sm, world, layout) + _memory_and_startup_rows(sm, world)
    )
    title = (
        f"dflash_mp bench: {shape['name']} (target {shape['layers']}L h{shape['hidden']}, runs "
        f"{shape['target_layers_run']}; drafter {shape['draft_layers']}L; S={shape['seq_len']}, "
        f"{shape['num_anchors']} anchors x {shape['block_size']}; B={setup['micro_batch']} A={setup['grad_accum']}) "
        f"on {world}x {setup['device_name']}"
        + (f", layout {layout['name']}" if world > 2 or layout["target_parallel"] > 1 else "")
    )
    lines = [title, "-" * min(len(title), 110)]
    width = max(len(b) for _, b, _ in rows)
    lines += [f"{a:<18} {b:<{width}} {c}" for a, b, c in rows]
    lines += profile_lines(merged["sections"].get("profile") or {})
    lines += _status_lines(merged)
    print("\n".join(lines), flush=True)
