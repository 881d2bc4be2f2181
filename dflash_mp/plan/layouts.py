"""Rates and memory per layout, and the candidate layouts of N GPUs that fit.

A stage number is measured when the benchmark ran the planned shape, scaled when the benchmark ran
another shape (its time carried by the ratio of FLOPs, its activation memory by the ratio of the
activation estimates), assumed when a factor stands in for a measurement (tensor-parallel
efficiency), given by a flag, or estimated from the shape alone. The target stage (its time and
memory) comes from the target-families measurement instead where targets.py matched an entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dflash_mp.plan import PlanError
from dflash_mp.plan.costs import (
    BF16,
    ModelShape,
    Workload,
    drafter_activation_bytes,
    drafter_flops_per_sample,
    drafter_static_bytes,
    target_activation_bytes,
    target_flops,
    target_flops_per_sample,
    target_layers_run,
    target_weight_bytes,
)
from dflash_mp.plan.measured import BenchRecord
from dflash_mp.plan.targets import FamilyMatch

TP_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Number:
    """A planning input and where it came from (measured, scaled, assumed, given, estimated)."""

    value: float
    source: str
    how: str = ""


@dataclass(frozen=True)
class Options:
    """The plan's settings (cli.py fills them from the flags)."""

    gpus: int
    usable_gb: float
    tp_efficiency: float = 0.85
    pipeline_efficiency: float | None = None
    target_ms: float | None = None
    drafter_ms: float | None = None


@dataclass
class StageModel:
    """Per-sample rates and per-GPU memory of the planned target and its drafter."""

    target_rate: dict[int, Number]  # samples/s of one replica, by tensor-parallel width
    drafter_rate: Number
    colocated_rate: Number  # samples/s per GPU
    efficiency: Number
    target_gb: dict[int, Number]  # per target rank, by tensor-parallel width
    drafter_gb: Number
    colocated_gb: Number
    refused_widths: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    layout: str
    samples_per_s: float
    targets: int
    drafters: int
    target_parallel: int
    target_gb: float | None  # None: colocated (every GPU holds both, see drafter_gb)
    gpu_gb: float  # the fullest GPU
    limited_by: str
    overrides: str


def _same(shape: ModelShape, workload: Workload, bench: BenchRecord | None) -> bool:
    return bench is not None and bench.shape == shape and bench.workload == workload


def _rate(ms: float | None, flag: str, measured: float | None, flops_ratio: float, same: bool) -> Number:
    if ms is not None:
        return Number(1e3 / ms, "given", f"{flag} {ms:g}")
    assert measured is not None  # the caller checked
    if same:
        return Number(measured, "measured")
    return Number(measured / flops_ratio, "scaled", f"{measured:.2f} x FLOPs ratio {1 / flops_ratio:.3f}")


def _memory(
    static: float,
    activation: float,
    bench_static: float,
    bench_activation: float,
    peak_gb: float | None,
    same: bool,
) -> Number:
    """GB on one GPU: weights/state from the shape + activations, calibrated on a measured peak."""
    if peak_gb is not None and same:
        return Number(peak_gb, "measured")
    measured_activation = (peak_gb or 0) * 1e9 - bench_static
    if peak_gb is None or measured_activation <= 0:
        return Number((static + activation) / 1e9, "estimated", "weights + activation estimate")
    scale = measured_activation / bench_activation
    return Number(
        (static + activation * scale) / 1e9, "scaled", f"activation estimate x {scale:.2f} (measured)"
    )


def _family_rate(family: FamilyMatch, shape: ModelShape, workload: Workload) -> Number:
    record = family.record
    rate = 1e3 / record.target_ms
    if family.exact:
        return Number(rate, "measured", f"{record.where()}: target stage {record.target_ms:.1f} ms")
    planned = target_flops(shape, target_layers_run(shape, workload), workload.seq_len)
    ratio = target_flops(family.record_shape, record.layers_run, record.seq_len) / planned
    how = f"{record.where()}: {record.target_ms:.1f} ms x FLOPs ratio {1 / ratio:.3f} (active parameters)"
    return Number(rate * ratio, "scaled", how)


def _family_memory(family: FamilyMatch, shape: ModelShape, workload: Workload, k: int) -> Number:
    """One target rank's GB: the entry's measured peak (weights + activations at one sequence)."""
    record = family.record
    if record.peak_gb is None:  # a CPU run measures no peak
        weights, activation = (
            target_weight_bytes(shape, workload, k),
            target_activation_bytes(shape, workload, k),
        )
        return Number((weights + activation) / 1e9, "estimated", "weights + activation estimate")
    activation = (record.peak_gb - record.weights_gb) * workload.micro_batch
    if family.exact:
        if k == 1 and workload.micro_batch == 1:
            return Number(record.peak_gb, "measured", f"{record.where()}: target stage peak")
        layers = BF16 * record.params_run / 1e9
        value = record.weights_gb - layers + layers / k + activation
        return Number(value, "scaled", f"{record.entry}'s measured peak, its layers' weights / {k}")
    tokens_x_width = workload.seq_len * shape.hidden / (record.seq_len * family.record_shape.hidden)
    value = target_weight_bytes(shape, workload, k) / 1e9 + activation * tokens_x_width
    how = f"weights counted / {k} + {record.entry}'s measured activation x tokens x width"
    return Number(value, "scaled", how)


def stage_model(
    shape: ModelShape,
    workload: Workload,
    bench: BenchRecord | None,
    opts: Options,
    family: FamilyMatch | None = None,
    refused_by_plan: dict[int, str] | None = None,
) -> StageModel:
    """Everything the layouts need, each number with its source; missing rates raise PlanError.

    `refused_by_plan`: widths the target's tensor-parallel plan cannot split, with why."""
    _require_rates(bench, opts, family)
    same = _same(shape, workload, bench)
    b_shape = bench.shape if bench else shape
    b_workload = bench.workload if bench else workload
    from_family = family is not None and opts.target_ms is None
    measured_k = bench.target_parallel if bench and opts.target_ms is None and not from_family else 1
    t_ratio = target_flops_per_sample(shape, workload) / target_flops_per_sample(b_shape, b_workload)
    if from_family:
        base = _family_rate(family, shape, workload)
    else:
        base = _rate(opts.target_ms, "--target-ms", bench and bench.target_rate, t_ratio, same)
    d_ratio = drafter_flops_per_sample(shape, workload) / drafter_flops_per_sample(b_shape, b_workload)
    drafter = _rate(opts.drafter_ms, "--drafter-ms", bench and bench.drafter_rate, d_ratio, same)

    refused = _refused_widths(shape, refused_by_plan)
    target_rate = _target_rates(base, measured_k, refused, opts)
    colocated = _colocated_rate(bench, same, 1 / target_rate[1].value + 1 / drafter.value)
    target_gb = _target_memory(shape, workload, bench, family, same, widths=target_rate)
    drafter_gb = _memory(
        drafter_static_bytes(shape, workload),
        drafter_activation_bytes(shape, workload),
        drafter_static_bytes(b_shape, b_workload),
        drafter_activation_bytes(b_shape, b_workload),
        bench.drafter_peak_gb if bench else None,
        same,
    )
    if family is not None:
        total = target_gb[1].value + drafter_gb.value
        colocated_gb = Number(total, "scaled", "target (families measurement) + drafter")
    else:
        colocated_gb = _colocated_memory(shape, workload, bench, same, drafter_gb)
    efficiency = _pipeline_efficiency(bench, opts)
    return StageModel(
        target_rate, drafter, colocated, efficiency, target_gb, drafter_gb, colocated_gb, refused
    )


def _require_rates(bench: BenchRecord | None, opts: Options, family: FamilyMatch | None) -> None:
    """Each stage needs a rate from a flag or a measurement; name the flag or section that gives it."""
    for given, measured, section, flag in (
        (opts.target_ms, family or (bench and bench.target_rate), "target_only", "--target-ms"),
        (opts.drafter_ms, bench and bench.drafter_rate, "drafter_only", "--drafter-ms"),
    ):
        if given is None and not measured:
            raise (
                bench.missing(section, flag)
                if bench
                else PlanError(f"no {section} rate: pass --bench or {flag}")
            )


def _refused_widths(shape: ModelShape, refused_by_plan: dict[int, str] | None) -> dict[int, str]:
    """The tensor-parallel widths the heads, the experts or the target's own plan cannot split."""
    refused = {
        k: f"{shape.heads} attention / {shape.kv_heads} KV heads do not divide by {k}"
        for k in TP_WIDTHS
        if shape.heads % k or shape.kv_heads % k
    }
    refused |= {
        k: f"the experts' intermediate width {shape.expert_width} does not divide by {k}"
        for k in TP_WIDTHS
        if k not in refused and shape.expert_width % k
    }
    refused |= {k: why for k, why in (refused_by_plan or {}).items() if k not in refused}
    return refused


def _target_rates(base: Number, measured_k: int, refused: dict[int, str], opts: Options) -> dict[int, Number]:
    """One replica's rate at each width left, carried from the width `base` was measured at."""

    def tp_factor(k: int) -> float:  # throughput of a k-wide replica relative to one GPU
        return k * (opts.tp_efficiency if k > 1 else 1.0)

    target_rate = {}
    # Widths up to the GPUs left beside one drafter; TP=1 always (colocated uses its rate).
    for k in (k for k in TP_WIDTHS if k not in refused and (k == 1 or k < opts.gpus)):
        if k == measured_k:
            target_rate[k] = base
        else:
            value = base.value * tp_factor(k) / tp_factor(measured_k)
            how = f"{k} GPUs x {opts.tp_efficiency:g} (--tp-efficiency) x the TP={measured_k} rate"
            target_rate[k] = Number(value, "assumed", how if k > 1 else f"TP={measured_k} rate / its factor")
    return target_rate


def _target_memory(
    shape: ModelShape,
    workload: Workload,
    bench: BenchRecord | None,
    family: FamilyMatch | None,
    same: bool,
    widths: Iterable[int],
) -> dict[int, Number]:
    """One target rank's GB at each width: from the families measurement, else from the benchmark."""
    b_shape = bench.shape if bench else shape
    b_workload = bench.workload if bench else workload
    b_k = bench.target_parallel if bench else 1
    return {
        k: _family_memory(family, shape, workload, k)
        if family is not None
        else _memory(
            target_weight_bytes(shape, workload, k),
            target_activation_bytes(shape, workload, k),
            target_weight_bytes(b_shape, b_workload, b_k),
            target_activation_bytes(b_shape, b_workload, b_k),
            bench.target_peak_gb if bench else None,
            same and k == b_k,
        )
        for k in widths
    }


def _pipeline_efficiency(bench: BenchRecord | None, opts: Options) -> Number:
    if opts.pipeline_efficiency is not None:
        return Number(opts.pipeline_efficiency, "given", "--efficiency")
    if bench and bench.pipeline_efficiency:
        return Number(min(bench.pipeline_efficiency, 1.0), "measured", "pipeline / slower stage at 1+1")
    return Number(1.0, "assumed", "no pipeline measurement")


def _colocated_rate(bench: BenchRecord | None, same: bool, stage_time: float) -> Number:
    measured = bench.colocated_rate_per_gpu if bench else None
    if same and measured:
        return Number(measured, "measured", f"per GPU, at {bench.world_size} GPU(s)")
    if measured and bench.target_rate and bench.drafter_rate:
        # The measured colocated rate against 1 / (t_target + t_drafter) on the benchmark's shape.
        overlap = measured * (1 / bench.target_rate + 1 / bench.drafter_rate)
        return Number(
            overlap / stage_time, "scaled", f"1 / (t_target + t_drafter) x {overlap:.2f} (measured)"
        )
    return Number(1 / stage_time, "estimated", "1 / (t_target + t_drafter)")


def _colocated_memory(
    shape: ModelShape, workload: Workload, bench: BenchRecord | None, same: bool, drafter_gb: Number
) -> Number:
    measured = bench.colocated_peak_gb if bench else None
    if same and measured:
        return Number(measured, "measured")
    target_bytes = target_weight_bytes(shape, workload) + target_activation_bytes(shape, workload)
    total = target_bytes / 1e9 + drafter_gb.value
    if measured:
        # The measured colocated peak against the two roles' estimates on the benchmark's shape.
        b, w = bench.shape, bench.workload
        roles = (target_weight_bytes(b, w) + target_activation_bytes(b, w)) / 1e9
        roles += (drafter_static_bytes(b, w) + drafter_activation_bytes(b, w)) / 1e9
        return Number(
            total * measured / roles, "scaled", f"target + drafter x {measured / roles:.2f} (measured)"
        )
    return Number(total, "estimated", "target + drafter")


def _usable(gb: float, opts: Options) -> bool:
    return gb <= opts.usable_gb


def candidates(stage: StageModel, opts: Options) -> tuple[list[Candidate], list[str]]:
    """Every layout of opts.gpus GPUs that fits, best first, and why the others were left out."""
    found: list[Candidate] = []
    left_out: list[str] = []
    usable = f"{opts.usable_gb:.1f} GB usable"
    n = opts.gpus
    if not _usable(stage.colocated_gb.value, opts):
        left_out.append(f"colocated: target + drafter {stage.colocated_gb.value:.1f} GB per GPU > {usable}")
    else:
        found.append(
            Candidate(
                layout="colocated",
                samples_per_s=n * stage.colocated_rate.value,
                targets=0,
                drafters=n,
                target_parallel=1,
                target_gb=None,
                gpu_gb=stage.colocated_gb.value,
                limited_by="both stages on every GPU",
                overrides="topology=colocated",
            )
        )
    drafter_gb = stage.drafter_gb.value
    if not _usable(drafter_gb, opts):
        left_out.append(f"every split: drafter rank {drafter_gb:.1f} GB > {usable}")
    if n < 2:
        left_out.append(f"splits: need 2 GPUs or more (a target and a drafter), have {n}")
    for k in TP_WIDTHS if n >= 2 else ():
        if k in stage.refused_widths:
            if k > 1:
                left_out.append(f"TP={k}: {stage.refused_widths[k]}")
            continue
        if k + 1 > n:
            # Worth saying only when no narrower replica fits: then this width was the way out.
            if not any(_usable(gb.value, opts) for gb in stage.target_gb.values()):
                left_out.append(f"TP={k}: needs {k} target + 1 drafter GPUs, have {n}")
            break
        target_gb = stage.target_gb[k].value
        if not _usable(target_gb, opts):
            left_out.append(f"TP={k}: target rank {target_gb:.1f} GB > {usable}")
            continue
        if not _usable(drafter_gb, opts):
            continue
        for replicas in range(1, (n - 1) // k + 1):
            targets = replicas * k
            drafters = n - targets
            target_side = replicas * stage.target_rate[k].value
            drafter_side = drafters * stage.drafter_rate.value
            overrides = f"topology.targets={targets} topology.drafters={drafters}"
            layout = f"{targets}t{drafters}d"
            if k > 1:
                overrides += f" topology.target_parallel={k}"
                layout += f" TP={k} ({replicas} replica{'s' if replicas > 1 else ''})"
            found.append(
                Candidate(
                    layout,
                    min(target_side, drafter_side) * stage.efficiency.value,
                    targets,
                    drafters,
                    k,
                    target_gb,
                    max(target_gb, drafter_gb),
                    "targets" if target_side < drafter_side else "drafters",
                    overrides,
                )
            )
    found.sort(key=lambda c: -c.samples_per_s)
    return found, left_out
