"""metrics.jsonl is strict JSON and a failed write says which file, why and what is kept (in-process)."""

from __future__ import annotations

import errno
import json
import math

import pytest

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.run.metrics import MetricsLogger, MetricsWriteError
from dflash_mp.run.plots import read_metrics
from tests.conftest import read_metrics as read_test_metrics


def _logger(run_dir) -> MetricsLogger:
    return MetricsLogger(run_dir, 10, 0, to_dataclass(compose_config([])).logger, {})


def _record(step: int, **fields) -> dict:
    return {"step": step, "loss": 2.0, "lr": 1e-3, "samples_per_s": 1.0} | fields


def test_non_finite_numbers_are_written_as_null(tmp_path):
    metrics = _logger(tmp_path)
    metrics.log(_record(1, loss=math.nan, grad_norm=math.inf, acc=[0.5, -math.inf], skipped=True))
    metrics.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    strict = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert strict["loss"] is None and strict["grad_norm"] is None and strict["acc"] == [0.5, None]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] is None
    assert read_test_metrics(tmp_path)[0]["acc"] == [0.5, None]


def test_a_failed_metrics_write_names_the_file_the_cause_and_what_is_kept(tmp_path):
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    metrics = _logger(tmp_path)
    metrics.log(_record(1))

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    real, metrics.file = metrics.file, FullDisk()
    with pytest.raises(MetricsWriteError) as failed:
        metrics.log(_record(2))
    real.close()
    message = str(failed.value)
    assert f"cannot write step 2 to {tmp_path / 'metrics.jsonl'}: the disk is full" in message
    assert "Kept: metrics.jsonl through step 1, checkpoints up to step_00000001" in message
    assert "train.resume=true" in message


def test_a_job_whose_every_step_was_skipped_fails_naming_the_reasons():
    from dflash_mp.run.metrics import NothingTrained, StepTally

    tally = StepTally()
    for step in range(1, 6):
        tally.add(_record(step, loss=None, skipped=True, skip_reason="no_loss_tokens"))
    with pytest.raises(NothingTrained, match=r"all 5 steps of this job \(steps 1 to 5\).*no_loss_tokens: 5"):
        tally.require_training()
    tally.add(_record(6, skipped=False, skip_reason=None))
    tally.require_training()  # one applied step: it trained
    StepTally().require_training()  # no step at all (nothing was due): not this failure


def test_the_progress_line_shows_tokens_per_second_and_the_peak_memory(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr("dflash_mp.run.metrics.get_logger", lambda: type("L", (), {"info": lines.append})())
    metrics = _logger(tmp_path)
    metrics.log(_record(10, tokens_per_s=12345.0, peak_memory_gib=40.31))
    metrics.close()
    assert "12345 tokens/s" in lines[-1] and "peak 40.3 GiB" in lines[-1]


def test_the_progress_line_names_a_slow_path(tmp_path, monkeypatch):
    """A fused loss path that turned itself off (objective/fused_check.py) shows on every progress
    line, not only in the rank log's one warning."""
    lines = []
    monkeypatch.setattr("dflash_mp.run.metrics.get_logger", lambda: type("L", (), {"info": lines.append})())
    metrics = _logger(tmp_path)
    metrics.log(_record(10))
    metrics.log(_record(20, slow_paths="XPress's fused loss kernels"))
    metrics.close()
    assert "SLOW" not in lines[0]
    assert "SLOW: XPress's fused loss kernels on the torch path" in lines[1]
