"""`python -m dflash_mp.plan`: arguments, the plan as a table or JSON, exit codes (0 planned, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_mp.config.schema import CONF_DIR
from dflash_mp.plan import PlanError
from dflash_mp.plan.costs import ModelShape, Workload, target_layer_params, target_layers_run, target_params
from dflash_mp.plan.layouts import TP_WIDTHS, Candidate, Options, StageModel, candidates, stage_model
from dflash_mp.plan.measured import BenchRecord, FamilyRecord, gpu_memory_gb, read_bench, read_families
from dflash_mp.plan.targets import DEFAULT_FAMILIES, FamilyMatch, match_family, resolve_target

# Without a benchmark JSON: the paper recipe (conf/experiment/paper.yaml, conf/model/qwen3-8b.yaml).
PAPER_WORKLOAD = Workload(seq_len=3072, num_anchors=512, block_size=16, draft_layers=5, micro_batch=1)
# The bundled benchmark (the Makefile's BENCH): Qwen3-8B's stage rates on H200, the plan's default.
DEFAULT_BENCH = DEFAULT_FAMILIES.parent / "h200x2-qwen3-8b.json"
# Two layouts closer than this are within the benchmark's run-to-run spread (BENCHMARKS.md: ~3-5%).
SPREAD = 0.05


@dataclass
class Plan:
    gpus: int
    gpu_memory_gb: float
    usable_gb: float
    shape: ModelShape
    workload: Workload
    bench: str | None
    bench_is_default: bool  # --bench left out: the bundled benchmark
    experiment: str  # experiment= (and model.target_path=) that launches this target
    stage: StageModel
    candidates: list[Candidate]
    left_out: list[str]
    eval_target_gb: float  # the whole target, which the first drafter rank loads to evaluate tau
    target_source: str  # where the target's shape came from
    config: dict  # the target's config.json numbers ({} for the benchmark's shape)
    family: FamilyMatch | None  # the target-families entry its target stage comes from
    target_mfu: float | None  # the target stage's measured MFU (assumed, when scaled from an entry)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mp.plan",
        description="Candidate layouts of N GPUs (colocated, T:D splits, tensor-parallel target replicas) "
        "with expected samples/s and memory per GPU, from the benchmark's measured stage rates. "
        "`python -m dflash_mp.plan memory --help`: a training config's peak memory per rank, term by term.",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs the job gets (world size)")
    p.add_argument(
        "--bench",
        default=str(DEFAULT_BENCH) if DEFAULT_BENCH.is_file() else None,
        help="bench/bench.py result JSON: stage rates, peak memories, device, shape (default: the bundled "
        f"{DEFAULT_BENCH.relative_to(DEFAULT_BENCH.parents[2])}, Qwen3-8B on H200, where present)",
    )
    p.add_argument(
        "--target",
        help="the target: its HF directory (config.json), 'embedded', a preset (conf/experiment: "
        "qwen3.5-9b, gpt-oss-120b, ...) or an entry of --families; default: the bench shape",
    )
    p.add_argument(
        "--families",
        default=str(DEFAULT_FAMILIES) if DEFAULT_FAMILIES.is_file() else None,
        help="bench/target_families.py result JSON: the target stage per family "
        f"(default: {DEFAULT_FAMILIES.relative_to(DEFAULT_FAMILIES.parents[2])} where present)",
    )
    p.add_argument(
        "--gpu-memory-gb", type=float, help="memory per GPU; default: from the bench JSON's device name"
    )
    p.add_argument(
        "--usable-fraction", type=float, default=0.9, help="share of GPU memory a layout may plan on"
    )
    p.add_argument(
        "--tp-efficiency", type=float, default=0.85, help="assumed speed-up per GPU of a TP replica"
    )
    p.add_argument(
        "--efficiency", type=float, help="pipeline efficiency of splits; default: measured, else 1.0"
    )
    p.add_argument(
        "--target-ms", type=float, help="target forward ms per sample (replaces the measured rate)"
    )
    p.add_argument("--drafter-ms", type=float, help="drafter step ms per sample (replaces the measured rate)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    problems = []
    if args.gpus < 1:
        problems.append(f"--gpus {args.gpus}: must be at least 1")
    if not 0 < args.usable_fraction <= 1:
        problems.append(f"--usable-fraction {args.usable_fraction}: must be in (0, 1]")
    if not 0 < args.tp_efficiency <= 1:
        problems.append(f"--tp-efficiency {args.tp_efficiency}: must be in (0, 1]")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency {args.efficiency}: must be in (0, 1]")
    for flag, value in (("--target-ms", args.target_ms), ("--drafter-ms", args.drafter_ms)):
        if value is not None and value <= 0:
            problems.append(f"{flag} {value}: must be positive")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        problems.append(f"--gpu-memory-gb {args.gpu_memory_gb}: must be positive")
    if not args.bench and not (args.target and args.drafter_ms and args.gpu_memory_gb):
        problems.append(
            f"--bench FILE is needed (a bench/bench.py JSON; the bundled {DEFAULT_BENCH} is not in this "
            "checkout), or all of --target, --drafter-ms and --gpu-memory-gb (and --target-ms where "
            "--families has no entry for the target)"
        )
    if problems:
        raise PlanError("; ".join(problems))


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan for parsed arguments; bad input raises PlanError before anything is computed."""
    _check(args)
    bench: BenchRecord | None = read_bench(args.bench) if args.bench else None
    families: dict[str, FamilyRecord] = read_families(args.families) if args.families else {}
    bench_workload = bench.workload if bench else PAPER_WORKLOAD
    family, refused_by_plan, config = None, {}, {}
    if args.target:
        planned = resolve_target(args.target, families, bench_workload.micro_batch)
        shape, target_source = planned.shape, planned.source
        workload = planned.workload or bench_workload
        family = match_family(planned, workload, families)
        refused_by_plan = planned.refused_widths(TP_WIDTHS)
        config = planned.config
    else:
        shape, workload, target_source = bench.shape, bench_workload, f"--bench {bench.path}"
    memory = args.gpu_memory_gb or (
        gpu_memory_gb(bench.device_name) if bench and bench.device == "cuda" else None
    )
    if memory is None:
        raise PlanError(
            f"--gpu-memory-gb is needed: the benchmark ran on {bench.device_name or bench.device!r}, "
            "whose memory per GPU the plan does not know"
        )
    opts = Options(
        gpus=args.gpus,
        usable_gb=memory * args.usable_fraction,
        tp_efficiency=args.tp_efficiency,
        pipeline_efficiency=args.efficiency,
        target_ms=args.target_ms,
        drafter_ms=args.drafter_ms,
    )
    stage = stage_model(shape, workload, bench, opts, family, refused_by_plan)
    target_mfu = None  # measured (or, scaled from a families entry, the entry's)
    if family is not None and args.target_ms is None:
        target_mfu = family.record.mfu
    elif bench and stage.target_rate[1].source == "measured":
        target_mfu = bench.target_mfu
    found, left_out = candidates(stage, opts)
    return Plan(
        gpus=args.gpus,
        gpu_memory_gb=memory,
        usable_gb=opts.usable_gb,
        shape=shape,
        workload=workload,
        bench=args.bench,
        bench_is_default=args.bench is not None and args.bench == str(DEFAULT_BENCH),
        experiment=experiment_overrides(args.target, bench.shape.name if bench else None),
        stage=stage,
        candidates=found,
        left_out=left_out,
        eval_target_gb=2 * target_params(shape) / 1e9,
        target_source=target_source,
        config=config,
        family=family,
        target_mfu=target_mfu,
    )


def workload_overrides(w: Workload) -> str:
    """The config the rates were measured at: a run with other values trains at other rates."""
    return (
        f"data.max_length={w.seq_len} data.num_anchors={w.num_anchors} model.block_size={w.block_size} "
        f"model.draft_layers={w.draft_layers} train.micro_batch_size={w.micro_batch}"
    )


def _is_preset(name: str) -> bool:
    return bool(name) and (CONF_DIR / "experiment" / f"{name}.yaml").is_file()


def experiment_overrides(target: str | None, bench_shape: str | None) -> str:
    """The experiment (and target directory) a launch of the planned target takes: its preset, or
    `custom` with the directory (TARGET_DIR where the plan had none: a families entry, a benchmark
    shape without a preset)."""
    custom = "experiment=custom model.target_path="
    if target is None:  # the benchmark's shape, e.g. "qwen3-8b (benchmark shape)"
        name = (bench_shape or "").split(" (")[0]
        return f"experiment={name}" if _is_preset(name) else custom + "TARGET_DIR"
    if target == "embedded":
        return "experiment=embedded"
    if Path(target).exists():
        path = Path(target).resolve()
        return custom + str(path.parent if path.name == "config.json" else path)
    return f"experiment={target}" if _is_preset(target) else custom + "TARGET_DIR"


def launch_command(plan: Plan, best: Candidate) -> str:
    return f"torchrun --nproc-per-node {plan.gpus} -m dflash_mp.train {plan.experiment} {best.overrides} ..."


def _input_rows(stage: StageModel) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        (f"target rate TP={k}, samples/s per replica", n) for k, n in stage.target_rate.items()
    ]
    rows += [
        ("drafter rate, samples/s per rank", stage.drafter_rate),
        ("colocated rate, samples/s per GPU", stage.colocated_rate),
        ("pipeline efficiency of splits", stage.efficiency),
    ]
    rows += [(f"target rank TP={k}, GB", n) for k, n in stage.target_gb.items()]
    rows += [("drafter rank, GB", stage.drafter_gb), ("colocated GPU, GB", stage.colocated_gb)]
    return rows


def target_stage(plan: Plan) -> dict:
    """Where the target stage's time came from: the families entry (measured or extrapolated), or not."""
    rate = plan.stage.target_rate[1]
    stage = {"source": rate.source, "how": rate.how, "ms": 1e3 / rate.value, "mfu": plan.target_mfu}
    if plan.family is None or rate.source == "given":
        return stage
    record = plan.family.record
    active_run = target_layers_run(plan.shape, plan.workload) * target_layer_params(plan.shape, active=True)
    return {
        **stage,
        "file": record.path,
        "entry": record.entry,
        "entry_ms": record.target_ms,
        "kernels": record.kernels,
        "device": record.device_name,
        "entry_active_params_run": record.active_params_run,
        "active_params_run": active_run,
    }


def _stage_line(plan: Plan) -> str:
    stage = target_stage(plan)
    if "entry" not in stage:
        return f"target stage: {stage['source']} ({stage['how'] or 'the benchmark ran this shape'})"
    where = f"{stage['file']} entry {stage['entry']!r}"
    kernels = ", ".join(f"{kind} {name}" for kind, name in stage["kernels"].items())
    mfu = f"MFU {stage['mfu']:.2f}" if stage["mfu"] else "MFU not measured"
    if plan.family.exact:
        return (
            f"target stage: measured, {where}: {stage['ms']:.1f} ms per {plan.workload.seq_len}-token "
            f"sequence on {stage['device']}, {mfu}; kernels: {kernels}"
        )
    return (
        f"target stage: extrapolated from {where} ({stage['entry_ms']:.1f} ms, "
        f"{stage['entry_active_params_run'] / 1e9:.2f}B active parameters run) by FLOPs (active parameters "
        f"x tokens): {stage['active_params_run'] / 1e9:.2f}B active run -> {stage['ms']:.1f} ms at the "
        f"entry's {mfu}; kernels as the entry: {kernels}"
    )


def render_text(plan: Plan) -> str:
    w, s = plan.workload, plan.shape
    active = target_layer_params(s, active=True) != target_layer_params(s)
    active_params = s.layers * target_layer_params(s, active=True) / 1e9
    lines = [
        f"Plan for {plan.gpus} GPU(s) of {plan.gpu_memory_gb:g} GB ({plan.usable_gb:.1f} GB usable, --usable-fraction)",
        f"target {s.name or 'from --target'} ({plan.target_source}): {target_params(s) / 1e9:.1f}B parameters"
        + (f" ({active_params:.1f}B active in its layers)" if active else "")
        + f", hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads; sample: {w.seq_len} tokens, "
        f"{w.num_anchors} anchors x block {w.block_size}, {w.draft_layers} draft layers, micro-batch {w.micro_batch}"
        + (f"; rates from {plan.bench}" if plan.bench else "")
        + (
            " (the bundled benchmark, --bench's default; --bench FILE for your own)"
            if plan.bench_is_default
            else ""
        ),
        _stage_line(plan),
        "",
        f"{'input':<44} {'value':>8}  source",
    ]
    for label, number in _input_rows(plan.stage):
        how = f" ({number.how})" if number.how else ""
        lines.append(f"{label:<44} {number.value:>8.2f}  {number.source}{how}")
    lines += ["", f"{'layout':<26} {'samples/s':>9}  {'GB per GPU':<22} {'limited by':<24} overrides"]
    for c in plan.candidates:
        memory = (
            f"{c.gpu_gb:.1f} each"
            if c.target_gb is None
            else f"T {c.target_gb:.1f} / D {plan.stage.drafter_gb.value:.1f}"
        )
        lines.append(f"{c.layout:<26} {c.samples_per_s:>9.2f}  {memory:<22} {c.limited_by:<24} {c.overrides}")
    if plan.left_out:
        lines += ["", "left out:"] + [f"  {reason}" for reason in plan.left_out]
    whole = plan.stage.target_gb[1].value
    if whole > plan.usable_gb:
        lines.append(
            f"the target does not fit one GPU ({whole:.1f} GB at TP=1 > {plan.usable_gb:.1f} GB usable): "
            "only tensor-parallel replicas (topology.target_parallel >= 2) can run it"
        )
    lines.append("")
    if not plan.candidates:
        lines.append(
            "no layout fits: more memory per GPU (--gpu-memory-gb), more GPUs, or a smaller workload"
        )
        return "\n".join(lines)
    best = plan.candidates[0]
    lines += [
        f"best: {best.layout}, {best.samples_per_s:.2f} samples/s",
        f"  {launch_command(plan, best)}",
        f"  (the rates hold at {workload_overrides(plan.workload)}, every sequence full length)",
    ]
    close = [c for c in plan.candidates[1:] if c.samples_per_s >= best.samples_per_s * (1 - SPREAD)]
    if close:
        names = ", ".join(f"{c.layout} ({c.samples_per_s:.2f})" for c in close)
        lines.append(
            f"  within {SPREAD:.0%}, inside the benchmark's run-to-run spread: {names}; measure both"
        )
    drafter_gb = best.gpu_gb if best.target_gb is None else plan.stage.drafter_gb.value
    with_eval = drafter_gb + plan.eval_target_gb
    verdict = "fits" if with_eval <= plan.usable_gb else "does not fit: set eval.every=0, or evaluate offline"
    lines.append(
        f"note: with eval.every > 0 the first drafter rank also loads the whole target to measure tau "
        f"({plan.eval_target_gb:.1f} GB more, {with_eval:.1f} GB): {verdict}"
    )
    lines.append(
        "note: rates are from standalone stages; transport and DDP costs beyond the measured efficiency are not modelled"
    )
    return "\n".join(lines)


def plan_dict(plan: Plan) -> dict:
    best = plan.candidates[0] if plan.candidates else None
    return {
        "gpus": plan.gpus,
        "gpu_memory_gb": plan.gpu_memory_gb,
        "usable_gb": plan.usable_gb,
        "target": {**asdict(plan.shape), "params": target_params(plan.shape)},
        "workload": asdict(plan.workload),
        "workload_overrides": workload_overrides(plan.workload),
        "bench": plan.bench,
        "bench_is_default": plan.bench_is_default,
        "experiment": plan.experiment,
        "target_source": plan.target_source,
        "target_stage": target_stage(plan),
        "inputs": asdict(plan.stage),
        "candidates": [asdict(c) for c in plan.candidates],
        "left_out": plan.left_out,
        "best": None if best is None else {**asdict(best), "command": launch_command(plan, best)},
        "eval_target_gb": plan.eval_target_gb,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:  # `python -m dflash_mp.plan memory ...`: the peak memory per rank
        from dflash_mp.plan.memory_cli import main as memory_main

        return memory_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except PlanError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(plan), indent=1) if args.json else render_text(plan))
    return 0
