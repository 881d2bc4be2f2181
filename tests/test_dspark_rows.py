"""DSpark's CE + KL + TV with the gradient taken in the forward (objective/dspark_rows.py) against the
autograd reference (`row_terms` + `reduce_terms`, which tests/test_dspark_parity.py holds equal to
speculators 0.9.0), fp32 on CPU: the loss, the terms, argmax == label and the gradients of the hidden
states, the Markov features and w2, over several chunks (the last one partial), with the decay and
D-PACE weights, with and without the Markov bias, soft-capping and an output multiplier, the KL's
weight zero or not, and without a teacher; then through `dspark_loss`, every trainable parameter of
a small DSpark drafter."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.dspark_fields import dspark_chunk_rows
from dflash_mp.objective import dspark_loss as dspark_loss_module
from dflash_mp.objective import dspark_rows
from dflash_mp.objective.block_diffusion import drafter_loss
from dflash_mp.objective.dspark_loss import DSparkLossWeights
from dflash_mp.objective.dspark_rows import RowLossOptions, chunk_rows_of, dspark_row_loss
from tests.dspark_autograd_reference import reduce_terms, row_terms

VOCAB, HIDDEN, RANK, BLOCK, BLOCKS = 300, 16, 6, 4, 12
CHUNK = 5 * BLOCK  # chunks of 5, 5 and 2 blocks
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    rows = BLOCKS * BLOCK

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator)

    hidden = randn(rows, HIDDEN)
    mask = torch.rand(rows, generator=generator) > 0.25
    mask[3 * BLOCK : 4 * BLOCK] = False  # a block with nothing scored
    decay = torch.exp(-(torch.arange(rows) % BLOCK).float() / 2.0)
    return {
        "hidden": hidden,
        "markov": randn(rows, RANK),
        "teacher": hidden + randn(rows, HIDDEN, scale=0.5),  # near the draft: ties of sign in p - q
        "labels": torch.randint(0, VOCAB, (rows,), generator=generator),
        "head": randn(VOCAB, HIDDEN, scale=0.7),
        "w2": randn(VOCAB, RANK, scale=0.3),
        "weights": decay * mask,
    }


def _run(x: dict, markov: bool, teacher: bool, options: RowLossOptions, reference: bool):
    """(loss, the three term values, terms, correct, {name: gradient})."""
    hidden = x["hidden"].clone().requires_grad_(True)
    features = x["markov"].clone().requires_grad_(True) if markov else None
    w2 = x["w2"].clone().requires_grad_(True) if markov else None
    args = (hidden, features, x["teacher"] if teacher else None, x["labels"], x["head"], w2)
    if reference:
        terms, correct = row_terms(*args, options.multiplier, options.softcap, chunk_rows=7)
        alphas = DSparkLossWeights(*options.alphas, confidence=0.0)
        loss, values, _ = reduce_terms(terms, None, x["weights"], alphas, options.dpace_alpha, BLOCK)
        values, terms = values[:3], terms.detach()
    else:
        loss, values, terms, correct = dspark_row_loss(*args, x["weights"], options)
    loss.backward()
    grads = {"hidden": hidden.grad} | ({"markov": features.grad, "w2": w2.grad} if markov else {})
    return loss.detach(), values, terms, correct, grads


def _assert_equal_to_the_reference(x: dict, markov: bool, teacher: bool, options: RowLossOptions) -> None:
    got = _run(x, markov, teacher, options, reference=False)
    expected = _run(x, markov, teacher, options, reference=True)
    for name, a, b in zip(("loss", "values", "terms"), got[:3], expected[:3], strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(got[3], expected[3])
    assert got[4].keys() == expected[4].keys()
    for name, grad in expected[4].items():
        assert grad.abs().max() > 1e-3, name  # a gradient a wrong derivative would change
        torch.testing.assert_close(got[4][name], grad, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dpace_alpha", [None, 0.4])
@pytest.mark.parametrize("markov", [True, False])
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.7, None), (0.7, 6.0)])
@pytest.mark.parametrize("kl_alpha", [0.0, 0.9])
def test_the_terms_and_gradients_equal_the_autograd_reference(
    dpace_alpha, markov, multiplier, softcap, kl_alpha
):
    options = RowLossOptions((0.3, kl_alpha, 1.8), BLOCK, dpace_alpha, multiplier, softcap, CHUNK)
    x = _inputs()
    _assert_equal_to_the_reference(x, markov, True, options)
    got = dspark_row_loss(
        x["hidden"], None, x["teacher"], x["labels"], x["head"], None, x["weights"], options
    )
    assert float(got[2][:, 2].min()) > 0.05 and float(got[2][:, 1].max()) > 0.1  # TV and KL not trivial


@pytest.mark.parametrize("dpace_alpha", [None, 0.4])
@pytest.mark.parametrize("markov", [True, False])
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.7, None), (0.7, 6.0)])
def test_without_a_teacher_the_ce_equals_the_autograd_reference(dpace_alpha, markov, multiplier, softcap):
    options = RowLossOptions((1.0, 0.0, 0.0), BLOCK, dpace_alpha, multiplier, softcap, CHUNK)
    _assert_equal_to_the_reference(_inputs(1), markov, False, options)


def test_under_no_grad_the_values_are_the_same_and_no_gradient_is_taken(monkeypatch) -> None:
    x, options = _inputs(2), RowLossOptions((0.3, 0.9, 1.8), BLOCK, 0.4, 0.7, 6.0, CHUNK)
    args = (x["hidden"], x["markov"], x["teacher"], x["labels"], x["head"], x["w2"], x["weights"], options)
    with_grad = dspark_row_loss(*args)
    monkeypatch.setattr(dspark_rows, "_logit_grad_", None)  # a call would fail
    with torch.no_grad():
        without = dspark_row_loss(*args)
    for a, b in zip(with_grad, without, strict=True):
        assert torch.equal(a, b)


def test_ties_of_draft_and_teacher_split_the_tv_gradient_as_torch_minimum_does() -> None:
    """Where q_v == p_v exactly, torch.minimum's backward gives q half the gradient; so does the
    TV's derivative here (m_v = 1/2), at the same q and p."""
    generator = torch.Generator().manual_seed(3)
    z = torch.randn(BLOCK, 10, generator=generator).requires_grad_(True)
    q = torch.softmax(z, -1)
    p = q.detach() * torch.tensor([1.0, 1.0, 1.0, 1.3, 0.7, 1.0, 1.2, 0.8, 1.0, 1.1])  # ties at 0, 1, 2, 5, 8
    (1.0 - torch.minimum(q, p).sum(-1)).sum().backward()
    labels, c = torch.zeros(BLOCK, dtype=torch.long), torch.tensor([[0.0, 0.0, 1.0]] * BLOCK)
    got = dspark_rows._logit_grad_(torch.empty_like(q), q.detach(), p, labels, c, kl=False)
    torch.testing.assert_close(got, z.grad, rtol=1e-6, atol=1e-7)
    strict = torch.where(q < p, 1.0, 0.0)  # no half at ties: another gradient
    accepted = (q * strict).sum(-1, keepdim=True)
    assert not torch.allclose(q * (accepted - strict), z.grad, rtol=1e-3, atol=1e-4)


def test_the_chunks_are_whole_blocks_of_dspark_chunk_rows(monkeypatch) -> None:
    assert chunk_rows_of(151936, 16) == dspark_chunk_rows(151936) // 16 * 16 == 880
    assert chunk_rows_of(10**9, 16) == 16 and chunk_rows_of(300, 4, 7) == 4
    seen = []
    original = dspark_rows._chunk
    monkeypatch.setattr(
        dspark_rows, "_chunk", lambda inputs, *a: seen.append(inputs[0].shape[0]) or original(inputs, *a)
    )
    x = _inputs()
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, chunk_rows=CHUNK + 3)
    dspark_row_loss(x["hidden"], None, x["teacher"], x["labels"], x["head"], None, x["weights"], options)
    assert seen == [CHUNK, CHUNK, 2 * BLOCK]


def test_a_head_that_trains_is_refused() -> None:
    x = _inputs()
    with pytest.raises(ValueError, match="frozen"):
        dspark_row_loss(
            x["hidden"], None, None, x["labels"], x["head"].requires_grad_(True), None, x["weights"],
            RowLossOptions((1.0, 0.0, 0.0), BLOCK),
        )  # fmt: skip


def _reference_row_loss(hidden, markov, teacher, labels, head, w2, weights, options):
    """`dspark_row_loss`'s contract through the autograd reference."""
    terms, correct = row_terms(
        hidden, markov, teacher, labels, head, w2, options.multiplier, options.softcap, 7
    )
    alphas = DSparkLossWeights(*options.alphas, confidence=0.0)
    loss, values, _ = reduce_terms(terms, None, weights, alphas, options.dpace_alpha, options.block_size)
    return loss, values[:3], terms.detach(), correct


def _drafter_loss(dpace_alpha, multiplier, softcap, head_type, chunk_rows=None):
    target = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
    )  # fmt: skip
    dspark = {"markov_rank": 4, "markov_head_type": head_type}
    config = build_drafter_config(
        target, 1, [1], block_size=BLOCK, mask_token_id=VOCAB - 1, arch="dspark", dspark=dspark
    )
    drafter = DFlashDrafter(config, seed=0)
    drafter.output_multiplier, drafter.final_logit_softcapping = multiplier, softcap
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (2, 40), generator=generator)
    batch = SimpleNamespace(
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids),
        lengths=torch.tensor([40, 31]),
        sample_ids=torch.arange(2),
        epoch=0,
        hidden_states=torch.randn(2, 40, 64, generator=generator),
    )
    with torch.no_grad():  # a Markov bias of the logits' size
        for param in drafter.markov_head.parameters():
            param.normal_(0.0, 0.5, generator=generator)
    embed, head = (
        torch.randn(VOCAB, 32, generator=generator),
        0.2 * torch.randn(VOCAB, 32, generator=generator),
    )
    weights = DSparkLossWeights(ce=0.3, kl=0.7, tv=1.8, confidence=0.9)
    options = dict(
        seed=0, num_anchors=6, gamma=2.0, attention="sdpa", dspark=weights, dpace_alpha=dpace_alpha,
        vocabulary_chunk_rows=chunk_rows,
    )  # fmt: skip
    loss, stats = drafter_loss(drafter, embed, head, batch, **options)
    loss.backward()
    grads = {name: p.grad for name, p in drafter.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


def _recording(chunk, rows: list[int]):
    """`_chunk` that notes each chunk's rows."""

    def record(inputs, *args):
        rows.append(inputs[0].shape[0])
        return chunk(inputs, *args)

    return record


@pytest.mark.parametrize(
    ("dpace_alpha", "multiplier", "softcap", "head_type"),
    [(None, 1.0, None, "gated"), (0.4, 0.7, 6.0, "rnn")],
)
def test_dspark_loss_equals_the_autograd_reference(monkeypatch, dpace_alpha, multiplier, softcap, head_type):
    chunks = []
    monkeypatch.setattr(dspark_rows, "_chunk", _recording(dspark_rows._chunk, chunks))
    got = _drafter_loss(dpace_alpha, multiplier, softcap, head_type, chunk_rows=2 * BLOCK + 1)  # two blocks
    assert len(chunks) > 2 and max(chunks) == 2 * BLOCK  # train.vocabulary_chunk_rows reached the loss
    monkeypatch.setattr(dspark_loss_module, "dspark_row_loss", _reference_row_loss)
    expected = _drafter_loss(dpace_alpha, multiplier, softcap, head_type)
    torch.testing.assert_close(got[0], expected[0], **TOLERANCE)
    assert got[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        torch.testing.assert_close(got[1][name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
    assert expected[1]["count"].sum() > 3 * BLOCK  # several chunks
    assert got[2].keys() == expected[2].keys() and len(expected[2]) > 10
    for name, grad in expected[2].items():  # at fp32 rounding of the parameter's largest gradient
        scale = float(grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(
            got[2][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("agrees", [True, False])
def test_the_first_fused_chunk_is_checked_against_the_torch_path(monkeypatch, caplog, agrees) -> None:
    """The compiled kernels' first chunk runs beside the torch path, whose numbers it keeps; a fused
    path that disagrees is turned off with one warning, one that agrees takes the later chunks."""
    x = _inputs()
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, None, 1.0, None, CHUNK)
    monkeypatch.setattr(dspark_rows, "vocabulary_kernels_run_on", lambda device: False)
    expected = _run(x, True, True, options, reference=False)
    fused_calls = []

    def fused(inputs, head, w2, scale, opts, grads):  # the torch path, off by 10% when disagreeing
        fused_calls.append(inputs[-1])
        terms, correct, sums = dspark_rows._torch_chunk(inputs, head, w2, scale, opts, grads)
        return (terms, correct, sums) if agrees else (terms * 1.1, correct, sums * 1.1)

    monkeypatch.setattr(dspark_rows, "vocabulary_kernels_run_on", lambda device: True)
    monkeypatch.setattr(dspark_rows, "_fused_chunk", fused)
    monkeypatch.setattr(dspark_rows, "_fused_error", None)
    monkeypatch.setattr(dspark_rows, "_fused_checked", False)
    with caplog.at_level(logging.WARNING, logger=dspark_rows.__name__):
        got = _run(x, True, True, options, reference=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(fused_calls) == (3 if agrees else 1)  # three chunks: the checked one, then fused or not
    assert (dspark_rows._fused_error is None) == agrees and len(warnings) == (0 if agrees else 1)
    for a, b in zip(got[:4], expected[:4], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in expected[4]:
        torch.testing.assert_close(got[4][name], expected[4][name], rtol=0, atol=0)


class _Outputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (shape, dtype) of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.seen.add((tuple(tensor.shape), tensor.dtype))
        return out


def test_under_autocast_the_bf16_head_is_never_copied_to_fp32() -> None:
    """Training runs under bf16 autocast with fp32 hidden states and Markov features and the
    frozen head in bf16: the matmuls take the operands in bf16 as autocast casts them, with no
    fp32 copy of the head (one per chunk and matmul, and a bf16 one back, cost ~60 ms a step at
    Qwen3-8B shape), and the numbers are those of casting them by hand."""
    x = _inputs()
    x["head"] = x["head"].bfloat16()
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, None, chunk_rows=CHUNK)
    with torch.autocast("cpu", dtype=torch.bfloat16), _Outputs() as outputs:
        got = _run(x, True, True, options, reference=False)
    assert ((VOCAB, HIDDEN), torch.float32) not in outputs.seen
    assert ((VOCAB, RANK), torch.bfloat16) in outputs.seen  # w2 cast as autocast casts it
    leaves = [x[name].bfloat16().requires_grad_(True) for name in ("hidden", "markov", "w2")]
    hidden, markov, w2 = leaves
    loss, _, terms, _ = dspark_row_loss(
        hidden, markov, x["teacher"].bfloat16(), x["labels"], x["head"], w2, x["weights"], options
    )
    loss.backward()
    torch.testing.assert_close(got[0], loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got[2], terms, rtol=0, atol=0)
    torch.testing.assert_close(got[4]["hidden"], hidden.grad.float(), rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(got[4]["w2"], w2.grad.float(), rtol=1e-2, atol=1e-6)
