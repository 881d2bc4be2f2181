"""data.packing: the rows an epoch packs, and a packed row trains each document as if alone.

The target side (every family's hidden states of a packed row equal each document run alone) is
tests/test_packed_target.py; the whole job with packing (topology invariance, bitwise resume) is
in tests/test_runtime_e2e.py.
"""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
import torch

from dflash_mp.data.packing import PackedOrder, best_fit_decreasing, pack_epoch
from dflash_mp.kernels.block_mask import block_mask_mod, dense_block_mask, flex_block_mask
from dflash_mp.models.packed_rows import document_positions, single_document_ids, start_of_document
from dflash_mp.objective.block_diffusion import drafter_loss
from dflash_mp.objective.draft_blocks import draft_blocks, sample_anchors, sample_document_anchors
from tests.test_flash_attention import HIDDEN, VOCAB, dense_kernels, tiny_problem  # noqa: F401

ROW = 128  # data.max_length of these rows
ARGS = {"seed": 3, "num_anchors": 24, "gamma": 7.0}


def chat_like_lengths(count: int, seed: int = 0) -> list[int]:
    """Record lengths spread like regenerated chat data: short prompts, answers of any length."""
    rng = random.Random(seed)
    return [min(3072, rng.randint(30, 300) + rng.randint(50, 3000)) for _ in range(count)]


def test_rows_hold_every_usable_record_once_and_fill_the_rows() -> None:
    lengths = chat_like_lengths(3000) + [0] * 50  # unusable records (length 0) are left out
    rows = pack_epoch(lengths, seed=1, epoch=0, capacity=3072)
    packed = [r for row in rows for r in row]
    assert sorted(packed) == [r for r in range(len(lengths)) if lengths[r] > 0]
    assert all(sum(lengths[r] for r in row) <= 3072 for row in rows)
    fill = sum(lengths) / (len(rows) * 3072)
    assert fill > 0.97, fill  # best-fit over windows of 1024 records
    assert rows == pack_epoch(lengths, seed=1, epoch=0, capacity=3072)  # a pure function
    assert rows != pack_epoch(lengths, seed=1, epoch=1, capacity=3072)  # fresh each epoch


def test_best_fit_places_each_record_in_the_tightest_row() -> None:
    lengths = {0: 60, 1: 50, 2: 45, 3: 40, 4: 10}
    assert best_fit_decreasing([4, 3, 2, 1, 0], lengths, capacity=100) == [[0, 3], [1, 2], [4]]


def test_packed_order_counts_micro_batches_per_epoch() -> None:
    lengths = chat_like_lengths(200)
    order = PackedOrder(lengths, capacity=3072, micro_batch_size=2, seed=0)
    per_epoch = [len(pack_epoch(lengths, 0, e, 3072)) // 2 for e in range(3)]
    assert order.micro_batches(3) == sum(per_epoch)
    epoch, rows = order.records(per_epoch[0])  # the first micro-batch of epoch 1
    assert epoch == 1 and rows == pack_epoch(lengths, 0, 1, 3072)[:2]
    assert order.first_of_epoch(per_epoch[0]) and not order.first_of_epoch(per_epoch[0] + 1)


def _documents(lengths: list[int], seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for i, length in enumerate(lengths):
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[length // 3 :] = 1
        documents.append(
            dict(
                id=100 + i,
                ids=torch.randint(0, VOCAB - 2, (length,), generator=generator),
                loss_mask=loss_mask,
                hidden=torch.randn(length, 2 * HIDDEN, generator=generator),
            )
        )
    return documents


def _packed(rows: list[list[dict]], width: int) -> SimpleNamespace:
    """Rows of whole documents back to back, right-padded to `width`."""
    batch = len(rows)
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    loss_mask = torch.zeros(batch, width, dtype=torch.long)
    document_ids = torch.full((batch, width), -1)
    hidden = torch.zeros(batch, width, 2 * HIDDEN)
    lengths = []
    for r, row in enumerate(rows):
        at = 0
        for doc in row:
            span = slice(at, at + len(doc["ids"]))
            input_ids[r, span], loss_mask[r, span] = doc["ids"], doc["loss_mask"]
            document_ids[r, span], hidden[r, span] = doc["id"], doc["hidden"]
            at += len(doc["ids"])
        lengths.append(at)
    return SimpleNamespace(
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=torch.tensor(lengths),
        sample_ids=document_ids[:, 0].clone(),
        document_ids=document_ids,
        epoch=1,
        hidden_states=hidden,
    )


def test_document_positions_restart_at_every_document() -> None:
    ids = torch.tensor([[5, 5, 5, 9, 9, -1, -1], [4, 4, 4, 4, 4, 4, 4]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert start_of_document(ids).tolist() == [[0, 0, 0, 3, 3, 5, 5], [0] * 7]
    unpacked = single_document_ids(torch.tensor([7, 8]), torch.tensor([3, 5]), 5)
    assert unpacked.tolist() == [[7, 7, 7, -1, -1], [8, 8, 8, 8, 8]]


def test_a_document_draws_the_same_anchors_whatever_it_is_packed_with() -> None:
    a, b, c = _documents([40, 60, 25])
    together = _packed([[a, b, c]], width=ROW)
    shuffled = _packed([[c, a], [b]], width=ROW)
    args = (ARGS["seed"] + 0, ARGS["num_anchors"], ROW)
    drawn = {}
    for batch in (together, shuffled):
        anchors, valid = sample_document_anchors(batch.loss_mask, batch.lengths, batch.document_ids, 1, *args)
        ids = batch.document_ids.gather(1, anchors)
        positions = document_positions(batch.document_ids).gather(1, anchors)
        for row in range(anchors.shape[0]):
            for n in range(anchors.shape[1]):
                if valid[row, n]:
                    drawn.setdefault(id(batch), set()).add((int(ids[row, n]), int(positions[row, n])))
    sets = list(drawn.values())
    assert sets[0] == sets[1]
    per_document = {doc: sum(1 for d, _ in sets[0] if d == doc) for doc in (100, 101, 102)}
    # floor(24 * length / 128): the recipe's density per document
    assert per_document == {100: 24 * 40 // ROW, 101: 24 * 60 // ROW, 102: 24 * 25 // ROW}
    assert all(position >= 1 for _, position in sets[0])  # some context of its own before it


def test_one_document_per_row_keeps_the_unpacked_keys() -> None:
    """An unpacked row's keys are a packed row's with one document (the same hash of record and
    position), so the packed rule differs only in its budget."""
    (a,) = _documents([90])
    batch = _packed([[a]], width=96)
    plain, plain_valid = sample_anchors(batch.loss_mask, batch.lengths, batch.sample_ids, 1, 3, 90)
    packed, packed_valid = sample_document_anchors(
        batch.loss_mask, batch.lengths, batch.document_ids, 1, 3, 90, 90
    )
    assert torch.equal(plain[plain_valid], packed[packed_valid])


@pytest.mark.parametrize("window", [None, 20])
def test_packed_mask_sees_only_the_anchor_document(window: int | None) -> None:
    anchors = torch.tensor([[5, 30, 44, 90], [3, 60, 61, 100]])
    starts = torch.tensor([[0, 20, 40, 80], [0, 50, 50, 99]])
    dense = dense_block_mask(anchors, 128, 4, window, starts=starts)
    context = dense[:, 0, :, :128]
    for b in range(2):
        for q in range(16):
            n = q // 4
            seen = context[b, q].nonzero().flatten().tolist()
            expected = [
                j
                for j in range(starts[b, n], anchors[b, n])
                if window is None or anchors[b, n] + q % 4 - j < window
            ]
            assert seen == expected
    # The tile form agrees with the element rule everywhere.
    flex = flex_block_mask(anchors, 128, 4, window, starts=starts)
    rule = block_mask_mod(anchors, 128, 4, window, starts)
    dense_from_tiles = flex.to_dense().bool().repeat_interleave(128, 2).repeat_interleave(128, 3)
    dense_from_tiles = dense_from_tiles[:, :, :16, : 128 + 16]
    allowed = rule(
        torch.arange(2)[:, None, None, None], None, torch.arange(16)[None, None, :, None], torch.arange(144)
    )
    assert not (allowed & ~dense_from_tiles).any()  # no allowed pair sits in a skipped tile


@pytest.mark.parametrize("dpace_alpha", [None, 0.5])  # train.position_weights=decay, dpace
@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_packed_loss_equals_the_documents_trained_alone(attention: str, dpace_alpha, request) -> None:
    """A packed micro-batch's weighted loss sum and gradients equal the sum over its documents
    each alone in a row (same anchors by construction: they depend on the record only). With
    D-PACE the weights come from each block's own CE and the denominator is the scored count,
    still the sum over the documents: the loss is normalised over the whole micro-batch."""
    if attention == "flash":
        request.getfixturevalue("dense_kernels")
    drafter, embed, head, _ = tiny_problem(2)
    documents = _documents([40, 70, 25, 11])
    packed = _packed([[documents[0], documents[1]], [documents[2], documents[3]]], width=ROW)

    def weighted_loss(batch):
        drafter.zero_grad()
        options = dict(attention=attention, row_tokens=ROW, dpace_alpha=dpace_alpha)
        loss, stats = drafter_loss(drafter, embed, head, batch, **options, **ARGS)
        (loss * stats["weight_sum"]).backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        return loss.detach() * stats["weight_sum"], stats["weight_sum"], grads

    total, weight, grads = weighted_loss(packed)
    alone = [weighted_loss(_packed([[doc]], width=ROW)) for doc in documents]
    torch.testing.assert_close(weight, sum(w for _, w, _ in alone))
    assert weight > 0
    torch.testing.assert_close(total, sum(t for t, _, _ in alone), rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, sum(g[name] for _, _, g in alone), rtol=1e-4, atol=5e-4, msg=name
        )  # sums of ~100s in fp32


@pytest.mark.parametrize(
    "arch, fields",
    [
        # DSpark: slot k predicts p+k+1 (sample_from_anchor), the Markov head reads the token before;
        # CE on the data token only, so no teacher layer is needed in the features.
        ("dspark", {"dspark": {"markov_rank": 8, "markov_head_type": "gated", "enable_confidence_head": False,
                               "confidence_head_with_markov": False, "sample_from_anchor": True}}),
        # XPress: its refiner reads the token before each block and mixes causally within the block.
        ("xpress", {"xpress": {"xpress_rank": 8, "xpress_mlp_ratio": 2, "num_jacobi_passes": 2}}),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dpace_alpha", [None, 0.5])
def test_the_heads_after_dflash2_keep_packed_documents_apart(arch: str, fields: dict, dpace_alpha) -> None:
    """As test_packed_loss_equals_the_documents_trained_alone, for DSpark's and XPress's own
    labels, heads and terms: a packed micro-batch's weighted loss and gradients are the sum over
    its documents each alone in a row."""
    from dflash_mp.objective.dspark_loss import DSparkLossWeights

    drafter, embed, head, _ = tiny_problem(2, arch=arch, **fields)
    documents = _documents([40, 70, 25, 11], seed=4)
    packed = _packed([[documents[0], documents[1]], [documents[2], documents[3]]], width=ROW)
    ce_only = DSparkLossWeights(ce=1.0, kl=0.0, tv=0.0, confidence=0.0)

    def weighted_loss(batch):
        drafter.zero_grad()
        loss, stats = drafter_loss(
            drafter,
            embed,
            head,
            batch,
            attention="sdpa",
            row_tokens=ROW,
            dspark=ce_only,
            dpace_alpha=dpace_alpha,
            **ARGS,
        )
        (loss * stats["weight_sum"]).backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        return loss.detach() * stats["weight_sum"], stats["weight_sum"], grads

    total, weight, grads = weighted_loss(packed)
    alone = [weighted_loss(_packed([[doc]], width=ROW)) for doc in documents]
    assert weight > 0
    torch.testing.assert_close(weight, sum(w for _, w, _ in alone))
    torch.testing.assert_close(total, sum(t for t, _, _ in alone), rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, sum(g[name] for _, _, g in alone), rtol=1e-4, atol=5e-4, msg=name)


def test_packed_blocks_use_positions_within_the_document() -> None:
    a, b = _documents([40, 50])
    batch = _packed([[a, b]], width=ROW)
    blocks = draft_blocks(
        batch, num_anchors=24, seed=3, block_size=16, mask_token_id=VOCAB - 1, gamma=7.0,
        attention="sdpa", row_tokens=ROW,
    )  # fmt: skip
    assert torch.equal(blocks.context_positions, document_positions(batch.document_ids))
    first = blocks.positions.view(1, 24, 16)[:, :, 0]
    anchors = blocks.ids.view(1, 24, 16)[:, :, 0]
    assert (first < 50).all() and anchors.numel() == 24
    # No label crosses into the next document: weights vanish past the anchor's document end.
    label_documents = blocks.weights > 0
    assert label_documents.any()


def test_the_length_index_is_built_once_and_waiters_keep_beating(tmp_path) -> None:
    """The first process builds the cached index under a lock; another waits for it (calling its
    heartbeat while it waits, so a long build does not read as a hang) and reads the same values."""
    import threading

    from dflash_mp.data.packing import TOO_LONG, USABLE, RecordLengths, cached_lengths

    built, beats = [], []
    release = threading.Event()

    def build():
        built.append(1)
        release.wait(5)
        return RecordLengths(array("i", [5, 0, 7]), array("b", [USABLE, TOO_LONG, USABLE]))

    first = threading.Thread(target=cached_lengths, args=(tmp_path, "k", build))
    first.start()
    while not built:
        pass
    threading.Timer(1.5, release.set).start()
    waited = cached_lengths(tmp_path, "k", build, progress=lambda: beats.append(1))
    first.join()
    assert built == [1] and beats  # built once; the waiter beat while it waited
    assert list(waited.lengths) == [5, 0, 7] and waited.count(TOO_LONG) == 1 and waited.usable == 2
