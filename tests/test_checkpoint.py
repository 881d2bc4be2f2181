"""Checkpoints are atomic: a crash mid-save leaves the previous one as the newest complete."""

import json
from pathlib import Path

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


def test_a_save_sweeps_temporary_directories_of_killed_saves(tmp_path):
    checkpoint.save(tmp_path, _state(10), keep=3)
    killed = tmp_path / ".tmp-step_00000020-999999"  # a save killed mid-write, by another process
    killed.mkdir()
    (killed / "drafter.safetensors").write_bytes(b"partial")
    checkpoint.save(tmp_path, _state(30), keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010", "step_00000030"]


def test_resume_sweeps_temporary_directories(tmp_path):
    checkpoint.save(tmp_path, _state(10), keep=3)
    (tmp_path / ".tmp-step_00000020-999999").mkdir()
    assert checkpoint.sweep_stale(tmp_path) == ["deleted .tmp-step_00000020-999999"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


class _Killed(BaseException):
    """Stands for SIGKILL: nothing of the save runs after it."""


def test_a_kill_while_resaving_a_step_loses_no_checkpoint_even_with_keep_1(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, _state(10), keep=1)
    rename = checkpoint.os.rename

    def killed_before_the_new_copy_lands(src, dst):
        if str(src).startswith(str(tmp_path / ".tmp-")):
            raise _Killed
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", killed_before_the_new_copy_lands)
    newer = _state(10)
    newer.model["w"] += 1
    with pytest.raises(_Killed):
        checkpoint.save(tmp_path, newer, keep=1)
    monkeypatch.setattr(checkpoint.os, "rename", rename)
    checkpoint.sweep_stale(tmp_path)  # what a resume does first
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state.step == 10 and torch.equal(state.model["w"], torch.full((3, 3), 10.0))


def test_resaving_a_step_replaces_it(tmp_path):
    checkpoint.save(tmp_path, _state(10), keep=1)
    newer = _state(10)
    newer.model["w"] += 1
    checkpoint.save(tmp_path, newer, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]
    assert torch.equal(checkpoint.load(checkpoint.latest(tmp_path)).model["w"], torch.full((3, 3), 11.0))


def test_meta_records_the_data_layout_as_json(tmp_path):
    layout = {"seed": 3, "micro_batch_index": 40}
    path = checkpoint.save(tmp_path, _state(10), keep=1, data_layout=layout)
    assert json.loads((path / "meta.json").read_text())["data_layout"] == layout
    assert checkpoint.read_meta(path)["step"] == 10


def test_a_deletion_of_an_old_checkpoint_cut_short_is_finished_by_the_next_save(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, _state(10), keep=1)

    rmtree = checkpoint.shutil.rmtree

    def killed_mid_deletion(path, *args, **kwargs):
        if "step_00000010" not in Path(path).name:
            return rmtree(path, *args, **kwargs)
        (Path(path) / "drafter.safetensors").unlink()
        raise _Killed

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_mid_deletion)
    with pytest.raises(_Killed):
        checkpoint.save(tmp_path, _state(20), keep=1)
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path).name == "step_00000020"
    checkpoint.save(tmp_path, _state(30), keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000030"]
