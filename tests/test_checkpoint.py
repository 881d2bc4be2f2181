"""Checkpoints are atomic: a crash mid-save leaves the previous one as the newest complete."""

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_mp.run import checkpoint


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
    with pytest.raises(checkpoint.CheckpointError, match="OSError: disk full"):
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


def _resume(run_dir: Path, steps: int, warnings: list[str] | None = None):
    """The first drafter's resume choice (resume.resume_step) over `run_dir`, warnings collected."""
    import logging

    from dflash_mp.config.schema import compose_config, to_dataclass
    from dflash_mp.run.logs import get_logger
    from dflash_mp.runtime.resume import resume_step

    class Collect(logging.Handler):
        def emit(self, record):
            if warnings is not None and record.getMessage().startswith("skipping"):
                warnings.append(record.getMessage())

    handler = Collect()
    get_logger().addHandler(handler)
    try:
        cfg = to_dataclass(compose_config(["train.resume=true"]))
        return resume_step(cfg, run_dir, lambda step: {}, steps)
    finally:
        get_logger().removeHandler(handler)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one_with_a_warning(tmp_path, damage):
    for step in (10, 20):
        checkpoint.save(tmp_path / "checkpoints", _state(step), keep=3)
    weights = tmp_path / "checkpoints" / "step_00000020" / "drafter.safetensors"
    data = weights.read_bytes()
    # "flip": same size, other bytes (a header length safetensors refuses); "truncate": cut short.
    weights.write_bytes(b"\xff" * 8 + data[8:] if damage == "flip" else data[: len(data) // 2])
    warnings: list[str] = []
    step, state = _resume(tmp_path, steps=100, warnings=warnings)
    assert step == 10 and torch.equal(state.model["w"], torch.full((3, 3), 10.0))
    assert len(warnings) == 1 and str(weights.parent) in warnings[0] and "step_00000010" in warnings[0]
    assert "drafter.safetensors" in warnings[0]


def test_no_intact_checkpoint_fails_naming_every_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        checkpoint.save(root, _state(step), keep=3)
    (root / "step_00000010" / "optimizer.pt").write_bytes(b"garbage")
    (root / "step_00000020" / "meta.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError) as failed:
        _resume(tmp_path, steps=100)
    message = str(failed.value)
    assert str(root / "step_00000010") in message and str(root / "step_00000020") in message
    assert "optimizer.pt has 7 bytes" in message and "meta.json is missing or unreadable" in message
    assert "train.resume=false" in message


def test_a_resume_that_leaves_nothing_to_train_is_refused(tmp_path):
    from dflash_mp.runtime.resume import ResumeRefused

    checkpoint.save(tmp_path / "checkpoints", _state(300), keep=3)
    with pytest.raises(ResumeRefused, match=r"at step 300 and this job ends at step 30 .*train.max_steps"):
        _resume(tmp_path, steps=30)


def test_a_failed_write_names_the_cause_keeps_the_last_checkpoint_and_leaves_no_temporary(tmp_path):
    import resource
    import signal

    root = tmp_path / "checkpoints"
    checkpoint.save(root, _state(10), keep=3)
    big = _state(20)
    big.optimizer = {"state": {0: {"exp_avg": torch.zeros(200_000)}}, "param_groups": []}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, hard))
    try:
        with pytest.raises(checkpoint.CheckpointError) as failed:
            checkpoint.save(root, big, keep=3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, xfsz)
    message = str(failed.value)
    assert "step 20" in message and str(root) in message
    assert "file-size limit (ulimit -f: 400000 bytes)" in message
    assert "the newest is still step_00000010" in message
    assert [p.name for p in root.iterdir()] == ["step_00000010"]


def test_checkpoint_files_are_as_readable_as_their_directory(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    path = checkpoint.save(root, _state(10), keep=3)
    assert {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()} == {
        "drafter.safetensors": 0o644,
        "optimizer.pt": 0o644,
        "meta.json": 0o644,
    }
    assert path.stat().st_mode & 0o777 == 0o755


def _layout(**changes) -> dict:
    layout = dict(
        version=1, micro_batch_index=40, micro_batch_size=8, seed=0, grad_accum=2, drafters=1, epochs=1
    )
    return layout | {"data": {"files": [], "records": 100}} | changes


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            ["train.max_steps=20"],
            r"step_00000030: it is at step 30 and this job ends at step 20 .*nothing left",
        ),
        # The newest leaves nothing, the older would: the first drafter decides (the newest may be damaged).
        (["train.max_steps=30"], None),
        (["train.max_steps=100"], None),
        (
            ["train.max_steps=100", "train.grad_accum=1"],
            r"train.grad_accum changed \(train.grad_accum=2, topology",
        ),
        (["train.max_steps=100", "train.grad_accum=1", "topology.drafters=2"], None),  # same per step
        (["train.max_steps=100", "train.seed=1"], r"train.seed was 0 when it was saved and is 1 now"),
        (["train.max_steps=100", "train.resume=false"], None),
    ],
)
def test_the_preflight_refuses_what_the_first_drafter_would_from_meta_json_alone(
    tmp_path, overrides, refused
):
    """The launcher's and plain torchrun's preflight (doctor.check_resume) read only meta.json: a
    resume with nothing left to train, or one that moves the data, fails before any worker starts."""
    _save_steps_20_and_30(
        tmp_path
    )  # the resume may fall back to the older: refused only if both leave nothing
    check = _check_resume(tmp_path, *overrides)
    if refused is None:
        assert check.ok, check.message
    else:
        assert not check.ok and re.search(refused, check.message), check.message


def test_the_preflight_counts_only_checkpoints_the_first_drafter_could_resume_from(tmp_path):
    """A checkpoint whose meta.json is unreadable is one the first drafter skips (it falls back to
    the newest intact one): the preflight judges the steps of the others, and does not fail on it."""
    _save_steps_20_and_30(tmp_path)
    (tmp_path / "checkpoints" / "step_00000030" / "meta.json").write_text("{")
    assert _check_resume(tmp_path, "train.max_steps=25").ok
    done = _check_resume(tmp_path, "train.max_steps=20")
    assert not done.ok and "step_00000020: it is at step 20" in done.message


def _save_steps_20_and_30(run_dir: Path) -> None:
    for step in (20, 30):
        checkpoint.save(run_dir / "checkpoints", _state(step), keep=3, data_layout=_layout())


def _check_resume(run_dir: Path, *overrides: str):
    """doctor.check_resume of a 1t1d resume whose other settings match _layout()."""
    from dflash_mp.config.schema import compose_config, to_dataclass
    from dflash_mp.launch import doctor

    base = [
        "train.resume=true",
        "topology=1t1d",
        "train.micro_batch_size=8",
        "train.grad_accum=2",
        "train.epochs=1",
    ]
    return doctor.check_resume(to_dataclass(compose_config([*base, *overrides])), run_dir, world_size=2)
