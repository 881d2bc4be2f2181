"""models/linear_attention.py: the Qwen3.5 gated-deltanet forward equals transformers' (fp32 on CPU
with a torch reference core; bf16 on CUDA with fla's kernels, compiled and under CUDA graphs), and
the switch is taken only where it should be."""

from __future__ import annotations

import contextlib
import copy
import importlib

import pytest
import torch

from dflash_mp.models import linear_attention, target_kernels
from dflash_mp.models.target import TargetFeatureExtractor
from tests.test_target_kernels import _qwen3_5

SEQ = 150  # three of the recurrence's 64-token chunks, the last one partial


def _config(moe: bool, value_heads: int):
    """test_target_kernels' tiny Qwen3.5 with two key heads and value heads equal (2) or grouped two
    per key head (4). The key and value head sizes differ, so that a mix-up of the two shows."""
    config = _qwen3_5(moe)
    config.linear_num_value_heads, config.linear_key_head_dim = value_heads, 32
    return config


def _deltanet_class(moe: bool):
    if moe:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

        return Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    return Qwen3_5GatedDeltaNet


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale outputs (HF's init leaves the layer's output tiny, hiding errors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "conv1d.weight":
                value = torch.randn(p.shape, generator=g) * 0.5
            elif name == "A_log":  # decays exp(A) in [1, 16], as HF draws them
                value = torch.empty(p.shape).uniform_(1, 16, generator=g).log()
            elif name == "norm.weight":
                value = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif p.ndim == 2:  # the projections
                value = torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5
            else:  # dt_bias
                value = torch.randn(p.shape, generator=g)
            p.copy_(value)


def _module(moe: bool, value_heads: int, seed: int = 0) -> torch.nn.Module:
    module = _deltanet_class(moe)(_config(moe, value_heads), layer_idx=0).eval()
    _randomize(module, seed)
    return module


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


CASES = [(moe, heads) for moe in (False, True) for heads in (2, 4)]


@pytest.mark.parametrize(("moe", "value_heads"), CASES)
def test_fast_forward_equals_transformers_in_fp32(moe: bool, value_heads: int) -> None:
    module = _module(moe, value_heads)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module(x)  # transformers' forward (its torch path on CPU)
        assert linear_attention.use_fast_forward(module, core=linear_attention.torch_core)
        assert linear_attention.uses_fast_forward(module)
        actual = module(x)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert expected.abs().mean() > 0.1


def test_a_call_with_a_padding_mask_or_a_cache_takes_transformers_forward() -> None:
    """Only the target's own calls (no cache, no mask) take the fast path; any other goes to
    transformers' forward with its arguments as given (the cache is `cache` or `cache_params` by
    transformers' version)."""
    module = _module(moe=False, value_heads=4)
    reference = copy.deepcopy(module)
    calls = []

    def counting_core(*args):
        calls.append(1)
        return linear_attention.torch_core(*args)

    assert linear_attention.use_fast_forward(module, core=counting_core)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :7] = 0  # left padding: transformers zeroes those rows' inputs
    with torch.no_grad():
        masked, expected = module(x, attention_mask=mask), reference(x, attention_mask=mask)
        assert calls == []
        torch.testing.assert_close(masked, expected, atol=0, rtol=0)
        with pytest.raises(Exception):  # noqa: B017 - transformers' own forward reads the object
            module(x, cache_params=object())
        with pytest.raises(Exception):  # noqa: B017
            module(x, cache=object())
        assert calls == []
        module(x)
    assert calls == [1]


@pytest.mark.parametrize("moe", [False, True])
def test_a_target_with_switched_layers_keeps_transformers_features(moe: bool) -> None:
    config = _config(moe, value_heads=4)
    config._experts_implementation = "eager"
    extractor = TargetFeatureExtractor.build_random(config, [0, 2, 3], torch.float32, "cpu", seed=3)
    layers = _linear_layers(extractor)
    for index, linear in enumerate(layers):
        _randomize(linear, seed=index)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = extractor(ids)
    assert len(layers) == 3 and all(
        linear_attention.use_fast_forward(m, linear_attention.torch_core) for m in layers
    )
    actual = extractor(ids)
    # Layer 0's output as tight as one layer's; the fp32 rounding the later layers amplify (to
    # 1e-4 of values up to 5) stays far below what any wrong shift or head mapping gives.
    torch.testing.assert_close(actual[..., :64], expected[..., :64], atol=1e-5, rtol=1e-5)
    assert _relative_error(actual, expected) < 2e-5


def test_prepare_traces_as_one_graph() -> None:
    """No graph break in what torch.compile fuses on GPU; q, k, v come out contiguous."""
    from torch._dynamo.testing import CompileCounter

    module = _module(moe=False, value_heads=4)
    counter = CompileCounter()
    compiled = torch.compile(linear_attention.prepare, backend=counter, fullgraph=True)
    x = torch.randn(1, 70, 64)
    with torch.no_grad():
        args = (
            module.in_proj_qkv(x), module.in_proj_a(x), module.in_proj_b(x), module.conv1d.weight, None,
            module.A_log, module.dt_bias, module.num_k_heads, module.head_k_dim, module.head_v_dim,
        )  # fmt: skip
        outputs, expected = compiled(*args), linear_attention.prepare(*args)
    assert counter.frame_count == 1
    for out, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    q, k, v, g, beta = outputs
    assert q.shape == k.shape == (1, 70, 2, 32) and v.shape == (1, 70, 4, 16) and g.shape == (1, 70, 4)
    assert all(t.is_contiguous() for t in outputs) and g.dtype == torch.float32
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(1, 70, 2))  # L2-normalised per head


def test_the_switch_stays_off_on_cpu_and_for_other_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    extractor = TargetFeatureExtractor.build_random(_config(False, 4), [3], torch.float32, "cpu")
    kernels = target_kernels.use_fast_kernels(extractor.decoder)
    for module in extractor.decoder.modules():
        monkeypatch.setattr(module, "compile", lambda **_: None, raising=False)
    target_kernels.compile_layers(extractor.decoder.layers)
    layers = _linear_layers(extractor)
    assert layers and not any(linear_attention.uses_fast_forward(m) for m in layers)
    assert kernels["linear_attention"] != target_kernels.FAST_LINEAR_ATTENTION
    assert linear_attention.why_not(layers[0]) is None  # the layout fits: CPU (and fla) decide

    # On CUDA (pretended) it depends on fla importing; with fla, on the class and the layout.
    monkeypatch.setattr(linear_attention, "_on_cuda", lambda module: True)
    monkeypatch.setattr(linear_attention, "_fla_chunk", lambda: None)
    assert not linear_attention.fast_path_applies(layers[0])
    monkeypatch.setattr(linear_attention, "_fla_chunk", lambda: object())
    assert linear_attention.fast_path_applies(layers[0])
    next_config = Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        vocab_size=128, intermediate_size=96, num_experts=4, moe_intermediate_size=32,
    )  # fmt: skip
    qwen3_next = Qwen3NextGatedDeltaNet(next_config, layer_idx=0)
    assert "not transformers' Qwen3.5" in linear_attention.why_not(qwen3_next)
    assert not linear_attention.use_fast_forward(qwen3_next)
    # A column shard of a projection (tensor parallelism) keeps transformers' forward.
    sharded = copy.deepcopy(layers[0])
    sharded.in_proj_qkv.weight = torch.nn.Parameter(sharded.in_proj_qkv.weight[:64])
    assert "tensor-parallel" in linear_attention.why_not(sharded)
    # Switched per instance: the module next to a switched one keeps transformers' forward.
    assert linear_attention.use_fast_forward(layers[0]) and not linear_attention.uses_fast_forward(layers[1])


def test_describe_kernels_names_the_fast_forward_for_qwen3_5_on_gpu(monkeypatch) -> None:
    monkeypatch.setattr(target_kernels.importlib.util, "find_spec", lambda name: object())
    on_gpu = target_kernels.describe_kernels(_config(True, 4), on_gpu=True)["linear_attention"]
    assert on_gpu == target_kernels.FAST_LINEAR_ATTENTION
    on_cpu = target_kernels.describe_kernels(_config(True, 4), on_gpu=False)["linear_attention"]
    assert on_cpu.startswith("fla Triton kernels") and on_cpu != on_gpu


# ---------------------------------------------------------------- CUDA with fla (run on a GPU machine)

needs_fla_on_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or linear_attention._fla_chunk() is None, reason="needs CUDA and fla"
)


@contextlib.contextmanager
def _torch_recurrence():
    """transformers' torch recurrence for the fp32 truth on CPU: with fla installed its wrapper sends
    CPU tensors to fla's Triton kernels, which need CUDA."""
    with pytest.MonkeyPatch.context() as patch:
        for moe in (False, True):
            module = importlib.import_module(_deltanet_class(moe).__module__)
            chunk = module.torch_chunk_gated_delta_rule
            patch.setattr(module, "torch_chunk_gated_delta_rule", getattr(chunk, "__wrapped__", chunk))
        yield


@pytest.mark.gpu
@needs_fla_on_cuda
@pytest.mark.parametrize(("moe", "value_heads"), CASES)
def test_switched_layer_matches_transformers_fla_path_in_bf16(moe: bool, value_heads: int) -> None:
    """Against transformers' own GPU path (fla) on the same bf16 weights, and both against fp32."""
    fp32 = _module(moe, value_heads)
    x = torch.randn(2, 300, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), _torch_recurrence():
        truth = fp32(x)  # transformers' torch path on CPU, fp32
    reference = copy.deepcopy(fp32).to("cuda", torch.bfloat16)
    module = copy.deepcopy(fp32).to("cuda", torch.bfloat16)
    assert linear_attention.use_fast_forward(module) and module.dflash_core is linear_attention.fla_core
    assert not linear_attention.uses_fast_forward(reference)
    with torch.inference_mode():
        x = x.to("cuda", torch.bfloat16)
        expected, actual = reference(x).float().cpu(), module(x).float().cpu()
    # On CPU in bf16 (torch cores) the two paths were 1-2.5% from fp32 and 0.7-1% apart.
    assert _relative_error(actual, expected) < 4e-2
    assert _relative_error(actual, truth) < 1.25 * _relative_error(expected, truth) + 5e-3
    torch._dynamo.reset()


def _fp32_target(moe: bool) -> TargetFeatureExtractor:
    """A CPU fp32 target with unit-scale linear attention on transformers' own paths (the truth)."""
    config = _config(moe, value_heads=4)
    config._experts_implementation = "eager"
    extractor = TargetFeatureExtractor.build_random(config, [0, 2, 3], torch.float32, "cpu", seed=0)
    for index, linear in enumerate(_linear_layers(extractor)):
        _randomize(linear, seed=index)
    return extractor


def _bf16_copy(source: TargetFeatureExtractor, switch: bool) -> TargetFeatureExtractor:
    """`source`'s weights in bf16 on CUDA, on the fast kernels; `switch`: with the fast forward
    (else transformers' own for the linear attention, the other kernels the same)."""
    config = copy.deepcopy(source.decoder.config)
    extractor = TargetFeatureExtractor.build_random(config, [0, 2, 3], torch.bfloat16, "cuda", seed=1)
    extractor.decoder.load_state_dict(source.decoder.state_dict())
    if switch:
        assert extractor.use_fast_kernels()["linear_attention"] == target_kernels.FAST_LINEAR_ATTENTION
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear_attention, "fast_path_applies", lambda module: False)
            extractor.use_fast_kernels()
    layers = _linear_layers(extractor)
    assert len(layers) == 3 and all(linear_attention.uses_fast_forward(m) == switch for m in layers)
    return extractor


def _linear_layers(extractor: TargetFeatureExtractor) -> list[torch.nn.Module]:
    return [layer.linear_attn for layer in extractor.decoder.layers if hasattr(layer, "linear_attn")]


@pytest.mark.gpu
@needs_fla_on_cuda
@pytest.mark.parametrize("moe", [False, True])
def test_compiled_target_with_the_fast_forward_matches_transformers(moe: bool) -> None:
    """Judged against fp32: on CPU in bf16 the features of this target's later layers were 6-7%
    from fp32 on either path (bf16 rounding that the unit-scale layers amplify), and as far apart."""
    from torch._dynamo.utils import counters

    ids = torch.randint(0, 128, (2, 192), generator=torch.Generator().manual_seed(0))
    source = _fp32_target(moe)
    with _torch_recurrence():
        truth = source(ids)
    ids = ids.cuda()
    hf_error = _relative_error(_bf16_copy(source, switch=False)(ids).cpu(), truth)
    extractor = _bf16_copy(source, switch=True)

    def check() -> None:
        error = _relative_error(extractor(ids).cpu(), truth)
        assert error < 1.25 * hf_error + 1e-2 and error < 0.15, (error, hf_error)

    check()
    assert extractor.compile_layers() == {"whole layer": 1, "mlp and norms": 3}
    torch._dynamo.reset()
    check()
    frames = int(counters["frames"]["total"])
    for _ in range(2):  # the later calls run the cached graphs, compiling nothing
        check()
    assert int(counters["frames"]["total"]) == frames
    torch._dynamo.reset()


@pytest.mark.gpu
@needs_fla_on_cuda
@pytest.mark.parametrize("moe", [False, True])
def test_replayed_graphs_with_the_fast_forward_equal_the_eager_forward(moe: bool) -> None:
    extractor = _bf16_copy(_fp32_target(moe), switch=True)
    extractor.compile_layers()
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 128), (2, 192), (1, 128)]
    batches = [torch.randint(0, 128, shape, generator=g).cuda() for shape in shapes]
    eager = [extractor(ids) for ids in batches]
    extractor.use_cuda_graphs(max_tokens=2 * 192)
    for _ in range(2):  # the first pass captures, the second replays
        for ids, expected in zip(batches, eager, strict=True):
            torch.testing.assert_close(extractor(ids), expected, atol=0, rtol=0)
    assert extractor.cuda_graphs_off_because is None
    assert sorted(extractor._graphed.graphs) == [(1, 128), (2, 192)]
    torch._dynamo.reset()
