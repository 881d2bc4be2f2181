"""Checkpoints are atomic: a crash mid-save leaves the previous one as the newest complete."""

import pytest
import torch

from dflash_mp import checkpoint


def _state(step: int) -> checkpoint.TrainingState:
    model = {"w": torch.full((3, 3), float(step)), "b": torch.arange(3.0)}
    return checkpoint.TrainingState(
        step=step, model=model, optimizer={"state": {}, "param_groups": []}, rng=checkpoint.rng_state()
    )


def test_round_trip_and_retention(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, _state(step), keep=2)
    found = checkpoint.complete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["step_00000020", "step_00000030"]
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state.step == 30
    assert torch.equal(state.model["w"], torch.full((3, 3), 30.0))


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, _state(10), keep=3)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, _state(20), keep=3)
    assert checkpoint.latest(tmp_path).name == "step_00000010"
    assert checkpoint.load(checkpoint.latest(tmp_path)).step == 10


def test_directory_without_meta_is_not_a_checkpoint(tmp_path):
    checkpoint.save(tmp_path, _state(10), keep=3)
    fake = tmp_path / "step_00000020"
    fake.mkdir()
    (fake / "drafter.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path).name == "step_00000010"


def test_rng_state_restores_the_stream():
    state = checkpoint.rng_state()
    first = torch.rand(4)
    checkpoint.restore_rng(state)
    assert torch.equal(torch.rand(4), first)
