"""`python -m dflash_mp.plot RUN_DIR`: PNGs from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_mp.plot import main
from dflash_mp.run.plots import _smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir: Path, with_tau: bool) -> None:
    lines = []
    for step in range(1, 6):
        record = {
            "step": step,
            "loss": 5.0 / step,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "samples_per_s": 10.0 + step,
            "tokens_per_s": 1000.0,
            "acc": [0.1 * step / (k + 1) for k in range(7)],
        }
        if with_tau and step % 2 == 0:
            record["tau"] = 1.0 + 0.3 * step
        lines.append(json.dumps(record))
    lines.append('{"step": 6, "loss": 0.')  # a line cut short by a kill
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("with_tau", [True, False])
def test_plots_every_logged_series(tmp_path: Path, with_tau: bool, capsys: pytest.CaptureFixture) -> None:
    _write_metrics(tmp_path, with_tau)
    assert main([str(tmp_path)]) == 0
    expected = {"loss.png", "acc.png", "samples_per_s.png"} | ({"tau.png"} if with_tau else set())
    written = {p.name for p in (tmp_path / "plots").iterdir()}
    assert written == expected
    for name in expected:
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG_MAGIC)
    assert len(capsys.readouterr().out.splitlines()) == len(expected)


def test_missing_or_empty_metrics_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 2
    assert "no step records" in capsys.readouterr().err


def test_smoothing_is_a_trailing_mean() -> None:
    assert _smooth([1.0, 2.0, 3.0, 5.0], 2) == [1.0, 1.5, 2.5, 4.0]
    assert _smooth([4.0, 2.0], 1) == [4.0, 2.0]


def test_a_dflash2_run_gets_the_selector_plot(tmp_path: Path) -> None:
    _write_metrics(tmp_path, with_tau=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:-1]]
    for record in records:
        record.update(
            topk_recall=[0.9] * 7,
            selector_acc=[0.5] * 7,
            accepted_len_selector=2.0 + record["step"],
            accepted_len_unary=2.0,
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "selector.png").read_bytes().startswith(PNG_MAGIC)


def test_the_throughput_axis_is_set_by_the_steady_steps() -> None:
    from dflash_mp.run.plots import steady_top

    rates = [5000.0] + [4.0 + 0.1 * (i % 3) for i in range(40)]  # the first step's odd rate
    assert 4.2 < steady_top(rates) < 6.0
