"""The memory model's vocabulary-sized drafter terms (dflash_mp/plan/memory_heads.py) against the code
they predict: DSpark's loss chunk has the rows `dspark_row_loss` takes, XPress's the blocks `xpress_row_loss`
takes and the bytes it holds, the heads' parameters are the modules', and `python -m dflash_mp.plan memory`
shows them per arch."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.models.dspark import ConfidenceHead, MarkovHead
from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks
from dflash_mp.models.xpress import XPressRefiner
from dflash_mp.objective import dspark_rows, xpress_rows
from dflash_mp.plan.cli import main as plan_main
from dflash_mp.plan.memory import DEFAULT_CONSTANTS, drafter_parameters, drafter_rank
from dflash_mp.plan.memory_check import training_shape
from dflash_mp.plan.memory_heads import head_parameters, vocabulary_work, xpress_ce_passes
from dflash_mp.plan.targets import PRESET_TARGETS

QWEN3_8B = PRESET_TARGETS["qwen3-8b"]


def _shape(*overrides: str):
    cfg = to_dataclass(compose_config(["experiment=qwen3-8b", "topology=colocated", *overrides]))
    return training_shape(cfg, QWEN3_8B)


@pytest.mark.parametrize("chunk_rows", [None, 100])  # 100: six blocks of 16
def test_the_dspark_chunk_is_the_one_the_loss_takes(monkeypatch, chunk_rows) -> None:
    shape = _shape("model.arch=dspark", f"train.vocabulary_chunk_rows={chunk_rows or 'null'}")
    vocab, hidden, block = shape.target.vocab, 4, shape.block_size
    seen = []
    chunk_body = dspark_rows._chunk

    def record(inputs, *args):
        seen.append(inputs[0].shape[0])  # the chunk's hidden rows
        return chunk_body(inputs, *args)

    monkeypatch.setattr(dspark_rows, "_chunk", record)
    head = torch.zeros(1, hidden).expand(vocab, hidden)  # the vocabulary's rows without their memory
    rows = 2 * dspark_rows.chunk_rows_of(vocab, block, chunk_rows) + 3 * block
    options = dspark_rows.RowLossOptions(alphas=(1.0, 0.0, 0.0), block_size=block, chunk_rows=chunk_rows)
    with torch.no_grad():
        dspark_rows.dspark_row_loss(
            torch.zeros(rows, hidden), None, None, torch.zeros(rows, dtype=torch.long), head, None,
            torch.ones(rows), options,
        )  # fmt: skip
    chunk = max(seen)
    assert len(seen) == 3 and sum(seen) == rows and chunk % block == 0
    assert chunk == (96 if chunk_rows else 880)
    name, nbytes, formula = vocabulary_work(shape, DEFAULT_CONSTANTS)
    all_rows = shape.micro_batch * shape.num_anchors * block  # every block row: Bs drafts
    assert name == "DSpark vocabulary chunk" and f"min({chunk}, N*Bs)" in formula
    assert nbytes == min(chunk, all_rows) * vocab * DEFAULT_CONSTANTS.dspark_chunk_copies * 4
    terms = {t.name for t in drafter_rank(shape).phases["drafter step"]}
    assert "DSpark vocabulary chunk" in terms and "LM-head chunk" not in terms


class _LiveVocabularyBytes(TorchDispatchMode):
    """The peak bytes of live tensors whose last dimension is the vocabulary (storages counted once)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.live, self.now, self.peak = vocab, {}, 0, 0

    def _gone(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                key = tensor.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live[key] = tensor.untyped_storage().nbytes()
                    self.now += self.live[key]
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(tensor, self._gone, key)
        return out


@pytest.mark.parametrize(("weight", "passes", "anchor"), [(0.3, 3, 0.6), (0.0, 3, 0.6), (0.3, 6, 0.0)])
def test_the_xpress_chunk_holds_what_the_loss_holds_whatever_the_passes(weight, passes, anchor) -> None:
    blocks, block, hidden, vocab = 6, 4, 8, 4099
    refiner = XPressRefiner(hidden, vocab, block, rank=4, mlp_ratio=2)
    labels = torch.randint(0, vocab, (blocks, block))
    mask = torch.ones(blocks, block, dtype=torch.bool)
    options = xpress_rows.XPressRowOptions(
        passes if weight else 0, weight, anchor, False, None, chunk_rows=blocks * block
    )
    states = torch.randn(blocks, block, hidden, requires_grad=True)
    head = torch.randn(vocab, hidden)
    with _LiveVocabularyBytes(vocab) as live:
        loss, _, _ = xpress_rows.xpress_row_loss(
            refiner, states, head, (labels, labels[:, 0], mask, mask.float()), options
        )
    elements = blocks * block * vocab
    # On the CPU the matmul outputs are fp32: the raw logits and each pass's dz take 2 B more than
    # the model's bf16; no fp32 copy of the bias is made, and logsumexp keeps no temporary (4 B
    # less each): 12 B + 4 B a pass, what the model's 18 B + 2 B a pass becomes there.
    c, count = DEFAULT_CONSTANTS, xpress_ce_passes(weight, passes, anchor)
    assert count == len(options.pass_weights())
    cpu = c.xpress_chunk_bytes + 2 - 4 - 4 + count * (c.xpress_pass_bytes + 2)
    assert 0.9 * cpu <= live.peak / elements <= cpu
    assert loss.item() > 0
    overrides = [f"model.xpress_consistency_weight={weight}", f"model.xpress_consistency_passes={passes}"]
    shape = _shape("model.arch=xpress", *overrides, f"model.xpress_base_anchor_weight={anchor}")
    name, nbytes, _ = vocabulary_work(shape, DEFAULT_CONSTANTS)
    rows = shape.micro_batch * shape.num_anchors * shape.block_size
    chunk = vocabulary_chunk_blocks(shape.target.vocab, shape.block_size) * shape.block_size
    assert name == "XPress vocabulary chunk"
    per_element = c.xpress_chunk_bytes + shape.xpress_passes * c.xpress_pass_bytes
    assert shape.xpress_passes == count and nbytes == min(chunk, rows) * shape.target.vocab * per_element


@pytest.mark.parametrize("chunk_rows", [None, 100])
def test_the_xpress_chunk_is_the_one_the_loss_takes(monkeypatch, chunk_rows) -> None:
    shape = _shape("model.arch=xpress", f"train.vocabulary_chunk_rows={chunk_rows or 'null'}")
    vocab, block, hidden = shape.target.vocab, shape.block_size, 4
    seen = []

    def record(kind, refiner, head, hidden, *args):
        seen.append(hidden.shape[0] // block)
        return torch.zeros(3, hidden.shape[0] // block, block), torch.zeros(
            hidden.shape[0] // block, block, dtype=torch.bool
        )

    monkeypatch.setattr(xpress_rows, "_chunk", record)
    # Rank 1: the vocabulary's rows at a small cost; the chunk is read from the head's.
    refiner = XPressRefiner(hidden, vocab, block, rank=1, mlp_ratio=1)
    blocks = 100
    labels = torch.zeros(blocks, block, dtype=torch.long)
    states = torch.zeros(blocks, block, hidden)
    options = xpress_rows.XPressRowOptions(3, 0.3, 0.6, False, None, chunk_rows=chunk_rows)
    with torch.no_grad():
        xpress_rows.xpress_row_loss(
            refiner,
            states,
            torch.zeros(vocab, hidden),
            (labels, labels[:, 0], labels > 0, states[..., 0]),
            options,
        )
    chunk = max(seen) * block
    assert len(seen) > 1 and sum(seen) == blocks and chunk == (96 if chunk_rows else 880)
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


@pytest.mark.parametrize("arch", ["dflash", "dflash2", "dspark", "xpress"])
def test_the_trainer_takes_the_configured_vocabulary_chunk(monkeypatch, arch) -> None:
    """train.vocabulary_chunk_rows reaches a training step's loss: the LM-head CE's chunk (DFlash,
    DFlash 2), whole blocks of it (DSpark, XPress)."""
    from dflash_mp.objective import lm_head_loss
    from dflash_mp.training.trainer import DrafterTrainer
    from tests.test_trainer import _micro_batch

    seen: list[int] = []
    if arch in ("dflash", "dflash2"):
        apply = lm_head_loss._LinearCrossEntropy.apply
        monkeypatch.setattr(
            lm_head_loss._LinearCrossEntropy, "apply", lambda *args: seen.append(args[4]) or apply(*args)
        )
    elif arch == "dspark":
        chunk = dspark_rows._chunk
        monkeypatch.setattr(
            dspark_rows, "_chunk", lambda inputs, *a: seen.append(inputs[0].shape[0]) or chunk(inputs, *a)
        )
    else:
        chunk = xpress_rows._chunk
        monkeypatch.setattr(
            xpress_rows,
            "_chunk",
            lambda kind, r, head, hidden, *a: (
                seen.append(hidden.shape[0]) or chunk(kind, r, head, hidden, *a)
            ),
        )
    overrides = [f"model.arch={arch}", "train.max_steps=1", "model.markov_rank=4", "model.xpress_rank=4"]
    cfg = to_dataclass(compose_config(overrides))
    block = cfg.model.block_size
    cfg.train.vocabulary_chunk_rows = 2 * block + 1
    trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=1)
    trainer.micro_step(_micro_batch(cfg), last_of_step=True)
    assert not trainer.optimizer_step()["skipped"]
    expected = 2 * block + (1 if arch in ("dflash", "dflash2") else 0)
    assert seen and max(seen) == expected, seen
    if arch in ("dspark", "xpress"):
        assert len(seen) > 2
