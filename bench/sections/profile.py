"""profile: where a warm drafter step's device time goes, by phase (torch.profiler).

Runs `--warmup` drafter steps (micro_step x grad_accum + optimizer_step, the first one compiles
when drafter_only did not run before), then profiles `--profile-steps` more: CUDA kernels on a
GPU, CPU operators on CPU. Not in the default section list; run it with `--sections setup,profile`.

Device time is the sum of kernel, memcpy and memset durations (GPU; record_function ranges that the
profiler mirrors onto the device timeline are not work and are left out; kernels overlapping on
two streams count twice) or of operator self times (CPU: every profiled operator except the pure
annotations, whose self time is interpreter time; an autograd.Function's own self time includes
the Python in its forward). Each kernel (CPU: each operator's self time) goes to exactly one
phase, so the phases sum to the total. The first rule that matches decides:

- attention: a kernel whose name says so (flex_attention, flash, fmha, sdpa, attention/attn), or
  one launched under an SDPA / flex_attention operator, forward and backward.
- lm_head_ce: under the `dflash::lm_head_ce` scope (block_diffusion.drafter_loss). The LM head's
  gradient is taken in that forward, so this is the whole head + cross-entropy cost; its backward
  node (_LinearCrossEntropyBackward, a scaling) is counted here too.
- selector (DFlash 2 only): under `dflash::selector`, and the backward of what ran there.
- layers_forward_{matmul,other}: under `dflash::drafter_forward` (the drafter module's forward:
  fc + norms + the draft layers + the block embedding lookup), split by kernel (CPU: operator)
  name into matmuls (GEMM kernels; aten mm/addmm/bmm/linear) and the rest.
- layers_backward_{matmul,other}: the backward pass of what ran under `dflash::drafter_forward`.
  Backward kernels run outside every forward scope (on GPU in autograd's device thread), so they
  are attributed through the autograd engine's events: a kernel under
  `autograd::engine::evaluate_function: <Node>` belongs to the forward scope of the operator that
  created <Node> (matched by the autograd sequence number). AccumulateGrad (writing .grad of the
  drafter's parameters) counts here.
- optimizer: under the `dflash::optimizer` scope around trainer.optimizer_step (the step metrics'
  packing and read-back, clip_grad_norm_, AdamW, zero_grad), but for the next micro-batch's blocks
  that it prepares while the update runs (`dflash::loss_blocks`, other).
- other: everything else (anchor sampling, block masks, labels: `dflash::loss_blocks`; the loss
  scaling and its backward, and on GPU kernels the profiler could not link to a launching operator).

Wall time per step is measured around the profiled steps (under the profiler, so slightly slower
than drafter_only, whose ms/step is copied here as unprofiled_ms_per_step when it ran); wall minus
device time is the time the device was idle: launch overhead and host work the device waited for.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import tempfile
import time
from collections import defaultdict

import torch
from benchlib.state import BenchState
from benchlib.timing import count_nonfinite, sync
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_mp.training.features import Features
from dflash_mp.training.trainer import DrafterTrainer

TIMEOUT_S = 420  # the cold compile, when drafter_only did not run first

PHASES = (
    "layers_forward_matmul",
    "layers_forward_other",
    "layers_backward_matmul",
    "layers_backward_other",
    "attention",
    "lm_head_ce",
    "selector",
    "optimizer",
    "other",
)
# Forward scopes (block_diffusion.drafter_loss; the optimizer's is this module's) -> phase family.
SCOPES = {
    "dflash::drafter_forward": "layers_forward",
    "dflash::lm_head_ce": "lm_head_ce",
    "dflash::selector": "selector",
    "dflash::optimizer": "optimizer",
    # The next micro-batch's blocks, prepared inside optimizer_step while the update runs.
    "dflash::loss_blocks": "other",
}
BACKWARD_OF = {"layers_forward": "layers_backward", "lm_head_ce": "lm_head_ce", "selector": "selector"}
BACKWARD_EVENT = "autograd::engine::evaluate_function: "
ATTENTION_KERNEL = re.compile(r"flex_attention|attention|attn|flash|fmha|sdpa", re.IGNORECASE)
ATTENTION_OP = re.compile(r"scaled_?dot_?product|flex_?attention|flash_block_attention", re.IGNORECASE)
MATMUL_KERNEL = re.compile(
    r"gemm|nvjet|cutlass|xmma|wgmma|cublas|matmul|splitk|^triton_tem_fused_(add)?b?mm", re.IGNORECASE
)
MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::addbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_addmm_activation",
    "aten::mv",
    "aten::addmv",
    "aten::dot",
}
TOP_KERNELS = 15


def run(bench: BenchState) -> dict:
    if "drafter" not in bench.roles:
        return {}
    if bench.trainer is None:
        raise RuntimeError("profile needs the drafter built by setup (run --sections setup,profile)")
    args = bench.args
    result = profile_drafter_steps(
        bench.trainer,
        bench.features,
        bench.A,
        args.warmup,
        args.profile_steps,
        bench.device,
        args.profile_top_kernels,
        trace_path=args.profile_trace if bench.rank == bench.first_drafter else None,
    )
    drafter_only = bench.partial["sections"].get("drafter_only") or {}
    result["unprofiled_ms_per_step"] = (drafter_only.get("result") or {}).get("ms_per_step")
    # Several drafters profile together (their steps all-reduce); the first one reports.
    return result if bench.rank == bench.first_drafter else {}


def profile_drafter_steps(
    trainer: DrafterTrainer,
    batch: Features,
    grad_accum: int,
    warmup: int,
    steps: int,
    device: torch.device,
    top_kernels: int = TOP_KERNELS,
    trace_path: str | None = None,
) -> dict:
    """`warmup` drafter steps on `batch`, then `steps` more under torch.profiler: their phase breakdown.

    `trace_path` (a name ending in .gz): the profiled steps' Chrome trace, host and device timelines.
    """

    early = [trainer.prepare(batch)]  # as drafter_only (and a drafter rank) step

    def step() -> dict:
        for micro in range(grad_accum):
            trainer.micro_step(early.pop() if early else batch, last_of_step=micro == grad_accum - 1)
        with record_function("dflash::optimizer"):
            return trainer.optimizer_step(while_waiting=lambda: early.append(trainer.prepare(batch)))

    for _ in range(warmup):
        step()
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        records = [step() for _ in range(steps)]
        sync(device)
        wall_s = time.perf_counter() - start
    count_nonfinite("profile", records)  # a skipped update would leave the optimizer phase out
    if trace_path:
        _write_trace(prof, trace_path)
    result = phase_breakdown(prof.events(), cuda, steps, top_kernels)
    result.update(
        wall_ms_per_step=wall_s / steps * 1e3,
        idle_ms_per_step=wall_s / steps * 1e3 - result["device_ms_per_step"],
        steps=steps,
        warmup=warmup,
        micro_batches_per_step=grad_accum,
    )
    return result


def _write_trace(prof, path: str) -> None:
    """The profiler's Chrome trace, gzipped (3 steps at Qwen3-8B shape: ~19k events, 0.35 MB gzipped)."""
    with tempfile.TemporaryDirectory() as scratch:
        raw = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)


def phase_breakdown(events, cuda: bool, steps: int, top_kernels: int = TOP_KERNELS) -> dict:
    """Device time per step by phase and the top kernels, from the profiler's events (rule above)."""
    ordered = sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end))
    forward_phase = _forward_phase_by_sequence_nr(ordered)
    phase_of_event: dict[int, str] = {}
    attention_of_event: dict[int, bool] = {}
    per_phase: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0, defaultdict(float)])
    # record_function ranges also appear on the device timeline (gpu_user_annotation): not work.
    annotations = {e.name for e in ordered if e.device_type == DeviceType.CPU and e.is_user_annotation}
    total = linked = 0.0
    device_work = []  # the device's own records of its work, in start order
    for event in ordered:
        if event.device_type != DeviceType.CPU:
            if cuda and not (event.is_user_annotation or event.name in annotations):
                total += event.time_range.elapsed_us()
                device_work.append(event)
            continue
        if event.is_async:
            continue
        for name, us, is_matmul in _work_of(event, cuda):
            family = _phase(event, forward_phase, phase_of_event)
            if _attention(event, attention_of_event) or (cuda and ATTENTION_KERNEL.search(name)):
                phase = "attention"
            elif family in ("layers_forward", "layers_backward"):
                phase = f"{family}_{'matmul' if is_matmul else 'other'}"
            else:
                phase = family
            per_phase[phase] += us
            linked += us
            kernel = per_kernel[name]
            kernel[0] += us
            kernel[1] += 1
            kernel[2][phase] += us
    # CPU: the operators are the work. GPU: the device's own records, unless the profiler kept none.
    total = max(total, linked) if cuda else linked
    # Kernels the profiler could not tie to a launching operator stay in the total, as "other".
    per_phase["other"] += max(0.0, total - linked)
    top = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top_kernels]
    return {
        "device": "cuda" if cuda else "cpu",
        "device_time_kind": "sum of CUDA kernel durations" if cuda else "sum of CPU operator self times",
        "device_ms_per_step": total / steps / 1e3,
        "phases_ms_per_step": {k: v / steps / 1e3 for k, v in per_phase.items()},
        "phases_share": {k: v / total if total else None for k, v in per_phase.items()},
        "unlinked_kernels_ms_per_step": max(0.0, total - linked) / steps / 1e3,
        "top_kernels": [
            {
                "name": name[:200],
                "ms_per_step": us / steps / 1e3,
                "calls_per_step": calls / steps,
                "share": us / total if total else None,
                "phase": max(phases, key=phases.get),
            }
            for name, (us, calls, phases) in top
        ],
        "rule": "see bench/sections/profile.py's docstring",
        "idle_gaps": _idle_gaps(device_work, per_kernel, steps) if cuda else None,
    }


def _idle_gaps(device_work, per_kernel: dict[str, list], steps: int, largest: int = 8) -> dict:
    """Where the device waited: the gaps between its kernels, and the kernels after the largest.

    Gaps of a few microseconds are launch latency between queued kernels; long ones are the device
    waiting for the host (a read-back, or launches slower than the kernels they launch).
    """
    gaps: list[tuple[float, str]] = []
    busy_until = None
    for event in device_work:
        start, end = event.time_range.start, event.time_range.end
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, event.name))
        busy_until = end if busy_until is None else max(busy_until, end)
    long = [gap for gap in gaps if gap[0] >= 50]
    return {
        "all_ms_per_step": sum(us for us, _ in gaps) / steps / 1e3,
        "count_per_step": len(gaps) / steps,
        "over_50us_ms_per_step": sum(us for us, _ in long) / steps / 1e3,
        "over_50us_count_per_step": len(long) / steps,
        "largest": [
            {
                "us": us,
                "next_kernel": name[:120],
                "next_phase": max(per_kernel[name][2], key=per_kernel[name][2].get)
                if name in per_kernel
                else None,
            }
            for us, name in sorted(gaps, reverse=True)[:largest]
        ],
    }


def _work_of(event, cuda: bool) -> list[tuple[str, float, bool]]:
    """(name, microseconds, is a matmul) of the device work `event` itself accounts for."""
    if cuda:
        launched_by_matmul = event.name in MATMUL_OPS
        return [
            (k.name, float(k.duration), launched_by_matmul or bool(MATMUL_KERNEL.search(k.name)))
            for k in event.kernels
        ]
    if event.is_user_annotation:  # our scopes, Optimizer.step#...: their self time is the interpreter's
        return []
    return [(event.name, float(event.self_cpu_time_total), event.name in MATMUL_OPS)]


def _forward_phase_by_sequence_nr(ordered) -> dict[int, str | None]:
    """The forward scope of the operator that created each autograd node, keyed by sequence number.

    An operator records the thread's next sequence number; only one that creates a node advances
    it, so several operators share a number and the last of them (in time) is the node's creator.
    """
    by_sequence_nr: dict[int, str | None] = {}
    for event in ordered:
        if event.device_type != DeviceType.CPU or event.sequence_nr < 0:
            continue
        family, backward = None, False
        node = event
        while node is not None:
            if node.name.startswith(BACKWARD_EVENT):
                backward = True
                break
            if node.name in SCOPES:
                family = SCOPES[node.name]
                break
            node = node.cpu_parent
        if not backward:
            by_sequence_nr[event.sequence_nr] = family
    return by_sequence_nr


def _phase(event, forward_phase: dict[int, str | None], memo: dict[int, str]) -> str:
    """The phase family of `event`: its nearest enclosing forward scope or backward node decides."""
    if id(event) in memo:
        return memo[id(event)]
    if event.name.startswith(BACKWARD_EVENT):
        if event.name.endswith("AccumulateGrad"):
            phase = "layers_backward"
        else:
            phase = BACKWARD_OF.get(forward_phase.get(event.sequence_nr) or "", "other")
    elif event.name in SCOPES:
        phase = SCOPES[event.name]
    elif event.cpu_parent is None:
        phase = "other"
    else:
        phase = _phase(event.cpu_parent, forward_phase, memo)
    memo[id(event)] = phase
    return phase


def _attention(event, memo: dict[int, bool]) -> bool:
    """Whether `event` runs inside an attention operator (SDPA or flex_attention, or its backward node)."""
    if id(event) in memo:
        return memo[id(event)]
    found = bool(ATTENTION_OP.search(event.name)) or (
        event.cpu_parent is not None and _attention(event.cpu_parent, memo)
    )
    memo[id(event)] = found
    return found
