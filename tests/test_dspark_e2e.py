"""A DSpark job end to end under torchrun: two drafter ranks (DDP, the heads used outside the
wrapped forward; target ranks sending the teacher's last layer) equal the single-process reference
trainer, and the job's export loads into speculators' DSparkDraftModel."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.reference import reference_train
from tests.conftest import read_metrics, run_train
from tests.speculators_reference import speculators_module

pytestmark = pytest.mark.slow

COMMON = (
    "model.arch=dspark",
    "model.markov_rank=16",
    "model.markov_head_type=gated",
    "model.dspark_kl_alpha=0.5",
    "train.max_steps=3",
    "train.micro_batch_size=2",
    "data.num_anchors=32",
    "logger.progress_every=100",
    "eval.every=0",
)


def test_two_dspark_drafter_ranks_match_the_reference_trainer(tmp_path) -> None:
    run_train(tmp_path / "run", *COMMON, "topology.targets=1", "topology.drafters=2", "train.grad_accum=1")
    records: list[dict] = []
    reference_train(to_dataclass(compose_config([*COMMON, "train.grad_accum=2"])), on_step=records.append)
    ran = read_metrics(tmp_path / "run")
    for key in (
        "loss",
        "dspark_ce",
        "dspark_kl",
        "dspark_tv",
        "confidence_bce",
        "accept_len",
        "confidence_pred",
    ):
        assert [r[key] for r in ran] == pytest.approx([r[key] for r in records], rel=1e-5), key
    assert all(0 < r["dspark_tv"] < 1 for r in ran)  # the teacher arrived: TV is a real distance
    core = speculators_module("models.dspark.core")
    export = tmp_path / "run" / "export"
    config = core.DSparkSpeculatorConfig.from_dict(json.loads((export / "config.json").read_text()))
    missing, unexpected = core.DSparkDraftModel(config).load_state_dict(
        load_file(export / "model.safetensors"), strict=False
    )
    assert not unexpected and not [key for key in missing if "markov" in key or "confidence" in key]
