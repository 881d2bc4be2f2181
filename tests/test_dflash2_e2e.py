"""A DFlash 2 job end to end: two drafter ranks (DDP, the selector used outside the wrapped forward)
equal the single-process reference trainer, and the job's export loads into the reference package."""

from __future__ import annotations

import pytest
import torch
from dflash.model import DFlash2DraftModel

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.reference import reference_train
from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

COMMON = (
    "model.arch=dflash2",
    "model.selector_rank=32",
    "model.selector_gold_outside_top_k=inject",
    "train.max_steps=5",
    "train.micro_batch_size=2",
    "data.num_anchors=32",
    "logger.progress_every=100",
    "eval.every=0",
)


def test_two_dflash2_drafter_ranks_match_the_reference_trainer(tmp_path) -> None:
    run_train(tmp_path / "run", *COMMON, "topology.targets=1", "topology.drafters=2", "train.grad_accum=1")
    records: list[dict] = []
    reference_train(to_dataclass(compose_config([*COMMON, "train.grad_accum=2"])), on_step=records.append)
    ran = read_metrics(tmp_path / "run")
    for key in ("loss", "selector_loss", "accepted_len_selector", "accepted_len_unary"):
        assert [r[key] for r in ran] == pytest.approx([r[key] for r in records], rel=1e-5), key
    assert all(r["topk_recall"] == e["topk_recall"] for r, e in zip(ran, records, strict=True))
    draft, info = DFlash2DraftModel.from_pretrained(
        tmp_path / "run" / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert draft.candidate_selector.successor_codebook.weight.abs().max() > 0  # trained, and saved
