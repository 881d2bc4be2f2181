"""What the GPU drew and how fast it clocked over a timed loop, from NVML (nvidia-ml-py).

A step that runs at the board's power limit takes as long as its energy allows: the GPU lowers its
clock until the draw fits under the limit, so closing idle gaps or overlapping work gains nothing
there. `PowerMeter` tells whether a timed section ran so: the energy counter's difference (joules
per step), the mean draw against the enforced limit, and samples of the SM clock and of the reasons
NVML gives for holding it down (the software power cap, thermal or hardware slowdown).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

# NVML's clock-event (throttle) reason bits (nvml.h: nvmlClocksEventReason*).
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80


def nvml_handle(device: torch.device) -> tuple[Any, Any] | None:
    """(pynvml, handle) of `device`, or None where NVML does not answer (CPU, no nvidia-ml-py)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        return pynvml, torch.cuda._get_pynvml_handler(device)
    except Exception:  # no driver, no nvidia-ml-py, or an NVML without this device
        return None


class PowerMeter:
    """Energy, mean power, SM clock and power-cap share from `start` to `stop` (or over a `with`
    block); empty off NVML.

    A background thread samples every `interval_s` (NVML calls take microseconds and release
    the GIL); the energy counter is read at both ends. Synchronise the device before each end so
    the energy covers the work, then call `result(steps)`.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.01, nvml=None) -> None:
        found = nvml if nvml is not None else nvml_handle(device)
        self.nvml, self.handle = found if found else (None, None)
        self.interval_s = interval_s
        self.samples: list[tuple[int, float, int]] = []  # (SM clock MHz, power W, reason bits)
        self.energy_mj: list[int] = []
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PowerMeter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> PowerMeter:
        if self.nvml is None:
            return self
        with contextlib.suppress(Exception):  # boards without the counter: samples only
            self.energy_mj.append(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, name="power-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.energy_mj:
            try:
                self.energy_mj.append(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
            except Exception:
                self.energy_mj.clear()

    def _sample(self) -> None:
        nvml, handle = self.nvml, self.handle
        # nvidia-ml-py 12.535 renamed "throttle" reasons to "clocks event" reasons.
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(
                    (
                        nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                        nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                        reasons(handle),
                    )
                )
            except Exception:  # a failed read drops that sample, not the measurement
                continue

    def result(self, steps: int) -> dict:
        """Per-step energy and the samples' summary; {} where NVML did not answer."""
        if self.nvml is None or (not self.samples and len(self.energy_mj) < 2):
            return {}
        out: dict = {"samples": len(self.samples)}
        try:
            out["power_limit_w"] = self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1e3
        except Exception:
            out["power_limit_w"] = None
        if len(self.energy_mj) == 2 and self.seconds > 0:
            joules = (self.energy_mj[1] - self.energy_mj[0]) / 1e3
            out["energy_j_per_step"] = joules / steps
            out["mean_power_w"] = joules / self.seconds
        if self.samples:
            clocks = sorted(s[0] for s in self.samples)
            n = len(self.samples)
            out["sm_clock_mhz"] = {
                "mean": sum(clocks) / n,
                "p10": clocks[int(0.1 * (n - 1))],
                "p90": clocks[int(0.9 * (n - 1))],
            }
            # NVML's power reading averages up to a second back: it lags; mean_power_w is the measure.
            out["sampled_power_w"] = sum(s[1] for s in self.samples) / n
            out["power_capped_share"] = sum(bool(s[2] & SW_POWER_CAP) for s in self.samples) / n
            out["thermal_or_hw_slowdown_share"] = (
                sum(
                    bool(s[2] & (HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE))
                    for s in self.samples
                )
                / n
            )
        return out
