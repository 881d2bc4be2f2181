"""DSpark's fused vocabulary passes (dflash_mp/kernels/fused_dspark.py) against the torch path they
replace (objective/dspark_rows.py `_torch_chunk`, run with identity heads so that its "matmul
outputs" are the logits given): the terms, argmax == label and the gradients before the matmuls,
on CUDA or on the CPU under Triton's interpreter (tests/test_triton_interpreter.py); then
`dspark_row_loss` through the fused path against the autograd reference, and its fall-back to the
torch path when a kernel raises (on the CPU, no kernel run)."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_mp.kernels import fused_dspark
from dflash_mp.kernels.row_statistics import ChunkLogits
from dflash_mp.objective import dspark_rows, fused_check
from dflash_mp.objective.dspark_rows import RowLossOptions, dspark_row_loss, term_row_weights
from tests.test_dspark_rows import BLOCK, CHUNK, _inputs, _reference_row_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, BLOCK_ROWS = 6, 3
# Small tiles for the interpreter: 300 columns are 4 whole tiles and a ragged one, and 3 segments
# of 2 tiles (the last ragged); 256 are 4 whole tiles in 2 whole segments.
TILE, SEGMENT_TILES = 64, 2
SCALINGS = [(1.0, None), (0.5, None), (0.7, 6.0)]


def _logits(vocab: int, dtype: torch.dtype, scaling: tuple, teacher: bool, bias: bool, seed: int = 0):
    """ChunkLogits of ROWS rows: random rows; row 1 has its label as the argmax; row 2 equal draft and
    teacher rows (q == p everywhere); row 3, unless soft-capped, q == p on part of the row and 0 or
    p elsewhere (exact ties of nonzero q beside q > p and q < p)."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(ROWS, vocab, generator=generator) * 3
    near = draft + torch.randn(ROWS, vocab, generator=generator)  # signs of p - q change often
    markov = torch.randn(ROWS, vocab, generator=generator) * 0.5
    labels = torch.randint(0, vocab, (ROWS,), generator=generator)
    draft[1, 7], labels[1], markov[1] = 60.0, 7, 0.0
    near[2], markov[2] = draft[2], 0.0
    if scaling[1] is None:  # soft-capping lifts -1e4 to -cap: exp no longer 0, sums differ in rounding
        low = torch.full((vocab,), -1e4)
        draft[3] = torch.where(torch.arange(vocab) % 3 != 2, 0.0, low)  # q = 1/k on two thirds
        near[3] = torch.where(torch.arange(vocab) % 3 != 1, 0.0, low)  # p = 1/k: ties on a third
        markov[3], labels[3] = 0.0, 0  # z's maximum 0 at 200 places: argmax is the first
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return ChunkLogits(
        cast(draft), cast(markov) if bias else None, cast(near) if teacher else None,
        labels.to(DEVICE), *scaling,
    )  # fmt: skip


def _options(scaling: tuple, kl_alpha: float, dpace_alpha: float | None) -> RowLossOptions:
    return RowLossOptions((0.3, kl_alpha, 1.8), BLOCK_ROWS, dpace_alpha, *scaling)


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """(decay weights [ROWS], one unscored; alpha / denominator [3] is set per test)."""
    weights = torch.tensor([1.0, 0.8, 0.6, 1.0, 0.0, 0.5], device=DEVICE)
    return weights, weights.sum()


def _torch_path(x: ChunkLogits, opts: RowLossOptions, weights: torch.Tensor, scale: torch.Tensor):
    """(terms, correct, the hidden states' dz, the Markov bias's dz) of `_torch_chunk` with identity
    heads: its matmuls return the logits as given, and the gradients before its matmuls."""
    rows, vocab = x.draft.shape
    eye = torch.eye(vocab, device=DEVICE)
    grads = dspark_rows._Grads(
        torch.empty_like(x.draft), None if x.bias is None else torch.empty_like(x.bias), None
    )
    inputs = (x.draft, x.bias, x.teacher, x.labels, weights, slice(0, rows))
    w2 = None if x.bias is None else eye
    terms, correct, _ = dspark_rows._torch_chunk(inputs, eye, w2, scale, opts, grads)
    return terms, correct, grads.hidden, grads.markov


def _fused_path(x: ChunkLogits, opts: RowLossOptions, weights: torch.Tensor, scale: torch.Tensor):
    """The same from the kernels, the row weights from their own terms (as `_fused_chunk`)."""
    before = [None if t is None else t.clone() for t in (x.draft, x.bias, x.teacher)]
    terms, correct, stats = fused_dspark.dspark_terms(x, TILE, SEGMENT_TILES)
    for given, kept in zip((x.draft, x.bias, x.teacher), before, strict=True):
        assert given is None or torch.equal(given, kept)  # passes 1 and 2 only read
    c = term_row_weights(terms, weights, opts.dpace_alpha, opts.block_size) * scale
    hidden_dz, markov_dz = fused_dspark.dspark_grad_in_place(x, stats, c, tile=TILE)
    # Written over them; once, over the draft's, where scale's derivative is 1 and they are equal.
    unscaled = x.multiplier == 1.0 and x.softcap is None and x.bias is not None
    assert hidden_dz is x.draft and markov_dz is (x.draft if unscaled else x.bias)
    return terms, correct, hidden_dz, markov_dz


def _assert_close(got, expected, dtype: torch.dtype, name: str) -> None:
    scale = float(expected.float().abs().max())
    assert scale > 1e-4, name  # a gradient a wrong derivative would change
    # One rounding of nearly the same fp32 value: a bf16 gradient may differ by its last bit.
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    msg = lambda m: f"{name}: {m}"  # noqa: E731
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=1e-6 * scale, msg=msg)


def _compare(x: ChunkLogits, opts: RowLossOptions, dtype: torch.dtype) -> tuple:
    weights, denominator = _weights()
    if opts.dpace_alpha is not None:
        denominator = (weights > 0).sum().float()
    scale = torch.tensor(opts.alphas, device=DEVICE) / denominator
    expected = _torch_path(x, opts, weights, scale)  # first: the kernels overwrite their inputs
    got = _fused_path(x, opts, weights, scale)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"terms: {m}")
    assert torch.equal(got[1], expected[1]) and bool(expected[1][1])  # row 1: label is the argmax
    rows = _comparable_gradient_rows(x)
    _assert_close(got[2][rows], expected[2][rows], dtype, "hidden dz")
    if x.bias is not None:
        _assert_close(got[3][rows], expected[3][rows], dtype, "markov dz")
    return got, expected


def _comparable_gradient_rows(x: ChunkLogits) -> torch.Tensor:
    """The rows whose gradients both paths must give alike. Compiled for a GPU, the kernels' soft-
    capping (tanh from exp) may round the draft's and the teacher's copies of row 2's equal logits
    one bit apart, and TV's derivative jumps at q == p: there each side's one-sided derivative is
    right (dspark_rows.py's docstring), so row 2's gradient is compared on the CPU only."""
    rows = torch.ones(x.draft.shape[0], dtype=torch.bool)
    if x.teacher is not None and x.softcap is not None and DEVICE == "cuda":
        rows[2] = False
    return rows.to(DEVICE)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize(
    ("kl_alpha", "dpace_alpha", "bias"), [(0.9, None, True), (0.0, 0.4, True), (0.9, 0.4, False)]
)
def test_with_a_teacher_the_passes_equal_the_torch_path(dtype, scaling, kl_alpha, dpace_alpha, bias) -> None:
    x = _logits(300, dtype, scaling, teacher=True, bias=bias)
    got, _ = _compare(x, _options(scaling, kl_alpha, dpace_alpha), dtype)
    terms = got[0]
    assert float(terms[:, 1].max()) > 0.1 and float(terms[0, 2]) > 0.05  # KL and TV not trivial
    assert abs(float(terms[2, 1])) < 1e-5 and abs(float(terms[2, 2])) < 1e-6  # equal rows


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("bias", [True, False])
def test_without_a_teacher_the_ce_equals_the_torch_path(dtype, scaling, bias) -> None:
    x = _logits(300, dtype, scaling, teacher=False, bias=bias)
    got, _ = _compare(x, RowLossOptions((1.0, 0.0, 0.0), BLOCK_ROWS, None, *scaling), dtype)
    assert not got[0][:, 1:].any()  # KL and TV are 0


@pytest.mark.triton
def test_whole_tiles_and_segments_and_one_segment_per_row() -> None:
    scaling = (0.5, None)
    _compare(
        _logits(256, torch.float32, scaling, True, True, seed=1), _options(scaling, 0.9, None), torch.float32
    )
    x = _logits(300, torch.float32, scaling, True, True, seed=2)
    one, _, _ = fused_dspark.dspark_terms(x, TILE, 100)  # one segment
    many, _, _ = fused_dspark.dspark_terms(x, TILE, SEGMENT_TILES)
    torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-6)


@pytest.mark.triton
def test_ties_split_the_tv_gradient_in_halves() -> None:
    """Row 3's ties of nonzero q and p: with m_v = 1/2 there, not 0 or 1, the TV's gradient of the
    row is the torch path's and torch.minimum's; the kernels' Q_S is sum q m_v."""
    x = _logits(300, torch.float32, (1.0, None), teacher=True, bias=False)
    terms, _, stats = fused_dspark.dspark_terms(x, TILE, SEGMENT_TILES)
    q = torch.softmax(x.draft.float(), -1)
    p = torch.softmax(x.teacher.float(), -1)
    assert int((q[3] == p[3]).logical_and(q[3] > 0).sum()) == 100  # the ties are exact
    z = x.draft.float().clone().requires_grad_(True)
    (1.0 - torch.minimum(torch.softmax(z, -1), p).sum(-1)).sum().backward()
    c = torch.tensor([[0.0, 0.0, 1.0]] * ROWS, device=DEVICE)
    dz, _ = fused_dspark.dspark_grad_in_place(x, stats, c, tile=TILE)
    torch.testing.assert_close(dz[2:4], z.grad[2:4], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        stats.accepted[3], torch.tensor(0.25, device=DEVICE)
    )  # 100 ties of 1/200, halved
    torch.testing.assert_close(terms[3, 2], torch.tensor(0.5, device=DEVICE))


@pytest.mark.triton
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.7, 6.0)])
def test_dspark_row_loss_through_the_kernels_equals_the_reference(monkeypatch, multiplier, softcap) -> None:
    monkeypatch.setattr(dspark_rows, "_fused_error", None)
    monkeypatch.setattr(dspark_rows, "vocabulary_kernels_run_on", lambda device: True)  # the CPU too
    x = {k: v.to(DEVICE) for k, v in _inputs().items()}
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, 0.4, multiplier, softcap, CHUNK)
    got = _loss_and_grads(x, options, dspark_row_loss)
    assert dspark_rows._fused_error is None  # it ran fused
    expected = _loss_and_grads(x, options, _reference_row_loss)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _loss_and_grads(x: dict, options: RowLossOptions, loss_fn) -> dict:
    hidden, markov, w2 = (x[k].clone().requires_grad_(True) for k in ("hidden", "markov", "w2"))
    args = (hidden, markov, x["teacher"], x["labels"], x["head"], w2, x["weights"], options)
    loss, values, terms, correct = loss_fn(*args)
    loss.backward()
    out = {"loss": loss.detach(), "values": values, "terms": terms, "correct": correct.float()}
    return out | {"hidden": hidden.grad, "markov": markov.grad, "w2": w2.grad}


@pytest.mark.parametrize("failing", ["dspark_terms", "dspark_grad_in_place"])
def test_a_failing_kernel_gives_one_warning_and_the_torch_path_from_then_on(monkeypatch, caplog, failing):
    x = _inputs()
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, None, 0.7, 6.0, CHUNK)
    monkeypatch.setattr(fused_check, "_slow_paths", {})
    monkeypatch.setattr(dspark_rows, "vocabulary_kernels_run_on", lambda device: False)
    expected = _loss_and_grads(x, options, dspark_row_loss)
    monkeypatch.setattr(dspark_rows, "_fused_error", None)
    monkeypatch.setattr(dspark_rows, "vocabulary_kernels_run_on", lambda device: True)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no GPU to compile for")

    if failing == "dspark_grad_in_place":  # the terms' passes "run": the torch path's own terms
        monkeypatch.setattr(dspark_rows, "dspark_terms", _torch_terms)
    monkeypatch.setattr(dspark_rows, failing, broken)
    with caplog.at_level(logging.WARNING, logger=dspark_rows.__name__):
        got = _loss_and_grads(x, options, dspark_row_loss)
        _loss_and_grads(x, options, dspark_row_loss)  # a second step: no second try, no warning
    assert calls == [1]  # three chunks a step: the first failed, the rest ran the torch path
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: no GPU to compile for" in warnings[0], warnings
    assert fused_check.slow_paths() == {"DSpark's fused loss kernels": "RuntimeError: no GPU to compile for"}
    for name, value in expected.items():  # the same torch path: the same bits (w2's counted once)
        assert torch.equal(got[name], value), name


def _torch_terms(logits: ChunkLogits):
    """`dspark_terms`'s terms and argmax from the torch path, for a test that fails the next pass."""
    rows, vocab = logits.draft.shape
    eye = torch.eye(vocab)
    inputs = (logits.draft, logits.bias, logits.teacher, logits.labels, torch.ones(rows), slice(0, rows))
    opts = RowLossOptions((1.0, 0.0, 0.0), 1, None, logits.multiplier, logits.softcap)
    terms, correct, _ = dspark_rows._torch_chunk(inputs, eye, eye, torch.ones(3), opts, None)
    return terms, correct, None


def test_equal_draft_and_teacher_rows_tie_in_the_torch_path_as_in_the_reference() -> None:
    """Equal rows: the reference's two softmaxes tie everywhere (torch.minimum splits each tie's
    gradient); the torch path takes q and p alike, so it ties there too (the kernels do)."""
    x = _inputs(4)
    options = RowLossOptions((0.3, 0.9, 1.8), BLOCK, None, 0.7, None, CHUNK)
    x["teacher"], x["markov"] = x["hidden"], torch.zeros_like(x["markov"])  # z == t
    got = _loss_and_grads(x, options, dspark_row_loss)
    expected = _loss_and_grads(x, options, _reference_row_loss)
    assert float(expected["terms"][:, 1:].abs().max()) < 1e-5  # KL and TV 0: every row ties
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
