"""The table of docs/TARGETS.md (its measured target stage per family), one `plan` per family preset:
`python -m dflash_mp.plan.families_table [--gpus 8] [--bench FILE] [--families FILE]`.

Every number in it is what `python -m dflash_mp.plan --gpus N --bench FILE --target PRESET` prints
for that preset (tests/test_plan_families.py checks the file against this output).
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from dflash_mp.models.target_kernels import describe_kernels
from dflash_mp.plan import PlanError
from dflash_mp.plan.cli import Plan, make_plan, parser, target_stage
from dflash_mp.plan.targets import DEFAULT_FAMILIES

DEFAULT_BENCH = DEFAULT_FAMILIES.parent / "h200x2-qwen3-8b.json"
# (family, its presets): the first preset is the one planned; the others share its target shape.
FAMILY_PRESETS = (
    ("Qwen3 dense, 8B (the stage benchmark's shape)", ("qwen3-8b", "paper")),
    ("Qwen3.5 hybrid, 9B", ("qwen3.5-9b",)),
    ("Qwen3.5 hybrid, 27B", ("qwen3.5-27b",)),
    ("Qwen3-MoE, 30B-A3B", ("qwen3-coder-30b-a3b",)),
    ("Qwen3.5-MoE, 35B-A3B", ("qwen3.5-35b-a3b",)),
    ("Qwen3.6-MoE, 35B-A3B (Qwen3.5-35B-A3B's shape, its own drafter)", ("qwen3.6-35b-a3b",)),
    ("gpt-oss, 20B", ("gpt-oss-20b",)),
    ("gpt-oss, 120B", ("gpt-oss-120b",)),
)
HEADER = (
    "| family | preset | kernels on GPU (extra to install) | target stage ms (MFU) | from "
    "| best layout | samples/s | GB per GPU |\n|---|---|---|---|---|---|---|---|"
)


def plan_for(preset: str, gpus: int, bench: str, families: str) -> Plan:
    args = parser().parse_args(
        ["--gpus", str(gpus), "--bench", bench, "--families", families, "--target", preset]
    )
    return make_plan(args)


def _kernels(plan: Plan) -> str:
    stage = target_stage(plan)
    kernels = stage.get("kernels") or describe_kernels(SimpleNamespace(**plan.config), on_gpu=True)
    names = [f"attention {kernels['attention'].split(' (')[0]}"]
    if "linear_attention" in kernels:
        names.append("linear attention on fla")
    if "experts" in kernels:
        names.append(f"experts on {kernels['experts']}")
    extra = "`linear`" if "linear_attention" in kernels else "none"
    return f"{'; '.join(names)} ({extra})"


def row(family: str, presets: tuple[str, ...], plan: Plan) -> str:
    stage = target_stage(plan)
    mfu = stage["mfu"]
    if stage["source"] == "measured":
        timing = f"{stage['ms']:.1f} ({mfu:.2f})"
        source = f"measured: {stage['entry']}" if "entry" in stage else "measured: the stage benchmark"
    else:
        timing = f"{stage['ms']:.1f} ({mfu:.2f} assumed)" if mfu else f"{stage['ms']:.1f}"
        source = f"extrapolated from {stage['entry']}" if "entry" in stage else stage["source"]
    best = plan.candidates[0]
    memory = (
        f"{best.gpu_gb:.1f}"
        if best.target_gb is None
        else f"T {best.target_gb:.1f} / D {plan.stage.drafter_gb.value:.1f}"
    )
    names = ", ".join(f"`{p}`" for p in presets)
    return (
        f"| {family} | {names} | {_kernels(plan)} | {timing} | {source} "
        f"| `{best.overrides}` | {best.samples_per_s:.2f} | {memory} |"
    )


def table(gpus: int, bench: str, families: str) -> str:
    rows = [
        row(family, presets, plan_for(presets[0], gpus, bench, families))
        for family, presets in FAMILY_PRESETS
    ]
    return "\n".join([HEADER, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mp.plan.families_table", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--bench", default=str(DEFAULT_BENCH), help="the stage benchmark (drafter rates)")
    p.add_argument("--families", default=str(DEFAULT_FAMILIES), help="the target-families measurement")
    args = p.parse_args(argv)
    try:
        print(table(args.gpus, args.bench, args.families))
    except PlanError as e:
        print(f"families_table: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
