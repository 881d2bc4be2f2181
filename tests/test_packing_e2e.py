"""data.packing end to end on CPU: the packed job's losses do not depend on the number of target
ranks (the single-process reference is the 1-target case), a resume continues bitwise, and a
resume that would change the packing is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from dflash_mp.run import checkpoint
from dflash_mp.runtime.resume import ResumeRefused, check_settings
from tests.conftest import read_metrics, run_train
from tests.test_runtime_e2e import COMMON, NO_EXPORT, data_with_bad_line, reference_run  # noqa: F401

pytestmark = pytest.mark.slow

PACKED = ("data.packing=true", "data.max_length=256", "data.num_anchors=16", "train.grad_accum=2")


def test_packed_job_matches_the_reference_and_resumes_bitwise(data_with_bad_line, tmp_path):  # noqa: F811
    data = f"data.train_files=[{data_with_bad_line}]"
    args = [*COMMON, data, *PACKED, "topology.targets=2", "topology.drafters=1", NO_EXPORT]
    whole = tmp_path / "whole"
    run_train(whole, *args, "train.checkpoint_every=3")
    losses, reference = reference_run(data_with_bad_line, *PACKED)
    assert [r["loss"] for r in read_metrics(whole)] == losses  # 2 targets == 1, bitwise
    final = load_file(checkpoint.step_dir(whole / "checkpoints", 6) / "drafter.safetensors")
    for name, tensor in reference.drafter.state_dict().items():
        assert torch.equal(final[name], tensor), name
    # Packed rows hold several records: fewer micro-batches than records per epoch.
    metrics = read_metrics(whole)
    assert all(r["loss"] > 0 for r in metrics)

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    step_3 = checkpoint.step_dir(whole / "checkpoints", 3)
    shutil.copytree(step_3, resumed / "checkpoints" / step_3.name)
    run_train(resumed, *args, "train.resume=true")
    after = load_file(checkpoint.step_dir(resumed / "checkpoints", 6) / "drafter.safetensors")
    for name, tensor in final.items():
        assert torch.equal(after[name], tensor), name
    assert [r["loss"] for r in read_metrics(resumed)] == losses[3:]


def test_a_resume_that_changes_the_packing_is_refused():
    saved = {"micro_batch_size": 2, "seed": 0, "epochs": 6, "grad_accum": 1, "drafters": 1}
    unpacked_now = dict(saved, packing=False)
    assert check_settings(saved, unpacked_now, "ckpt") == []  # older checkpoints were unpacked
    with pytest.raises(ResumeRefused, match=r"data.packing"):
        check_settings(saved, dict(saved, packing=256), "ckpt")
    with pytest.raises(ResumeRefused, match=r"data.packing"):
        check_settings(dict(saved, packing=256), dict(saved, packing=512), "ckpt")
