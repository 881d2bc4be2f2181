"""The memory model's vocabulary-sized drafter terms (dflash_mp/plan/memory_heads.py) against the code
they predict: DSpark's loss chunk has the rows `dspark_row_loss` takes, XPress's the blocks `xpress_terms`
takes and the passes it runs, the heads' parameters are the modules', and `python -m dflash_mp.plan memory`
shows them per arch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.models.dspark import ConfidenceHead, MarkovHead
from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks
from dflash_mp.models.xpress import XPressRefiner
from dflash_mp.objective import dspark_rows, xpress_loss
from dflash_mp.plan.cli import main as plan_main
from dflash_mp.plan.memory import DEFAULT_CONSTANTS, drafter_parameters, drafter_rank
from dflash_mp.plan.memory_check import training_shape
from dflash_mp.plan.memory_heads import head_parameters, vocabulary_work, xpress_ce_passes
from dflash_mp.plan.targets import PRESET_TARGETS

QWEN3_8B = PRESET_TARGETS["qwen3-8b"]


def _shape(*overrides: str):
    cfg = to_dataclass(compose_config(["experiment=qwen3-8b", "topology=colocated", *overrides]))
    return training_shape(cfg, QWEN3_8B)


def test_the_dspark_chunk_is_the_one_the_loss_takes(monkeypatch) -> None:
    shape = _shape("model.arch=dspark")
    vocab, hidden, block = shape.target.vocab, 4, shape.block_size
    seen = []
    chunk_body = dspark_rows._chunk

    def record(inputs, *args):
        seen.append(inputs[0].shape[0])  # the chunk's hidden rows
        return chunk_body(inputs, *args)

    monkeypatch.setattr(dspark_rows, "_chunk", record)
    head = torch.zeros(1, hidden).expand(vocab, hidden)  # the vocabulary's rows without their memory
    rows = 2 * dspark_rows.chunk_rows_of(vocab, block) + 3 * block
    with torch.no_grad():
        dspark_rows.dspark_row_loss(
            torch.zeros(rows, hidden), None, None, torch.zeros(rows, dtype=torch.long), head, None,
            torch.ones(rows), dspark_rows.RowLossOptions(alphas=(1.0, 0.0, 0.0), block_size=block),
        )  # fmt: skip
    chunk = max(seen)
    assert len(seen) == 3 and sum(seen) == rows and chunk % block == 0
    name, nbytes, formula = vocabulary_work(shape, DEFAULT_CONSTANTS)
    all_rows = shape.micro_batch * shape.num_anchors * block  # every block row: Bs drafts
    assert name == "DSpark vocabulary chunk" and f"min({chunk}, N*Bs)" in formula
    assert nbytes == min(chunk, all_rows) * vocab * DEFAULT_CONSTANTS.dspark_chunk_copies * 4
    terms = {t.name for t in drafter_rank(shape).phases["drafter step"]}
    assert "DSpark vocabulary chunk" in terms and "LM-head chunk" not in terms


@pytest.mark.parametrize(("weight", "passes", "anchor"), [(0.3, 3, 0.6), (0.0, 3, 0.6), (0.3, 2, 0.0)])
def test_the_xpress_chunk_counts_the_passes_the_loss_runs(monkeypatch, weight, passes, anchor) -> None:
    calls = []
    original = xpress_loss.weighted_ce
    monkeypatch.setattr(xpress_loss, "weighted_ce", lambda *args: calls.append(1) or original(*args))
    blocks, block, hidden, vocab = 2, 4, 8, 11
    refiner = XPressRefiner(hidden, vocab, block, rank=4, mlp_ratio=2)
    labels = torch.randint(0, vocab, (blocks, block))
    mask = torch.ones(blocks, block, dtype=torch.bool)
    terms = xpress_loss.XPressWeights(weight, passes, anchor)
    xpress_loss.xpress_terms(
        refiner,
        torch.randn(blocks, block, vocab),
        torch.randn(blocks, block, hidden),
        labels,
        labels[:, 0],
        mask,
        mask.float(),
        terms,
    )
    assert len(calls) == xpress_ce_passes(weight, passes, anchor)  # one chunk: each pass's CE once
    overrides = [f"model.xpress_consistency_weight={weight}", f"model.xpress_consistency_passes={passes}"]
    shape = _shape("model.arch=xpress", *overrides, f"model.xpress_base_anchor_weight={anchor}")
    name, nbytes, _ = vocabulary_work(shape, DEFAULT_CONSTANTS)
    rows = shape.micro_batch * shape.num_anchors * shape.block_size
    chunk = vocabulary_chunk_blocks(shape.target.vocab, shape.block_size) * shape.block_size
    c = DEFAULT_CONSTANTS
    assert name == "XPress vocabulary chunk" and shape.xpress_passes == len(calls)
    per_row = len(calls) * c.xpress_pass_bytes + c.xpress_transient_bytes
    assert nbytes == min(chunk, rows) * shape.target.vocab * per_row


def test_the_xpress_chunk_is_the_one_xpress_terms_takes(monkeypatch) -> None:
    shape = _shape("model.arch=xpress")
    vocab, block, hidden = shape.target.vocab, shape.block_size, 4
    seen = []

    def record(refiner, to_logits, base, *args):
        seen.append(base.shape[0])
        return torch.zeros(5, *base.shape[:2]), torch.zeros(base.shape[:2], dtype=torch.bool)

    monkeypatch.setattr(xpress_loss, "_chunk_terms", record)
    # Rank 1: the vocabulary's rows at a small cost; the chunk is read from the readout's.
    refiner = XPressRefiner(hidden, vocab, block, rank=1, mlp_ratio=1)
    blocks = 100
    labels = torch.zeros(blocks, block, dtype=torch.long)
    rows = torch.zeros(blocks, block, hidden)
    with torch.no_grad():
        xpress_loss.xpress_terms(
            refiner, rows, rows, labels, labels[:, 0], labels > 0, rows[..., 0], xpress_loss.XPressWeights()
        )
    chunk = max(seen) * block
    assert len(seen) > 1 and sum(seen) == blocks
    name, nbytes, formula = vocabulary_work(shape, DEFAULT_CONSTANTS)
    assert name == "XPress vocabulary chunk" and f"min({chunk}, N*Bs)" in formula
    terms = {t.name for t in drafter_rank(shape).phases["drafter step"]}
    assert name in terms and "LM-head chunk" not in terms


def _small(shape):
    """`shape` at hidden 16 and vocabulary 50, small enough to build its modules."""
    return replace(shape, target=replace(shape.target, hidden=16, vocab=50))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("with_markov", [True, False])
def test_dspark_head_parameters_are_the_modules(head_type: str, with_markov: bool) -> None:
    markov = f"model.confidence_head_with_markov={str(with_markov).lower()}"
    shape = _small(
        _shape("model.arch=dspark", "model.markov_rank=8", f"model.markov_head_type={head_type}", markov)
    )
    modules = [MarkovHead(50, 8, 16, head_type), ConfidenceHead(16 + (8 if with_markov else 0))]
    assert head_parameters(shape) == sum(p.numel() for m in modules for p in m.parameters())


def test_xpress_refiner_parameters_are_the_module() -> None:
    shape = _small(_shape("model.arch=xpress", "model.xpress_rank=8", "model.xpress_mlp_ratio=3"))
    refiner = XPressRefiner(16, 50, shape.block_size, rank=8, mlp_ratio=3)
    assert head_parameters(shape) == sum(p.numel() for p in refiner.parameters())
    assert head_parameters(_small(_shape())) == 0


def test_the_teacher_layer_travels_but_is_not_fc_input() -> None:
    dspark, dflash = _shape("model.arch=dspark"), _shape()
    assert dspark.feature_layers == dflash.feature_layers + 1 and dspark.teacher_layer
    assert drafter_parameters(dspark)[0] == drafter_parameters(dflash)[0]  # the same matmul weights


def test_plan_memory_shows_each_arch_vocabulary_term(capsys) -> None:
    expected = {
        "dflash": "LM-head chunk",
        "dspark": "DSpark vocabulary chunk",
        "xpress": "XPress vocabulary chunk",
    }
    peaks = {}
    for arch, term in expected.items():
        assert plan_main(["memory", "--target", "qwen3-8b", "experiment=qwen3-8b", f"model.arch={arch}"]) == 0
        out = capsys.readouterr().out
        assert term in out and all(other not in out for other in expected.values() if other != term), out
        peaks[arch] = drafter_rank(_shape(f"model.arch={arch}")).peak_gib
    # The heads and XPress's logits of every pass: both above DFlash at Qwen3's 152k vocabulary.
    assert peaks["dflash"] < peaks["dspark"] < peaks["xpress"]
