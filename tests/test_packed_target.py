"""Packed rows through the frozen target (models/packed_target.py): every document's features equal
those of the document run alone, for every family of tests/target_families.py, on the path each
decoder's structure picks; the general one-row-per-document path is exact and takes any decoder
with a position-mixing module of unknown document handling; unpacked rows keep their numbers.

"Equal" is fp32 to within 2e-6 of the features' largest magnitude: not bit for bit, because a
packed row runs other kernels than a document alone (SDPA with a materialised mask rather than
its causal path, matmuls blocked over another length, the recurrence's 64-token chunks cut
elsewhere); the worst seen was 6e-7. A document that sees its neighbour (a mask, a convolution
tap or a recurrent state crossing the boundary) is off by 7e-3 to 0.5 here.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import DeepseekV3Config, Lfm2Config, LlamaConfig

from dflash_mp.models import linear_attention, packed_check, packed_target, target_graphs, target_kernels
from dflash_mp.models.packed_rows import document_index, document_positions, single_document_ids
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.runtime.target_parallel import replica_mesh
from tests import spawn_pool
from tests.target_families import FAMILIES, LAYER_KINDS, ensure_family_target

LAYER_IDS = [0, 1, 3]  # a linear-attention or sliding layer, another, and the last
# Row 0: three documents, one of a single token, the last starting at 51 and crossing the
# recurrence's first 64-token chunk; row 1: two documents, then right padding. 29, 50 and 70
# tokens cross the sliding windows (8) of gpt-oss and Gemma 3.
LENGTHS = [[50, 1, 29], [70, 3]]
SEQ = 80
TOLERANCE = 2e-6


def _packed_batch(
    seed: int = 0, lengths: list[list[int]] = LENGTHS, seq: int = SEQ, vocab: int = 151_000
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (len(lengths), seq), generator=torch.Generator().manual_seed(seed))
    document_ids = torch.full((len(lengths), seq), -1)
    record = 100
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            document_ids[row, start : start + length] = record
            record, start = record + 7, start + length
    return ids, document_ids


def _documents(lengths: list[list[int]] = LENGTHS) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document."""
    out = []
    for row, row_lengths in enumerate(lengths):
        starts = [sum(row_lengths[:i]) for i in range(len(row_lengths))]
        out += [(row, start, length) for start, length in zip(starts, row_lengths, strict=True)]
    return out


def _worst_document_error(extractor, ids, packed, lengths=LENGTHS) -> float:
    """The largest |packed - alone| of any document, over the largest |alone| of that document."""
    worst = 0.0
    for row, start, length in _documents(lengths):
        alone = extractor(ids[row : row + 1, start : start + length])[0]
        error = (packed[row, start : start + length] - alone).abs().max() / alone.abs().max()
        worst = max(worst, float(error))
    return worst


@pytest.fixture(scope="module")
def family_targets():
    """One fp32 CPU target per family, loaded on first use and shared by this file's tests."""
    loaded: dict[str, TargetFeatureExtractor] = {}

    def get(name: str) -> TargetFeatureExtractor:
        if name not in loaded:
            loaded[name] = TargetFeatureExtractor(ensure_family_target(name), LAYER_IDS, torch.float32, "cpu")
        return loaded[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_every_document_equals_it_alone(name: str, family_targets) -> None:
    assert set(LAYER_KINDS[name]) <= {LAYER_KINDS[name][i] for i in LAYER_IDS}  # every kind is read
    extractor = family_targets(name)
    ids, document_ids = _packed_batch()
    packed = extractor(ids, document_ids)
    assert packed.shape == (2, SEQ, 3 * extractor.hidden_size)
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE
    # The tiny DeepSeek-V3 has 2 KV heads beside 4 query heads, which transformers' MLA attention
    # repeats 2x under any materialised mask (a crash of its own forward): the in-rows forward
    # fails once and the target goes on one row per document. Published MLA configs have as many
    # KV heads as heads (test_mla_keeps_documents_in_rows). NemotronH's Mamba-2 mixers carry a
    # state across positions that nothing resets at a document: one row per document.
    assert extractor.packing.in_rows or name in ("deepseek_v3", "nemotron_h"), extractor.packing.describe()
    if "linear_attention" in LAYER_KINDS[name]:
        assert "3 gated-deltanet layers" in extractor.packing.reason


@pytest.mark.parametrize("name", FAMILIES)
def test_unpacked_rows_keep_their_numbers(name: str, family_targets) -> None:
    """document_ids=None runs as before; one document per row from 0 gives the same features, bit
    for bit where the row's kernels are the same (attention), to fp32 rounding where the packed
    path runs its own (the per-document convolution of transformers' gated deltanet)."""
    extractor = family_targets(name)
    ids, _ = _packed_batch(seed=1)
    lengths = torch.tensor([SEQ, SEQ - 9])
    unpacked = extractor(ids)
    one_each = extractor(ids, single_document_ids(torch.tensor([3, 4]), lengths, SEQ))
    real = torch.arange(SEQ)[None, :] < lengths[:, None]
    if extractor.packing.in_rows and "linear_attention" not in LAYER_KINDS[name]:
        assert torch.equal(one_each[real], unpacked[real])
    else:
        torch.testing.assert_close(
            one_each[real], unpacked[real], rtol=0, atol=TOLERANCE * unpacked.abs().max()
        )


def test_the_general_path_is_exact_and_zero_on_padding() -> None:
    """Forced on a hybrid (linear attention, MoE) target: each document in a row of its own."""
    extractor = TargetFeatureExtractor(ensure_family_target("qwen3_5_moe"), LAYER_IDS, torch.float32, "cpu")
    ids, document_ids = _packed_batch(seed=2)
    in_rows = extractor(ids, document_ids)
    extractor._packing = packed_target.PackingPlan(False, "forced by the test")
    general = extractor(ids, document_ids)
    assert _worst_document_error(extractor, ids, general) < TOLERANCE
    assert torch.equal(general[document_ids < 0], torch.zeros_like(general[document_ids < 0]))
    real = document_ids >= 0
    torch.testing.assert_close(general[real], in_rows[real], rtol=0, atol=TOLERANCE * in_rows.abs().max())


def _lfm2() -> Lfm2Config:
    return Lfm2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
    )  # fmt: skip


def test_an_unknown_position_mixer_runs_one_row_per_document() -> None:
    """LFM2's short convolutions are no module this project resets per document: its config's
    layer types and the Conv1d inside send it down the general path, which keeps it exact."""
    extractor = TargetFeatureExtractor.build_random(_lfm2(), [0, 3], torch.float32, "cpu", seed=1)
    ids, document_ids = _packed_batch(seed=3)
    ids = ids % 128
    packed = extractor(ids, document_ids)
    plan = extractor.packing
    assert not plan.in_rows and "['conv']" in plan.reason and "Conv1d" in plan.reason
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_failed_packed_forward_on_the_document_kernel_goes_one_row_per_document_on_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the in-rows forward fails (a decoder or kernel the structural checks did not foresee),
    the target goes one row per document, and leaves the document flex kernel for SDPA's causal path."""
    extractor = TargetFeatureExtractor(ensure_family_target("llama3"), LAYER_IDS, torch.float32, "cpu")
    assert extractor.use_fast_kernels(packed_rows=True)["attention"] == target_kernels.DOCUMENT_FLEX

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(extractor, "_forward_in_rows", fails)
    ids, document_ids = _packed_batch(seed=10)
    packed = extractor(ids, document_ids)
    assert not extractor.packing.in_rows and "no kernel for this shape" in extractor.packing.reason
    assert extractor.kernels["attention"] == extractor.decoder.config._attn_implementation == "sdpa"
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


def test_a_convolution_in_an_attention_decoder_is_found_by_structure() -> None:
    """Not the family: a Conv1d injected into a Llama layer, or a class named like a recurrence."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    extractor = TargetFeatureExtractor.build_random(config, [1], torch.float32, "cpu")
    assert packed_target.plan(extractor.decoder).in_rows
    decoder = copy.deepcopy(extractor.decoder)
    decoder.layers[0].mixer = torch.nn.Conv1d(32, 32, 4, groups=32, padding=3)
    assert "layers.0.mixer (Conv1d)" in packed_target.plan(decoder).reason

    class TinyMambaBlock(torch.nn.Module):
        pass

    decoder = copy.deepcopy(extractor.decoder)
    decoder.layers[1].ssm = TinyMambaBlock()
    assert not packed_target.plan(decoder).in_rows
    decoder.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packed_target.plan(decoder).reason


def test_mla_keeps_documents_in_rows() -> None:
    """DeepSeek-V3's attention as published (as many KV heads as heads), one dense layer then MoE."""
    config = DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        n_group=1, topk_group=1, first_k_dense_replace=1,
    )  # fmt: skip
    ids, document_ids = _packed_batch(seed=4, vocab=128)
    extractor = TargetFeatureExtractor.build_random(config, [0, 2], torch.float32, "cpu", seed=2)
    # MLA keeps SDPA's masks with packed rows (queries wider than values: target_kernels.takes_document_flex).
    assert extractor.use_fast_kernels(packed_rows=True)["attention"] == "sdpa"
    packed = extractor(ids, document_ids)
    assert extractor.packing.in_rows, extractor.packing.describe()
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_sink_attention_kernel_keeps_documents_apart() -> None:
    """gpt-oss on the fast kernels (flex attention with sinks, run as is on CPU): transformers'
    masks stay plain for it and its block mask adds the documents; its forward passes no
    position_ids to the masks, which the eager path gets from us."""
    extractor = TargetFeatureExtractor(ensure_family_target("gpt_oss"), LAYER_IDS, torch.float32, "cpu")
    assert extractor.use_fast_kernels()["attention"].startswith("flex_attention with sinks")
    ids, document_ids = _packed_batch(seed=5)
    packed = extractor(ids, document_ids)
    assert extractor.packing.in_rows
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["llama3", "qwen3_5", "llama4"])
def test_packed_rows_of_sdpa_targets_take_flex_with_a_block_mask_per_document(name: str) -> None:
    """use_fast_kernels(packed_rows=True) (data.packing on GPU, here run as is on CPU): a target on
    SDPA with causal or windowed masks (plain, hybrid with gated deltanets) takes flex_attention
    with the documents in its block mask, and every document still equals it alone; chunked
    attention (Llama 4) and softcapped scores keep SDPA's masks."""
    extractor = TargetFeatureExtractor(ensure_family_target(name), LAYER_IDS, torch.float32, "cpu")
    kernels = extractor.use_fast_kernels(packed_rows=True)
    assert (kernels["attention"] == target_kernels.DOCUMENT_FLEX) == (name != "llama4"), kernels
    assert not target_kernels.takes_document_flex(LlamaConfig(attn_logit_softcapping=30.0))
    assert not target_kernels.takes_document_flex(LlamaConfig(hidden_size=3072, num_attention_heads=32))  # 96
    vocab = extractor.decoder.config.vocab_size
    ids, document_ids = _packed_batch(seed=8, vocab=vocab)
    packed = extractor(ids, document_ids)
    assert extractor.packing.in_rows, extractor.packing.describe()
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


def test_the_qwen3_5_fast_forward_resets_at_every_document() -> None:
    """linear_attention.py's forward (on GPU with fla's kernels), here with the torch reference core."""
    extractor = TargetFeatureExtractor(ensure_family_target("qwen3_5"), LAYER_IDS, torch.float32, "cpu")
    layers = [layer.linear_attn for layer in extractor.decoder.layers if hasattr(layer, "linear_attn")]
    assert all(linear_attention.use_fast_forward(m, core=linear_attention.torch_core) for m in layers)
    ids, document_ids = _packed_batch(seed=6)
    packed = extractor(ids, document_ids)
    assert extractor.packing.in_rows and extractor.packing.deltanet_modules
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE


def test_masks_take_the_known_documents_without_reading_them() -> None:
    from transformers import masking_utils

    document_ids = torch.tensor([[4, 4, 9, 9, 9, -1]])
    rows = target_graphs.PackedRows.of(document_ids)
    assert rows.positions.tolist() == document_positions(document_ids).tolist() == [[0, 1, 0, 1, 2, 0]]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5]])  # what transformers would read: one sequence
    with target_graphs.packed_sequence_rows(rows):
        assert target_graphs.packed_rows() is rows
        assert masking_utils.find_packed_sequence_indices(positions) is rows.index
    with target_graphs.packed_sequence_rows(rows, hf_masks=False):
        assert masking_utils.find_packed_sequence_indices(positions) is None
    assert target_graphs.packed_rows() is None
    assert rows.index.tolist() == document_index(document_ids).tolist() == [[0, 0, 1, 1, 1, 2]]


def test_document_ids_must_match_the_ids(family_targets) -> None:
    extractor = family_targets("llama3")
    ids, document_ids = _packed_batch()
    with pytest.raises(ValueError, match="document_ids"):
        extractor(ids, document_ids[:, :-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_worker(rank: int, port: int, out: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = replica_mesh(dist.new_group(ranks=[0, 1]), torch.device("cpu"))
        extractor = TargetFeatureExtractor(
            ensure_family_target("qwen3_5"), LAYER_IDS, torch.float32, "cpu", mesh=mesh
        )
        ids, document_ids = _packed_batch(seed=7)
        torch.save(
            {"packed": extractor(ids, document_ids), "in_rows": extractor.packing.in_rows},
            Path(out) / f"{rank}.pt",
        )
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        raise


def test_a_tensor_parallel_replica_takes_packed_rows(tmp_path) -> None:
    """Two gloo ranks of the hybrid target, the same packed rows on each: one rank's features."""
    try:
        spawn_pool.start_processes(_replica_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    except Exception as e:
        raise AssertionError("\n".join(p.read_text() for p in sorted(tmp_path.glob("*.err")))) from e
    results = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in range(2)]
    single = TargetFeatureExtractor(ensure_family_target("qwen3_5"), LAYER_IDS, torch.float32, "cpu")
    ids, document_ids = _packed_batch(seed=7)
    expected = single(ids, document_ids)
    real = document_ids >= 0
    for result in results:
        assert result["in_rows"]
        torch.testing.assert_close(result["packed"][real], expected[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0]["packed"], results[1]["packed"])


# ---------------------------------------------------------------- CUDA (run on a GPU machine)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _alone_in_rows(document: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `shape` holding only `document` [L] at their start, padding after it."""
    ids = document.new_zeros(shape)
    ids[:, : document.numel()] = document
    document_ids = torch.full(shape, -1, device=document.device)
    document_ids[:, : document.numel()] = 0
    return ids, document_ids


def test_a_document_alone_in_a_padded_row_gives_what_it_gives_unpacked(family_targets) -> None:
    """The GPU test's reference (a document alone at a row's start, the rest padding) is the
    document's own forward (here on CPU, fp32)."""
    extractor = family_targets("llama3")
    ids, _ = _packed_batch(seed=9)
    document = ids[0, 10:47]
    alone_ids, alone_documents = _alone_in_rows(document, ids.shape)
    padded = extractor(alone_ids, alone_documents)
    torch.testing.assert_close(padded[:, :37], extractor(document[None]).expand(2, -1, -1), rtol=0, atol=1e-5)


def _sharpen_routers(extractor, factor: float = 50.0) -> None:
    """Scale every MoE router's logits so bf16 rounding cannot flip a token's experts: random
    routers score experts nearly alike, and one flipped choice moves a token's features by far
    more than rounding does. The test is about documents staying apart, not routing under noise."""
    with torch.no_grad():
        for name, parameter in extractor.named_parameters():
            if ".router." in name or name.endswith("mlp.gate.weight"):
                parameter.mul_(factor)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss"])
def test_compiled_graphed_packed_forward_equals_each_document_alone(family: str) -> None:
    """bf16, the fast kernels (fla's for Qwen3.5 where installed, flex with sinks for gpt-oss),
    compiled layers, CUDA graphs: two layouts of one shape replay one graph, each giving what the
    eager packed forward gave for it, and each document what it gives alone, both within bf16."""
    from tests.test_target_graphs import _qwen3
    from tests.test_target_kernels import FAMILIES as KERNEL_FAMILIES

    config = _qwen3() if family == "qwen3" else KERNEL_FAMILIES[family]()
    layer_ids = [0, config.num_hidden_layers - 1]
    extractor = TargetFeatureExtractor.build_random(config, layer_ids, torch.bfloat16, "cuda", seed=0)
    _sharpen_routers(extractor)
    extractor.use_fast_kernels(packed_rows=True)  # Qwen3: flex with a block mask per document
    extractor.compile_layers()
    layouts = [[[150, 1, 105], [200, 30]], [[64, 64, 128], [7, 120, 60]]]  # 256 wide, 4 chunks of 64
    batches = [
        tuple(t.cuda() for t in _packed_batch(seed, lengths, 256, 128))
        for seed, lengths in enumerate(layouts)
    ]
    eager = [extractor(ids, document_ids) for ids, document_ids in batches]
    for (ids, _), lengths, packed in zip(batches, layouts, eager, strict=True):
        for row, start, length in _documents(lengths):
            # The document alone at the start of a row of the same shape (no new compile): the
            # same kernels at other offsets, so only bf16's rounding differs.
            alone_ids, alone_documents = _alone_in_rows(ids[row, start : start + length], ids.shape)
            alone = extractor(alone_ids, alone_documents)[0, :length]
            error = _relative_error(packed[row, start : start + length], alone)
            assert error < 1e-2, (family, row, start, error)
    extractor.use_cuda_graphs(max_tokens=2 * 256)
    for _ in range(2):  # the first pass captures, the second replays
        for (ids, document_ids), expected in zip(batches, eager, strict=True):
            # Within bf16: a captured matmul may take another cuBLAS algorithm than the eager one.
            assert _relative_error(extractor(ids, document_ids), expected) < 1e-2, family
    assert extractor.cuda_graphs_off_because is None
    if extractor.packing.in_rows:
        assert list(extractor._graphed.graphs) == [("packed", 2, 256)]
    else:  # a transformers whose deltanet reaches its kernels through attributes (5.17): one row per document
        assert family == "qwen3_5" and "gated deltanets" in extractor.packing.reason, extractor.packing.reason
    torch._dynamo.reset()


def test_documents_that_cross_in_the_rows_are_caught_on_the_first_call(monkeypatch) -> None:
    """A decoder whose masks let a document see the one before it passes every structural check;
    the first packed call with two documents in a row finds it and goes one row per document."""
    extractor = TargetFeatureExtractor(ensure_family_target("llama3"), LAYER_IDS, torch.float32, "cpu")
    ids, document_ids = _packed_batch()
    single = torch.where(document_ids >= 0, 0, -1)[:, :20]  # one document per row: nothing to check
    for _ in range(packed_check.CALLS_TO_WAIT - 1):
        extractor(ids[:, :20], single)
    assert extractor.packing.in_rows and not extractor._packed_forward_ran

    @contextlib.contextmanager
    def no_masks(decoder, rows, packing):
        yield

    # Remote code that takes position_ids and ignores them, building one causal mask per row.
    forward = extractor.decoder.forward
    monkeypatch.setattr(packed_target, "documents_in_rows", no_masks)
    monkeypatch.setattr(extractor.decoder, "forward", lambda position_ids=None, **kwargs: forward(**kwargs))
    packed = extractor(ids, document_ids)
    assert (
        not extractor.packing.in_rows and "when only the first document changed" in extractor.packing.reason
    )
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE  # the fallback is exact


def test_llama4_rows_wider_than_its_temperature_floor_go_one_row_per_document() -> None:
    """Llama 4's layers without RoPE scale their queries by the position in the row (not in the
    document) once it reaches floor_scale: wider rows run one row per document, narrower stay."""
    extractor = TargetFeatureExtractor(ensure_family_target("llama4"), LAYER_IDS, torch.float32, "cpu")
    extractor.decoder.config.floor_scale = 8
    for module in extractor.decoder.modules():
        if hasattr(module, "floor_scale"):
            module.floor_scale = 8
    assert extractor.packing.widest_row == 7 and "rows over 7 tokens" in extractor.packing.describe()
    ids, document_ids = _packed_batch()
    assert not extractor.packing.in_rows_of(ids.shape[1]) and extractor.packing.in_rows_of(7)
    packed = extractor(ids, document_ids)
    assert _worst_document_error(extractor, ids, packed) < TOLERANCE
    narrow = [[3, 4], [7]]
    ids, document_ids = _packed_batch(lengths=narrow, seq=7)
    assert _worst_document_error(extractor, ids, extractor(ids, document_ids), narrow) < TOLERANCE
    assert extractor._packed_forward_ran  # the narrow rows ran in the rows, checked


def test_the_first_call_check_stops_looking_when_no_row_holds_two_documents() -> None:
    extractor = TargetFeatureExtractor(ensure_family_target("llama3"), LAYER_IDS, torch.float32, "cpu")
    ids, document_ids = _packed_batch()
    single = torch.where(document_ids >= 0, 0, -1)[:, :20]
    for _ in range(packed_check.CALLS_TO_WAIT):
        extractor(ids[:, :20], single)
    assert extractor._packed_forward_ran and extractor.packing.in_rows  # each look read the device
