"""The heads after DFlash 2 on a stock target, colocated (the split layouts on the embedded target
are tests/test_dspark_e2e.py and tests/test_xpress_e2e.py): `model.arch=dspark,xpress` as the two
points of one Hydra sweep over a stock-layout Qwen3 (its real 151936-token vocabulary), each point
one colocated rank under torchrun. Each trains, logs its own loss terms, and exports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_tiny_colocated_sweep

pytestmark = pytest.mark.slow

ARCHS = ("dspark", "xpress")
TERMS = {"dspark": ("dspark_ce", "confidence_bce"), "xpress": ("tf_loss", "consistency_loss")}
# What the job's own export declares: speculators' DSpark format (vLLM's method=dspark) for DSpark;
# XPress's DFlash-layout export (`python -m dflash_mp.export --speculators` writes speculators' one).
ARCHITECTURES = {"dspark": ["DSparkSpeculator"], "xpress": ["XPressDraftModel"]}


@pytest.fixture(scope="module")
def head_sweep(tmp_path_factory: pytest.TempPathFactory, stock_qwen3_target: Path):
    return run_tiny_colocated_sweep(
        tmp_path_factory.mktemp("heads"),
        f"model.arch={','.join(ARCHS)}",
        "model.markov_rank=8",
        "model.xpress_rank=8",
        f"model.target_path={stock_qwen3_target}",
        timeout=240,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_head_trains_colocated_on_a_stock_target_and_exports(arch: str, head_sweep) -> None:
    sweep, job = head_sweep
    point = json.loads((sweep / "points" / f"{ARCHS.index(arch)}.json").read_text())
    assert f"model.arch={arch}" in point["overrides"]
    run = Path(point["run_dir"])
    log = (run / "logs" / "job.log").read_text() if (run / "logs" / "job.log").exists() else ""
    assert point["outcome"] == "succeeded", log[-3000:] + job.stdout[-2000:] + job.stderr[-2000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for term in ("loss", *TERMS[arch]):
        assert all(math.isfinite(m[term]) for m in metrics), (term, metrics)
    exported = json.loads((run / "export" / "config.json").read_text())
    assert exported["architectures"] == ARCHITECTURES[arch], exported
    assert exported["block_size"] == 4 and (run / "export" / "model.safetensors").is_file()
