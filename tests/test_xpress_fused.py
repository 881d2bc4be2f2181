"""XPress's loss through fused_dspark.py's CE-only passes (objective/xpress_vocabulary.py
`FusedVocabulary`) against its torch path: the loss, the terms, the teacher-forced accuracy and
every gradient, on CUDA or on the CPU under Triton's interpreter (tests/test_triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.objective import xpress_rows, xpress_vocabulary
from dflash_mp.objective.xpress_loss import XPressWeights
from tests.test_xpress_chunks import CHUNK, _run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.triton
def test_the_fused_passes_equal_the_torch_path(monkeypatch) -> None:
    # D-PACE weights and an undecayed anchor: every kind of pass weight the kernels are given.
    weights = XPressWeights(0.3, 3, 0.6, base_anchor_full_weight=True, dpace_alpha=0.4)
    monkeypatch.setattr(xpress_rows, "_fused_tried", True)  # no first-chunk guard: a failure fails
    calls = []
    terms = xpress_vocabulary.dspark_terms

    def counted(*args, **kwargs):
        calls.append(1)
        return terms(*args, **kwargs)

    monkeypatch.setattr(xpress_vocabulary, "dspark_terms", counted)
    monkeypatch.setattr(xpress_rows, "fused_dspark_runs_on", lambda device: True)
    loss, stats, grads = _run(weights, chunk_blocks=CHUNK, device=DEVICE)
    assert calls  # the kernels ran
    monkeypatch.setattr(xpress_rows, "fused_dspark_runs_on", lambda device: False)
    calls.clear()
    ref_loss, ref_stats, ref_grads = _run(weights, chunk_blocks=CHUNK, device=DEVICE)
    assert not calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["xpress"], ref_stats["xpress"], rtol=1e-5, atol=1e-6)
    assert torch.equal(stats["correct"], ref_stats["correct"])
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
