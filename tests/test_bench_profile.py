"""The benchmark's profile section (bench/sections/profile.py) on CPU: the phase rule, in process."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Kernel

from dflash_mp.training.trainer import DrafterTrainer
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from benchlib import power, timing  # noqa: E402
from benchlib.power import PowerMeter  # noqa: E402
from benchlib.shapes import SHAPES, bench_config  # noqa: E402
from benchlib.synthetic import SyntheticReader, random_drafter, random_embed_and_head, received_form  # noqa: E402
from benchlib.timing import matmul_peak  # noqa: E402
from sections.profile import PHASES, TOP_KERNELS, phase_breakdown, profile_drafter_steps  # noqa: E402


def _profile(*overrides: str, top_kernels: int = TOP_KERNELS) -> dict:
    shape, device = SHAPES["tiny"], torch.device("cpu")
    cfg = bench_config(shape, device, 1, 1, list(overrides))
    trainer = DrafterTrainer(
        cfg,
        device,
        cfg.train.max_steps,
        drafter=random_drafter(shape, device, seed=0, model_cfg=cfg.model),
        embed_and_head=random_embed_and_head(shape, torch.float32, device, seed=0),
    )
    hidden = torch.randn(1, shape.seq_len, shape.target.hidden * len(shape.layer_ids))
    batch = received_form(SyntheticReader(shape, 1).read(0), hidden, device)
    return profile_drafter_steps(trainer, batch, 1, warmup=1, steps=2, device=device, top_kernels=top_kernels)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_profile_phases_are_non_negative_and_sum_to_the_device_time(arch: str) -> None:
    result = _profile(f"model.arch={arch}")
    phases = result["phases_ms_per_step"]
    assert set(phases) == set(PHASES)
    assert all(ms >= 0 for ms in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(result["device_ms_per_step"], rel=1e-6)
    assert 0 < result["device_ms_per_step"] <= result["wall_ms_per_step"] * 1.05
    assert result["idle_ms_per_step"] == pytest.approx(
        result["wall_ms_per_step"] - result["device_ms_per_step"]
    )
    # Every phase of a drafter step shows up. Backward work lands in layers_backward only through
    # the autograd sequence numbers (it runs outside every forward scope).
    for phase in (
        "layers_forward_matmul",
        "layers_forward_other",
        "layers_backward_matmul",
        "layers_backward_other",
        "attention",
        "lm_head_ce",
        "optimizer",
    ):
        assert phases[phase] > 0, (phase, phases)
    assert (phases["selector"] > 0) == (arch == "dflash2"), phases

    top = result["top_kernels"]
    assert 0 < len(top) <= TOP_KERNELS
    assert [k["ms_per_step"] for k in top] == sorted((k["ms_per_step"] for k in top), reverse=True)
    assert all(k["phase"] in PHASES and k["calls_per_step"] > 0 for k in top)
    assert result["steps"] == 2 and result["device"] == "cpu"


def test_profile_puts_sdpa_forward_and_backward_under_attention() -> None:
    result = _profile(top_kernels=10**6)  # every operator
    by_name = {k["name"]: k for k in result["top_kernels"]}
    sdpa = [name for name in by_name if "scaled_dot_product" in name]
    assert any("backward" in name for name in sdpa) and any("backward" not in name for name in sdpa), sdpa
    assert all(by_name[name]["phase"] == "attention" for name in sdpa)


class _Range:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


def _event(name, start, end, parent=None, seq=-1, kernels=(), device=DeviceType.CPU, annotation=False):
    return SimpleNamespace(
        name=name,
        time_range=_Range(start, end),
        cpu_parent=parent,
        sequence_nr=seq,
        kernels=[Kernel(k, 0, us) for k, us in kernels],
        device_type=device,
        is_user_annotation=annotation,
        is_async=False,
        self_cpu_time_total=0.0,
    )


def test_gpu_kernels_go_to_the_phase_of_their_launching_operator_or_backward_node() -> None:
    # A hand-built GPU trace: the forward on the main thread, the backward in autograd's device
    # thread (no parent in common), a mirrored record_function range and an unlinked kernel.
    forward = _event("dflash::drafter_forward", 0, 100, annotation=True)
    compiled = _event("CompiledFunction", 1, 90, forward, seq=7)
    events = [
        forward,
        compiled,
        _event("aten::mm", 2, 10, compiled, seq=7, kernels=[("sm90_xmma_gemm_bf16", 30.0)]),
        _event(
            "triton_tem_fused_flex_attention_0",
            11,
            20,
            compiled,
            kernels=[("triton_tem_fused_flex_attention_0", 20.0)],
        ),
        _event("triton_poi_fused_add_0", 21, 30, compiled, kernels=[("triton_poi_fused_add_0", 5.0)]),
        lm := _event("dflash::lm_head_ce", 100, 150, annotation=True),
        _event("aten::mm", 101, 110, lm, seq=8, kernels=[("nvjet_tst_128x256", 40.0)]),
        opt := _event("dflash::optimizer", 200, 250, annotation=True),
        _event("aten::_fused_adamw_", 201, 240, opt, kernels=[("multi_tensor_apply_kernel", 12.0)]),
        bwd := _event("autograd::engine::evaluate_function: CompiledFunctionBackward", 160, 190, seq=7),
        _event("aten::mm", 161, 170, bwd, kernels=[("sm90_xmma_gemm_bf16", 60.0)]),
        _event(
            "triton_tem_fused_flex_attention_backward_1",
            171,
            180,
            bwd,
            kernels=[("triton_tem_fused_flex_attention_backward_1", 50.0)],
        ),
        _event("triton_per_fused_sum_2", 181, 185, bwd, kernels=[("triton_per_fused_sum_2", 8.0)]),
        lm_bwd := _event("autograd::engine::evaluate_function: _LinearCrossEntropyBackward", 155, 158, seq=8),
        _event("aten::mul", 156, 157, lm_bwd, kernels=[("vectorized_elementwise_kernel", 2.0)]),
    ]
    linked = 30 + 20 + 5 + 40 + 12 + 60 + 50 + 8 + 2
    device = [  # the device's own records: every kernel above, one unlinked memset, one mirrored range
        _event("kernel", 0, linked, device=DeviceType.CUDA),
        _event("Memset (Device)", 300, 303, device=DeviceType.CUDA),
        _event("dflash::drafter_forward", 0, 500, device=DeviceType.CUDA),
    ]
    result = phase_breakdown(events + device, cuda=True, steps=1)
    ms = {k: round(v * 1e3, 6) for k, v in result["phases_ms_per_step"].items()}  # back to us
    assert ms == {
        "layers_forward_matmul": 30,
        "layers_forward_other": 5,
        "layers_backward_matmul": 60,
        "layers_backward_other": 8,
        "attention": 70,
        "lm_head_ce": 42,
        "selector": 0,
        "optimizer": 12,
        "other": 3,  # the unlinked memset
    }
    assert result["device_ms_per_step"] * 1e3 == pytest.approx(linked + 3)
    # The device waited once, 73 us, before the memset (annotation ranges are not work).
    gaps = result["idle_gaps"]
    assert gaps["all_ms_per_step"] == 0.073 and gaps["over_50us_ms_per_step"] == 0.073
    assert gaps["count_per_step"] == gaps["over_50us_count_per_step"] == 1
    assert gaps["largest"] == [{"us": 73, "next_kernel": "Memset (Device)", "next_phase": None}]
    assert result["top_kernels"][0] == {
        "name": "sm90_xmma_gemm_bf16",
        "ms_per_step": 0.09,
        "calls_per_step": 2.0,
        "share": pytest.approx(90 / (linked + 3)),
        "phase": "layers_backward_matmul",
    }


def test_the_sustained_matmul_rate_is_the_mean_of_the_later_windows(monkeypatch):
    # A GPU at its power limit slows within seconds: the first window (the MFU's peak) is fast,
    # the later ones are what a long run holds. Windows here: 1 s, then 1, 1, 2, 2 s of matmuls.
    durations = iter([1.0, 1.0, 1.0, 2.0, 2.0])
    clock = iter([0.0, 1.0, 2.0, 3.0, 3.4, 5.0])  # the start, then one reading before each window

    class Marks:
        def __init__(self, device):
            pass

        def mark(self):
            pass

        def seconds(self, a, b):
            return next(durations)

    monkeypatch.setattr(timing, "Marks", Marks)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    result = matmul_peak(torch.device("cpu"), n=8, warmup=1, iters=3, sustain_s=3.5)
    flops = 2 * 8**3 * 3
    assert result["tflops"] == flops / 1.0 / 1e12
    assert result["sustained_windows"] == 4
    assert result["sustained_tflops"] == pytest.approx(flops / 2.0 / 1e12)  # windows 3 and 4
    assert result["clock_mhz"] is None and result["power_w"] is None  # no NVML on CPU
    durations = iter([1.0])
    assert "sustained_tflops" not in matmul_peak(torch.device("cpu"), n=8, warmup=1, iters=1)


class _FakeNvml:
    """NVML as nvidia-ml-py answers it: an energy counter (mJ), SM clock, power (mW), reason bits."""

    NVML_CLOCK_SM = 1

    def __init__(self, readings):
        self.readings = iter(readings)  # (clock MHz, power mW, reasons) per sample, then repeats the last
        self.last = None
        self.energy_mj = iter([1_000_000, 1_091_000])  # 91 J between the two ends

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return next(self.energy_mj)

    def _next(self):
        self.last = next(self.readings, self.last)
        return self.last

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return self._next()[0]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.last[1]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.last[2]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000


def test_the_power_meter_reports_energy_per_step_and_the_power_capped_share(monkeypatch):
    fake = _FakeNvml([(1980, 500_000, 0), (1455, 691_000, power.SW_POWER_CAP), (1500, 700_000, 0x44)])
    clock = iter([10.0, 10.5])  # start, stop: 0.5 s
    monkeypatch.setattr(power.time, "perf_counter", lambda: next(clock))
    meter = PowerMeter(torch.device("cpu"), interval_s=0.001, nvml=(fake, "handle"))
    with meter:
        while len(meter.samples) < 3:  # the sampling thread's three readings
            time.sleep(0.001)
        meter._stop.set()  # no sample after the third: the summary below is exact
    meter.samples = meter.samples[:3]
    result = meter.result(steps=7)
    assert result["energy_j_per_step"] == pytest.approx(91 / 7)
    assert result["mean_power_w"] == pytest.approx(91 / 0.5)
    assert result["power_limit_w"] == 700
    assert result["sm_clock_mhz"] == {
        "mean": pytest.approx((1980 + 1455 + 1500) / 3),
        "p10": 1455,
        "p90": 1500,
    }
    assert result["sampled_power_w"] == pytest.approx((500 + 691 + 700) / 3)
    assert result["power_capped_share"] == pytest.approx(2 / 3)  # bit 0x4 in the 2nd and 3rd
    assert result["thermal_or_hw_slowdown_share"] == pytest.approx(1 / 3)  # 0x40 in the 3rd


def test_the_power_meter_is_empty_where_nvml_does_not_answer():
    with PowerMeter(torch.device("cpu")) as meter:
        pass
    assert meter.result(steps=3) == {}
    assert "sustained_power" not in matmul_peak(torch.device("cpu"), n=8, warmup=1, iters=1, sustain_s=0.01)
