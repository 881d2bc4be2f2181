"""bench/bench.py's command line: the flags, their per-shape defaults, the layout they ask for."""

from __future__ import annotations

import argparse
import os

from benchlib.shapes import SHAPES
from layout import Layout, LayoutError, resolve_layout
from sections import DEFAULT_SECTIONS, NAMES

DEFAULTS = {  # per shape kind: warm-up and measured iterations
    "gpu": dict(
        warmup=3,
        iters=20,
        colocated_iters=10,
        pipeline_steps=30,
        transport_iters=50,
        matmul_iters=50,
        matmul_sustain_s=2.0,
        profile_steps=3,
    ),
    "tiny": dict(
        warmup=2,
        iters=8,
        colocated_iters=4,
        pipeline_steps=8,
        transport_iters=8,
        matmul_iters=5,
        matmul_sustain_s=0.0,
        profile_steps=2,
    ),
}


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The flags, defaults filled in per shape kind; `description`: the runner's docstring."""
    p = argparse.ArgumentParser(
        description=(description or __doc__).split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    _add_shape_and_layout(p)
    _add_lengths(p)
    _add_sections(p)
    _add_workload(p)
    return _completed(p, p.parse_args(argv))


def _add_shape_and_layout(p: argparse.ArgumentParser) -> None:
    """The model shape, the device, the output and the ranks of each role."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--out",
        default="",
        help="JSON output (default: bench-<shape>.json; other layouts: bench-<shape>-<T>t<D>d[-tp<k>].json)",
    )
    p.add_argument(
        "--targets", type=int, help="target ranks (default: --target-parallel; the rest are drafters)"
    )
    p.add_argument("--drafters", type=int, help="drafter ranks (default: WORLD_SIZE - targets)")
    p.add_argument(
        "--target-parallel",
        type=int,
        default=1,
        help="target ranks per tensor-parallel replica (divides --targets)",
    )


def _add_lengths(p: argparse.ArgumentParser) -> None:
    """Batch sizes, how long each section warms up and measures, the profile and the matmul."""
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, help="warm-up iterations/steps of every section (>= 1)")
    p.add_argument("--iters", type=int, help="measured iterations: target only, drafter only")
    p.add_argument("--colocated-iters", type=int, help="measured steps of the colocated baseline")
    p.add_argument("--pipeline-steps", type=int, help="measured optimizer steps of the pipeline")
    p.add_argument("--transport-iters", type=int, help="measured messages of the transport section")
    p.add_argument("--matmul-iters", type=int, help="measured matmuls of the peak")
    p.add_argument(
        "--matmul-sustain-s",
        type=float,
        help="then matmuls for this long: the rate held at the power limit (GPU default 2, 0: skip)",
    )
    p.add_argument("--profile-steps", type=int, help="profiled drafter steps of the profile section")
    p.add_argument(
        "--profile-top-kernels",
        type=int,
        default=15,
        help="kernels the profile section lists, costliest first",
    )
    p.add_argument(
        "--profile-trace",
        help="also write the profiled steps as a gzipped Chrome trace to this file (chrome://tracing, Perfetto)",
    )
    p.add_argument("--matmul-n", type=int, help="matmul side (default: 8192 on GPU shapes)")


def _add_sections(p: argparse.ArgumentParser) -> None:
    """Which sections run, their time limits, the seed."""
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma list of {', '.join(NAMES)} (default: all but profile; "
        "target_parallel_check runs with --target-parallel > 1)",
    )
    p.add_argument(
        "--timeout-scale", type=float, default=1.0, help="multiplies every section's watchdog timeout"
    )
    p.add_argument(
        "--time-budget", type=float, default=420.0, help="start no section after this many s (0: none)"
    )
    p.add_argument(
        "--peer-grace", type=float, default=30.0, help="s to wait on a peer that reported a failure"
    )
    p.add_argument("--seed", type=int, default=0)


def _add_workload(p: argparse.ArgumentParser) -> None:
    """What a step computes: the drafter's rows, the data, the block and row shapes, overrides, faults."""
    p.add_argument(
        "--compute-every-row",
        action="store_true",
        help="A/B: a DFlash drafter computes the repeated and unscored block rows too "
        "(dflash_mp/models/block_rows.py), as before 2026-12-02",
    )
    p.add_argument(
        "--data",
        choices=("fixed", "chat", "chat-packed"),
        default="fixed",
        help="micro-batches of fixed full rows (default), of chat-shaped records one per row, or of "
        "chat-shaped records packed into rows (data.packing); benchlib/chat_data.py has the lengths",
    )
    p.add_argument("--block-size", type=int, help="draft block size (default: the shape's, 16 on GPU shapes)")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per row (default: the shape's, 3072 at qwen3-8b); the anchors scale with it",
    )
    p.add_argument(
        "--num-anchors",
        type=int,
        help="anchors per row (default: the shape's, times --seq-len / the shape's row: 512 per 3072 tokens)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each draft layer's forward in its backward (train.activation_checkpointing=true)",
    )
    p.add_argument(
        "--override", action="append", default=[], help="Hydra override for the config (repeatable)"
    )
    p.add_argument(
        "--fault",
        default="",
        help="testing aid: SECTION:RANK:raise|hang[:CALL] fails that rank there (pipeline: at its CALL-th micro-batch)",
    )


def _completed(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The per-shape defaults filled in, counts at least 1, the sections and the fault parsed."""
    defaults = DEFAULTS["tiny" if args.shape == "tiny" else "gpu"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup = max(1, args.warmup)
    for key in (
        "iters",
        "colocated_iters",
        "pipeline_steps",
        "transport_iters",
        "matmul_iters",
        "profile_steps",
    ):
        setattr(args, key, max(1, getattr(args, key)))
    for flag, value in (("--seq-len", args.seq_len), ("--num-anchors", args.num_anchors)):
        if value is not None and value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    if args.activation_checkpointing:
        args.override.append("train.activation_checkpointing=true")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(NAMES))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(NAMES)}")
    if args.fault:
        parts = args.fault.split(":")
        if len(parts) not in (3, 4) or parts[0] not in NAMES or parts[2] not in ("raise", "hang"):
            p.error("--fault is SECTION:RANK:raise|hang[:CALL]")
        args.fault = (parts[0], int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else 0)
    return args


def layout_from_env(args: argparse.Namespace) -> Layout:
    """The layout of this torchrun job; SystemExit naming the flags when it does not fit WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise SystemExit(
            "bench.py: WORLD_SIZE is unset: launch it with torchrun --nproc-per-node 2 (1 target + "
            "1 drafter; --standalone --nproc-per-node 1 on a single GPU), or as many ranks as "
            "--targets + --drafters"
        )
    try:
        return resolve_layout(world, args.targets, args.drafters, args.target_parallel)
    except LayoutError as e:
        raise SystemExit(f"bench.py: {e}") from None


def default_out(shape: str, layout: Layout) -> str:
    """bench-<shape>.json, with the layout unless it is the 1 + 1 (or 1-rank) default."""
    if layout.single or (layout.targets, layout.drafters, layout.target_parallel) == (1, 1, 1):
        return f"bench-{shape}.json"
    tp = f"-tp{layout.target_parallel}" if layout.target_parallel > 1 else ""
    return f"bench-{shape}-{layout.targets}t{layout.drafters}d{tp}.json"
