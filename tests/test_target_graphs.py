"""The target forward replayed from CUDA graphs gives the eager forward's features, shape by shape."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from dflash_mp.config.precision import resolve_cuda_graphs
from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.models import target_graphs
from dflash_mp.models.target import TargetFeatureExtractor
from tests.test_target_kernels import FAMILIES

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qwen3() -> Qwen3Config:
    return Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128,
    )  # fmt: skip


def test_graphs_are_on_for_a_gpu_target_unless_sharded_or_turned_off() -> None:
    cfg = to_dataclass(compose_config())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_cuda_graphs(cfg, cuda, tensor_parallel=False)
    assert not resolve_cuda_graphs(cfg, cpu, tensor_parallel=False)
    assert not resolve_cuda_graphs(cfg, cuda, tensor_parallel=True)  # a tensor-parallel replica: eager
    cfg = to_dataclass(compose_config(["train.cuda_graphs=false"]))
    assert not resolve_cuda_graphs(cfg, cuda, tensor_parallel=False)


def test_masks_take_rows_as_single_sequences_only_within_the_context() -> None:
    from transformers import masking_utils

    positions = torch.tensor([[0, 1, 2, 0, 1]])  # two packed sequences
    assert masking_utils.find_packed_sequence_indices(positions) is not None
    with target_graphs.single_sequence_rows():
        assert masking_utils.find_packed_sequence_indices(positions) is None
    assert masking_utils.find_packed_sequence_indices(positions).tolist() == [[0, 0, 0, 1, 1]]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["qwen3", *sorted(FAMILIES)])
def test_replayed_graphs_equal_the_eager_forward_for_every_shape(family: str) -> None:
    config = _qwen3() if family == "qwen3" else FAMILIES[family]()
    layer_ids = [0, config.num_hidden_layers - 1]
    extractor = TargetFeatureExtractor.build_random(config, layer_ids, torch.bfloat16, "cuda", seed=0)
    extractor.use_fast_kernels()
    extractor.compile_layers()
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 128), (2, 192), (1, 128), (2, 256)]
    batches = [torch.randint(0, 128, shape, generator=g).cuda() for shape in shapes]
    eager = [extractor(ids) for ids in batches]
    extractor.use_cuda_graphs(max_tokens=2 * 192)
    for _ in range(2):  # the first pass captures, the second replays (shapes interleaved)
        outputs = [extractor(ids) for ids in batches]  # all kept: each a copy, not the shared storage
        for output, expected in zip(outputs, eager, strict=True):
            torch.testing.assert_close(output, expected, atol=0, rtol=0)
    assert extractor.cuda_graphs_off_because is None
    assert sorted(extractor._graphed.graphs) == [(1, 128), (2, 192)]
    assert extractor._graphed.eager_shapes == {(2, 256)}  # over max_tokens: eager, still right
    torch._dynamo.reset()


@pytest.mark.gpu
@gpu
def test_a_forward_that_cannot_be_captured_runs_eagerly_and_says_why() -> None:
    def reads_the_device(ids: torch.Tensor) -> torch.Tensor:
        return ids * int(ids.max().item())

    graphed = target_graphs.GraphedForward(reads_the_device)
    ids = torch.arange(6, device="cuda").view(2, 3)
    generator = torch.cuda.default_generators[ids.device.index]
    torch.cuda.manual_seed(3)
    torch.randn(4, device="cuda")
    offset = generator.get_offset()
    assert torch.equal(graphed(ids), ids * 5)
    assert graphed.off_because is not None and graphed.graphs == {}
    assert torch.equal(graphed(ids + 1), (ids + 1) * 6)
    # The failed capture leaves the process's random numbers working, where they were.
    assert (generator.initial_seed(), generator.get_offset()) == (3, offset)
    after = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(3)
    torch.randn(4, device="cuda")
    assert torch.equal(torch.randn(4, device="cuda"), after)


def test_a_bad_cuda_graphs_setting_is_refused_naming_the_field() -> None:
    from dflash_mp.config.schema import ConfigError
    from dflash_mp.config.validation import validate

    with pytest.raises(ConfigError, match=r"train.cuda_graphs='sometimes'"):
        validate(to_dataclass(compose_config(["train.cuda_graphs=sometimes"])), world_size=3)
    with pytest.raises(ConfigError, match=r"train.cuda_graphs=true needs a GPU"):
        validate(to_dataclass(compose_config(["train.cuda_graphs=true", "train.device=cpu"])), world_size=3)
