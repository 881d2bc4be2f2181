"""Timers on the device timeline, per-iteration statistics, the matmul peak, memory reports."""

from __future__ import annotations

import time

import torch

from .power import PowerMeter

GB = 1e9
GIB = 2**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Marks:
    """Timestamps on the device timeline (CUDA events) or the host clock (CPU); no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        """Seconds from mark a to mark b (synchronises on CUDA: call after the run)."""
        if self.cuda:
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]

    def intervals(self) -> list[float]:
        return [self.seconds(i, i + 1) for i in range(len(self.marks) - 1)]


def distribution(seconds: list[float]) -> dict:
    """ms statistics of per-iteration times."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    mean = sum(ordered) / len(ordered)
    var = sum((x - mean) ** 2 for x in ordered) / len(ordered)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] * 1e3

    return {
        "n": len(ordered),
        "mean_ms": mean * 1e3,
        "median_ms": pct(0.5),
        "p10_ms": pct(0.1),
        "p90_ms": pct(0.9),
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "cv": (var**0.5) / mean if mean > 0 else None,
    }


# Random weights on random tokens may give a rare non-finite step (the benchmark skips it); past this
# share of the measured steps the timings are not training steps' (skipped steps run no update).
MAX_NONFINITE_SHARE = 0.1


def count_nonfinite(section: str, records: list[dict]) -> int:
    """How many step records were skipped for a non-finite loss or gradient norm; raises when more
    than MAX_NONFINITE_SHARE of them were, so that a broken step is never reported as a fast one."""
    nonfinite = sum(record.get("skip_reason") == "nonfinite" for record in records)
    if records and nonfinite > MAX_NONFINITE_SHARE * len(records):
        raise FloatingPointError(
            f"{section}: {nonfinite} of {len(records)} measured steps had a non-finite loss or gradient "
            "norm and skipped the optimizer update, so their times are not training steps'. The "
            "numerics of this code or configuration are broken; fix them before reading any timing."
        )
    return nonfinite


def matmul_peak(device: torch.device, n: int, warmup: int, iters: int, sustain_s: float = 0.0) -> dict:
    """Dense n^3 matmul throughput: bf16 on GPU (the MFU denominator), fp32 on CPU.

    `tflops` is `iters` back-to-back products (~70 ms at n=8192 on an H200), the MFU denominator.
    With `sustain_s` > 0 the products go on for that long in windows of `iters`, and
    `sustained_tflops` is the mean of the windows of the second half: a GPU at its power limit
    lowers its clock within a second or two, so this is the rate a long run of matmuls holds
    (reported beside the MFU, which keeps the short peak).
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 * iters

    def window() -> float:
        marks = Marks(device)
        marks.mark()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        marks.mark()
        return marks.seconds(0, 1)

    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    sync(device)
    seconds = window()
    result = {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "iters": iters,
        "ms_per_matmul": seconds / iters * 1e3,
        "tflops": flops / seconds / 1e12,
    }
    if sustain_s > 0:
        rates = []
        end = time.perf_counter() + sustain_s
        with PowerMeter(device) as meter:
            while time.perf_counter() < end or len(rates) < 2:
                rates.append(flops / window() / 1e12)  # window() synchronises
        held = rates[len(rates) // 2 :]
        result.update(
            sustain_s=sustain_s,
            sustained_tflops=sum(held) / len(held),
            sustained_windows=len(rates),
            **_clock_and_power(device),
        )
        # Per window of `iters` products; with the energy, the joules a TFLOP of matmuls costs.
        power = meter.result(steps=len(rates))
        if power:
            if "energy_j_per_step" in power:
                power["joules_per_tflop"] = power["energy_j_per_step"] / (flops / 1e12)
            result["sustained_power"] = power
    return result


def _clock_and_power(device: torch.device) -> dict:
    """The GPU's SM clock (MHz) and board power (W) now, where NVML answers; else None."""
    if device.type != "cuda":
        return {"clock_mhz": None, "power_w": None}
    try:
        return {"clock_mhz": torch.cuda.clock_rate(device), "power_w": torch.cuda.power_draw(device) / 1e3}
    except Exception:  # no NVML (pynvml) on this machine
        return {"clock_mhz": None, "power_w": None}


def memory_reset(device: torch.device) -> None:
    """Start a section's peak: the runner calls it before every section."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_report(device: torch.device) -> dict:
    """The section's peaks since `memory_reset`: torch's allocations and what its allocator reserved
    (GB and, to compare with dflash_mp.plan.memory's prediction and the GPU's size, GiB)."""
    import resource

    report = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        report.update(
            peak_allocated_gb=allocated / GB,
            peak_reserved_gb=reserved / GB,
            allocated_now_gb=torch.cuda.memory_allocated(device) / GB,
            peak_allocated_gib=allocated / GIB,
            peak_reserved_gib=reserved / GIB,
            device_total_gib=torch.cuda.get_device_properties(device).total_memory / GIB,
        )
    return report
