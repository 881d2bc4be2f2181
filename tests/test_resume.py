"""The resume check: what a resumed job may change and what it may not (in-process)."""

from __future__ import annotations

import pytest

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.run import checkpoint
from dflash_mp.runtime.resume import (
    ResumeRefused,
    check_layout,
    data_files_fingerprint,
    data_layout,
    load_resume_state,
)
from dflash_mp.runtime.topology import Topology


def _layout(tmp_path, *overrides: str, targets: int = 1, drafters: int = 1, records: int = 3, step: int = 5):
    cfg = to_dataclass(compose_config(list(overrides)))
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("{}\n" * 3)
    topology = Topology(targets, drafters, cfg.train.grad_accum)
    return data_layout(cfg, topology, data_files_fingerprint([str(data)], records), step)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("train.micro_batch_size=4",), "train.micro_batch_size was 8 when it was saved and is 4 now"),
        (("train.seed=1",), "train.seed was 0"),
        (("train.epochs=2",), "train.epochs"),
        (("train.grad_accum=2",), "train.grad_accum changed (train.grad_accum=1, topology.drafters=1"),
    ],
)
def test_a_setting_that_moves_data_is_refused_by_name(tmp_path, change, named):
    saved = _layout(tmp_path)
    with pytest.raises(ResumeRefused, match="cannot resume from ck") as refused:
        check_layout(saved, _layout(tmp_path, *change), "ck")
    assert named in str(refused.value) and "new run" in str(refused.value)


def test_more_drafters_than_saved_is_refused(tmp_path):
    with pytest.raises(ResumeRefused, match="topology.drafters changed"):
        check_layout(_layout(tmp_path, drafters=2), _layout(tmp_path, drafters=3), "ck")


def test_changed_data_files_are_refused(tmp_path):
    saved = _layout(tmp_path)
    with pytest.raises(ResumeRefused, match="number of records in data.train_files was 3"):
        check_layout(saved, _layout(tmp_path, records=4), "ck")
    (tmp_path / "train.jsonl").write_text("{}\n" * 3 + " \n")  # same records, other bytes
    with pytest.raises(ResumeRefused, match="size in bytes of .*train.jsonl was 9"):
        check_layout(saved, _layout(tmp_path), "ck")
    moved = dict(saved, data={"files": [{"path": "/elsewhere.jsonl", "bytes": 9}], "records": 3})
    with pytest.raises(ResumeRefused, match="data.train_files was"):
        check_layout(moved, saved, "ck")


def test_settings_that_do_not_move_data_are_allowed(tmp_path):
    saved = _layout(tmp_path, "train.grad_accum=2", drafters=1)
    now = _layout(
        tmp_path, "optim.lr=1e-3", "logger.progress_every=7", "train.max_steps=99", targets=3, drafters=2
    )
    notes = check_layout(saved, now, "ck")
    assert notes == [
        "grad_accum x drafters changed from 2 x 1 to 1 x 2: same micro-batches per step, same data order"
    ]
    assert check_layout(saved, saved, "ck") == []
    assert "not checked" in check_layout(None, now, "ck")[0]  # a checkpoint from before the record


def test_other_drafters_load_the_step_the_first_one_chose(tmp_path):
    from tests.test_checkpoint import _state

    for step in (2, 4):
        checkpoint.save(tmp_path / "checkpoints", _state(step), keep=3)
    assert load_resume_state(tmp_path, 2).step == 2  # not the newest: the broadcast step
    with pytest.raises(FileNotFoundError, match="step_00000003.*shares"):
        load_resume_state(tmp_path, 3)
