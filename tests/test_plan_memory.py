"""The peak-memory prediction (dflash_mp/plan/memory.py) and the preflight that refuses a config
predicted not to fit its GPU, on every entry point (DFLASH_MP_GPU_MEMORY_GIB stands in for a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.launch.__main__ import main as launch_main
from dflash_mp.plan.cli import main as plan_main
from dflash_mp.plan.memory import colocated_rank, drafter_rank, target_rank
from dflash_mp.plan.memory_check import GPU_MEMORY_ENV, memory_verdict, training_shape
from dflash_mp.plan.targets import PRESET_TARGETS
from tests.conftest import REPO, job_env

QWEN3_8B = PRESET_TARGETS["qwen3-8b"]
ROWS = (3072, 8192, 16384, 32768)
FIXES = ("train.activation_checkpointing=true", "data.num_anchors", "data.max_length", "topology=3t5d")


def _qwen3_8b(*overrides: str):
    return to_dataclass(compose_config(["experiment=qwen3-8b", "topology=colocated", *overrides]))


def _peaks(*overrides: str) -> tuple[float, float, float]:
    shape = training_shape(_qwen3_8b(*overrides), QWEN3_8B)
    return tuple(rank(shape).peak_gib for rank in (colocated_rank, target_rank, drafter_rank))


def test_the_prediction_grows_with_the_row_and_checkpointing_lowers_it() -> None:
    kept = [_peaks(f"data.max_length={n}", f"data.num_anchors={512 * n // 3072}") for n in ROWS]
    for shorter, longer in zip(kept, kept[1:], strict=False):
        assert all(a < b for a, b in zip(shorter, longer, strict=True)), (shorter, longer)
    assert _peaks("data.max_length=8192")[0] > _peaks()[0]  # a longer row at the same anchors too
    for n in ROWS:
        rows = (f"data.max_length={n}", f"data.num_anchors={512 * n // 3072}")
        colocated, target, drafter = _peaks(*rows)
        relieved = _peaks(*rows, "train.activation_checkpointing=true")
        assert relieved[0] < colocated and relieved[2] < drafter and relieved[1] == target
    # The paper's recipe fits one 80 GB GPU colocated with room to spare (measured 36.7 GiB, BENCHMARKS.md).
    assert 30 < _peaks()[0] < 45


def test_the_breakdown_names_every_term_and_the_larger_phase() -> None:
    shape = training_shape(_qwen3_8b("train.cuda_graphs=false"), QWEN3_8B)
    breakdown = colocated_rank(shape)
    assert breakdown.peak_phase == "drafter step"
    text = "\n".join(breakdown.lines())
    for term in ("target weights", "drafter weights + AdamW", "draft layer activations", "LM-head chunk"):
        assert term in text, term
    total = sum(t.bytes for t in breakdown.resident) + breakdown.phase_bytes("drafter step")
    assert breakdown.peak_bytes == total and breakdown.needed_gib > breakdown.peak_gib


def test_a_gpu_between_the_two_predictions_refuses_the_kept_activations_naming_the_fixes(monkeypatch) -> None:
    long_rows = ("data.max_length=32768", "data.num_anchors=5461")
    kept, relieved = _peaks(*long_rows)[0], _peaks(*long_rows, "train.activation_checkpointing=true")[0]
    monkeypatch.setenv(GPU_MEMORY_ENV, str((kept + relieved) / 2 + 1.5))  # the reserve: ~1 GiB + 5%
    fits, message = memory_verdict(_qwen3_8b(*long_rows), QWEN3_8B)
    assert not fits and all(fix in message for fix in FIXES), message
    assert "(colocated)" in message and "predicted peak" in message
    fits, message = memory_verdict(_qwen3_8b(*long_rows, "train.activation_checkpointing=true"), QWEN3_8B)
    assert fits and message.startswith("predicted peak") and "per GPU of" in message, message


def test_no_gpu_and_no_given_memory_skips_the_check(monkeypatch) -> None:
    monkeypatch.delenv(GPU_MEMORY_ENV, raising=False)
    assert memory_verdict(_qwen3_8b("train.device=cpu"), QWEN3_8B) is None


@pytest.mark.parametrize(("gib", "code"), [("80", 0), ("0.001", 2)])
def test_doctor_prints_the_memory_line_or_refuses_with_exit_2(
    tmp_path, monkeypatch, capsys, gib, code
) -> None:
    monkeypatch.setenv(GPU_MEMORY_ENV, gib)
    overrides = ["topology=colocated", "topology.drafters=1", f"run_dir={tmp_path / 'run'}"]
    assert launch_main(["doctor", *overrides]) == code
    line = next(line for line in capsys.readouterr().out.splitlines() if " memory " in line)
    if code == 0:
        assert line.startswith("ok") and f"per GPU of {float(gib):.1f} GiB (colocated)" in line, line
    else:
        assert line.startswith("FAIL") and all(fix in line for fix in FIXES), line


def test_plan_memory_prints_the_breakdown_per_rank(capsys) -> None:
    args = [
        "memory",
        "--target",
        "qwen3-8b",
        "experiment=qwen3-8b",
        "data.max_length=8192",
        "--gpu-memory-gib",
        "1",
    ]
    assert plan_main(args) == 1  # judged against 1 GiB: does not fit
    out = capsys.readouterr().out
    for rank in ("colocated: predicted peak", "target rank: predicted peak", "drafter rank: predicted peak"):
        assert rank in out, out
    assert "rows of 8192 tokens" in out and "does not fit" in out
    assert plan_main(["memory", "optim.lrr=1"]) == 2


@pytest.mark.slow
def test_plain_torchrun_refuses_on_rank_0_before_loading_the_target(tmp_path) -> None:
    run = tmp_path / "run"
    env = {**job_env(), GPU_MEMORY_ENV: "0.001"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        + ["-m", "dflash_mp.train", "topology=colocated", "train.max_steps=2", f"run_dir={run}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    assert "dflash_mp: rank 0: refused: memory: predicted peak" in output
    assert all(fix in output for fix in FIXES)
    assert not (run / "heartbeats").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("arch", "now", "fix"), [("dflash", 2048, 512), ("dspark", 880, 208), ("xpress", 880, 208)]
)
def test_the_loss_vocabulary_chunk_is_a_named_fix_and_a_bad_one_is_refused(
    monkeypatch, arch, now, fix
) -> None:
    """The loss's vocabulary chunk (train.vocabulary_chunk_rows) is offered at a quarter (whole
    blocks for DSpark and XPress), and the peak it predicts is the one the config then gets."""
    from dflash_mp.config.schema import ConfigError
    from dflash_mp.config.validation import validate

    arch_rows = (f"model.arch={arch}", "data.max_length=8192", "data.num_anchors=1365")
    whole = _peaks(*arch_rows)[0]
    smaller = _peaks(*arch_rows, f"train.vocabulary_chunk_rows={fix}")[0]
    assert smaller < whole - 0.5  # GiB: the chunk holds one or more [rows, V] fp32 tensors
    relieved = training_shape(_qwen3_8b(*arch_rows, f"train.vocabulary_chunk_rows={fix}"), QWEN3_8B)
    monkeypatch.setenv(GPU_MEMORY_ENV, str(colocated_rank(relieved).needed_gib + 0.05))  # with the reserve
    fits, message = memory_verdict(_qwen3_8b(*arch_rows), QWEN3_8B)
    assert (
        not fits and f"train.vocabulary_chunk_rows={fix} (now {now}; predicted {smaller:.1f} GiB" in message
    )
    fits, _ = memory_verdict(_qwen3_8b(*arch_rows, f"train.vocabulary_chunk_rows={fix}"), QWEN3_8B)
    assert fits
    for bad in ("0", "-3"):  # a non-number: Hydra refuses it by the schema's type
        with pytest.raises(
            ConfigError, match="train.vocabulary_chunk_rows=.*: must be a number of rows >= 1"
        ):
            validate(compose_config([f"train.vocabulary_chunk_rows={bad}"]))
