"""The frozen target: features equal HF hidden_states, padding-safe, and selective weight reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_mp.models.target import TargetFeatureExtractor, load_embedding_and_head, load_target_config
from dflash_mp.models.target_structure import TargetStructureError

NUM_LAYERS = 6


def _save_target(path: Path, tied: bool, max_shard_size: str | None = None) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=128,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3ForCausalLM]:
    path = tmp_path_factory.mktemp("untied")
    return path, _save_target(path, tied=False)


def _input_ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("layer_ids", [[1, 3], [2, NUM_LAYERS - 1]])
def test_features_equal_hf_hidden_states(untied: tuple[Path, Qwen3ForCausalLM], layer_ids: list[int]) -> None:
    path, model = untied
    extractor = TargetFeatureExtractor(path, layer_ids, dtype=torch.float32, device="cpu")
    # Layers after the last one we read are never built.
    assert len(extractor.decoder.layers) == max(layer_ids) + 1
    assert not any(p.requires_grad for p in extractor.parameters())
    input_ids = _input_ids(2, 9)
    with torch.no_grad():
        hidden_states = model(input_ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)  # the reference's indexing
    torch.testing.assert_close(extractor(input_ids), expected, atol=1e-5, rtol=1e-5)


def test_right_padding_keeps_valid_positions(untied: tuple[Path, Qwen3ForCausalLM]) -> None:
    path, _ = untied
    extractor = TargetFeatureExtractor(path, [0, 2], dtype=torch.float32, device="cpu")
    lengths = [10, 6]
    padded = _input_ids(2, 10)
    padded[1, lengths[1] :] = 0
    features = extractor(padded)
    assert features.shape == (2, 10, 2 * 32)
    for row, length in enumerate(lengths):
        alone = extractor(padded[row : row + 1, :length])
        torch.testing.assert_close(features[row : row + 1, :length], alone, atol=1e-5, rtol=1e-5)


def test_invalid_layer_ids_name_the_setting(untied: tuple[Path, Qwen3ForCausalLM]) -> None:
    path, _ = untied
    with pytest.raises(ValueError, match=r"model\.target_layer_ids.*\[0, 5\]"):
        TargetFeatureExtractor(path, [1, NUM_LAYERS], dtype=torch.float32, device="cpu")


def test_load_target_config(untied: tuple[Path, Qwen3ForCausalLM]) -> None:
    path, _ = untied
    assert load_target_config(path).num_hidden_layers == NUM_LAYERS


@pytest.mark.parametrize(("tied", "max_shard_size"), [(False, None), (True, None), (False, "20KB")])
def test_embedding_and_head_read_from_checkpoint(
    tmp_path: Path, tied: bool, max_shard_size: str | None
) -> None:
    model = _save_target(tmp_path, tied=tied, max_shard_size=max_shard_size)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(max_shard_size)
    embedding, head = load_embedding_and_head(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert embedding.dtype == head.dtype == torch.bfloat16
    assert torch.equal(embedding, model.get_input_embeddings().weight.detach().bfloat16())
    assert torch.equal(head, model.lm_head.weight.detach().bfloat16())
    assert (head is embedding) == tied


def test_missing_tensors_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_embedding_and_head(tmp_path, dtype=torch.float32, device="cpu")
    (tmp_path / "config.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(128, 32)}, tmp_path / "model.safetensors")
    with pytest.raises(TargetStructureError, match="transformers cannot build its model"):
        load_embedding_and_head(tmp_path, dtype=torch.float32, device="cpu")
    Qwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=128).save_pretrained(
        tmp_path
    )
    # lm_head.weight is the head's: no tensor is left for the embedding, even by its shape.
    with pytest.raises(TargetStructureError, match=r"no input embedding \(the model's model.embed_tokens"):
        load_embedding_and_head(tmp_path, dtype=torch.float32, device="cpu")


def test_compiled_layers_capture_the_same_features(untied: tuple[Path, Qwen3ForCausalLM]) -> None:
    # The "eager" backend runs dynamo's tracing (the capture hooks included) without codegen, so
    # this checks on CPU what the GPU's inductor build relies on: same features, one shared graph.
    path, _ = untied
    layer_ids = [1, 3, NUM_LAYERS - 1]
    extractor = TargetFeatureExtractor(path, layer_ids, dtype=torch.float32, device="cpu")
    input_ids = _input_ids(2, 9)
    expected = extractor(input_ids)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    extractor.compile_layers(backend="eager", fullgraph=True)
    torch.testing.assert_close(extractor(input_ids), expected, atol=1e-6, rtol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compiled_target_matches_eager_in_bf16_on_cuda() -> None:
    config = Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
    )
    extractor = TargetFeatureExtractor.build_random(config, [1, 3], torch.bfloat16, "cuda", seed=0)
    input_ids = torch.randint(0, 1000, (2, 192), generator=torch.Generator().manual_seed(0)).cuda()
    expected = extractor(input_ids)
    extractor.compile_layers()
    for _ in range(2):  # the second call runs the cached graph
        torch.testing.assert_close(extractor(input_ids), expected, atol=5e-2, rtol=5e-2)


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operators that copy a tensor's value to the host (a sync on a GPU)."""

    READS = (
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.item.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.nonzero.default,
    )

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_target_forward_reads_no_device_value(untied: tuple[Path, Qwen3ForCausalLM]) -> None:
    """The host can run ahead of the GPU (and the forward can be captured in a CUDA graph) only if
    the forward never copies a value back; transformers' packed-sequence check did, every forward."""
    path, model = untied
    extractor = TargetFeatureExtractor(path, [1, 3], dtype=torch.float32, device="cpu")
    input_ids = _input_ids(2, 9)
    extractor(input_ids)
    with _DeviceReads() as spy:
        features = extractor(input_ids)
    assert spy.reads == []
    with torch.no_grad():
        hidden_states = model(input_ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden_states[2], hidden_states[4]], dim=-1))

