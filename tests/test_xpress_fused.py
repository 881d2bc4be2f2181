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
    for name in ("row_statistics", "ce_with_base"):
        kernel = getattr(xpress_vocabulary, name)

        def counted(*args, kernel=kernel, name=name, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(xpress_vocabulary, name, counted)
    monkeypatch.setattr(xpress_rows, "vocabulary_kernels_run_on", lambda device: True)
    loss, stats, grads = _run(weights, chunk_blocks=CHUNK, device=DEVICE)
    # The kernels ran: per chunk, the teacher-forced pass with the base anchor, then each round.
    per_chunk = ["ce_with_base"] + ["row_statistics"] * weights.consistency_passes
    chunks = len(calls) // len(per_chunk)
    assert chunks > 1 and calls == per_chunk * chunks
    monkeypatch.setattr(xpress_rows, "vocabulary_kernels_run_on", lambda device: False)
    calls.clear()
    ref_loss, ref_stats, ref_grads = _run(weights, chunk_blocks=CHUNK, device=DEVICE)
    assert not calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["xpress"], ref_stats["xpress"], rtol=1e-5, atol=1e-6)
    assert torch.equal(stats["correct"], ref_stats["correct"])
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_the_gradient_pass_refuses_what_its_offsets_cannot_address() -> None:
    """Mismatched shapes, and passes whose offsets pass int32, raise before any launch: the first
    fused chunk's check then turns the torch path on (test_xpress_chunks.py)."""
    from dflash_mp.kernels.fused_xpress import xpress_gradients_in_place

    def call(raw, biases):
        labels = torch.zeros(raw.shape[0], dtype=torch.long, device="meta")
        stats = torch.zeros(biases.shape[0], raw.shape[0], device="meta")
        return xpress_gradients_in_place(raw, biases, labels, stats, stats)

    meta = {"device": "meta", "dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="rows contiguous"):
        call(torch.empty(4, 10, **meta), torch.empty(2, 4, 11, **meta))
    rows, vocab = 2048, 1 << 19  # 2^30 elements a pass: the third pass's offset passes 2^31
    with pytest.raises(ValueError, match="overflow int32"):
        call(torch.empty(rows, vocab, **meta), torch.empty(3, rows, vocab, **meta))
