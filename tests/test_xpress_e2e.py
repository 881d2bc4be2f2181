"""An XPress job end to end under real torchrun: two drafter ranks (DDP, the refiner used outside the
wrapped forward) equal the single-process reference trainer, the XPress terms are logged, and the
run's checkpoint exports in speculators' format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.reference import reference_train
from tests.conftest import REPO, job_env, read_metrics, run_train

pytestmark = pytest.mark.slow

COMMON = (
    "model.arch=xpress",
    "model.xpress_rank=16",
    "train.max_steps=2",
    "train.micro_batch_size=2",
    "data.num_anchors=16",
    "logger.progress_every=100",
    "eval.every=0",
)


def test_two_xpress_drafter_ranks_match_the_reference_trainer(tmp_path) -> None:
    run_train(tmp_path / "run", *COMMON, "topology.targets=1", "topology.drafters=2", "train.grad_accum=1")
    records: list[dict] = []
    reference_train(to_dataclass(compose_config([*COMMON, "train.grad_accum=2"])), on_step=records.append)
    ran = read_metrics(tmp_path / "run")
    for key in ("loss", "tf_loss", "consistency_loss", "base_anchor_loss"):
        assert [r[key] for r in ran] == pytest.approx([r[key] for r in records], rel=1e-5), key
    assert all(r["tf_loss"] > 0 and r["consistency_loss"] > 0 for r in ran)

    out = tmp_path / "speculators"
    cmd = [
        sys.executable,
        "-m",
        "dflash_mp.export",
        str(tmp_path / "run"),
        "--speculators",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, cwd=REPO, env=job_env(), check=True, capture_output=True, text=True, timeout=120)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "xpress" and config["xpress_rank"] == 16
    assert (out / "model.safetensors").stat().st_size > 0
