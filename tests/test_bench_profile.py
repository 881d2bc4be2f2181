"""The benchmark's profile section (bench/sections/profile.py) on CPU: the phase rule, in process."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_mp.trainer import DrafterTrainer
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import benchlib as bl  # noqa: E402
from sections.profile import PHASES, TOP_KERNELS, profile_drafter_steps  # noqa: E402


def _profile(*overrides: str, top_kernels: int = TOP_KERNELS) -> dict:
    shape, device = bl.SHAPES["tiny"], torch.device("cpu")
    cfg = bl.bench_config(shape, device, 1, 1, list(overrides))
    trainer = DrafterTrainer(
        cfg,
        device,
        cfg.train.max_steps,
        drafter=bl.random_drafter(shape, device, seed=0, model_cfg=cfg.model),
        embed_and_head=bl.random_embed_and_head(shape, torch.float32, device, seed=0),
    )
    hidden = torch.randn(1, shape.seq_len, shape.hidden * len(shape.layer_ids))
    batch = bl.received_form(bl.SyntheticReader(shape, 1).read(0), hidden, device)
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
