"""The target's fast kernels keep its features equal to HF's own forward (fp32, CPU, tiny configs)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import GptOssConfig, Qwen3_5TextConfig, Qwen3MoeConfig

from dflash_mp.models import target_flex_attention, target_kernels
from dflash_mp.models.moe_experts import EXPERTS_IMPLEMENTATION
from dflash_mp.models.target import TargetFeatureExtractor

SEQ = 40  # over three flex blocks of the sliding window's 16 rows, not a multiple of any


def _gpt_oss() -> GptOssConfig:
    return GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip


def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        vocab_size=128,
    )  # fmt: skip


def _qwen3_5(moe: bool = False):
    shared = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        vocab_size=128,
    )  # fmt: skip
    if moe:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            **shared, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
    return Qwen3_5TextConfig(**shared, intermediate_size=96)


FAMILIES = {
    "gpt_oss": _gpt_oss,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": lambda: _qwen3_5(moe=True),
}


def _reference_and_extractor(config, layer_ids: list[int]) -> tuple[torch.Tensor, TargetFeatureExtractor]:
    """HF's hidden states (its eager attention and experts) and an extractor over the same weights."""
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # HF's loop over experts
    extractor = TargetFeatureExtractor.build_random(config, layer_ids, torch.float32, "cpu", seed=3)
    input_ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = extractor.decoder(
            input_ids=input_ids, use_cache=False, output_hidden_states=True
        ).hidden_states
    last = len(extractor.decoder.layers) - 1
    # hidden_states[-1] carries the final norm; a layer below the top is read raw.
    expected = torch.cat([hidden[i + 1] if i < last else hidden[-1] for i in layer_ids], dim=-1)
    return expected, extractor


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_kernels_keep_hf_hidden_states(family: str) -> None:
    config = FAMILIES[family]()
    layer_ids = [0, 2, config.num_hidden_layers - 1]
    expected, extractor = _reference_and_extractor(config, layer_ids)
    kernels = extractor.use_fast_kernels()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(extractor(ids), expected, atol=2e-5, rtol=2e-5)
    if family == "gpt_oss":
        assert extractor.decoder.config._attn_implementation == target_flex_attention.SINK_ATTENTION
        assert "sinks" in kernels["attention"]
    if "moe" in family or family == "gpt_oss":
        assert kernels["experts"] == EXPERTS_IMPLEMENTATION
    if family.startswith("qwen3_5"):
        assert "linear_attention" in kernels


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "qwen3_5_moe"])
def test_the_pointwise_combine_equals_transformers_experts(family: str) -> None:
    """moe_experts' forward against transformers' loop and its grouped_mm forward, with a top-k
    where tokens share experts and some experts get no token (gpt-oss: biases, transposed weights,
    its own clamped gate)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from dflash_mp.models import moe_experts

    assert moe_experts.register()
    config = FAMILIES[family]()
    config._experts_implementation = "eager"
    extractor = TargetFeatureExtractor.build_random(config, [0], torch.float32, "cpu", seed=5)
    experts = extractor.decoder.layers[0].mlp.experts
    for p in experts.parameters():  # random biases too (they start at zero)
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(9, config.hidden_size, generator=g)
    index = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(9)])  # expert 3 idle
    weights = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        expected = experts(tokens, index, weights)  # transformers' eager loop
        ours = moe_experts.grouped_experts_forward(experts, tokens, index, weights)
        grouped = grouped_mm_experts_forward(experts, tokens, index, weights)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, grouped, atol=1e-5, rtol=1e-5)
    assert ours.abs().max() > 0.1


def test_sink_attention_matches_hf_eager_with_large_sinks() -> None:
    """The sigmoid(lse - s) rescale, also where the sink takes most of a row's weight."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, window = 2, 4, 2, 16, 8
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.tensor([-3.0, 0.0, 4.0, 12.0]))
    module.num_key_value_groups = heads // kv_heads
    module.training = False
    q = torch.randn(batch, heads, SEQ, dim)
    k, v = torch.randn(batch, kv_heads, SEQ, dim), torch.randn(batch, kv_heads, SEQ, dim)
    i = torch.arange(SEQ)
    for sliding in (None, window):
        allowed = i[:, None] >= i[None]
        if sliding:
            allowed &= i[:, None] - i[None] < sliding
        additive = torch.zeros(SEQ, SEQ).masked_fill(~allowed, float("-inf"))[None, None]
        expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=dim**-0.5)

        def mask_mod(b, h, q_idx, kv_idx, sliding=sliding):
            keep = q_idx >= kv_idx
            return keep & (q_idx - kv_idx < sliding) if sliding else keep

        block_mask = target_flex_attention.sink_block_mask(batch, SEQ, SEQ, mask_function=mask_mod)
        out, _ = target_flex_attention.sink_attention_forward(
            module, q, k, v, block_mask, scaling=dim**-0.5, s_aux=module.sinks
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_compile_plan_leaves_linear_attention_eager() -> None:
    decoder = TargetFeatureExtractor.build_random(_qwen3_5(), [3], torch.float32, "cpu").decoder
    calls: list[str] = []
    for name, module in decoder.named_modules():
        module.compile = lambda name=name, **_: calls.append(name)  # record, do not compile
    plans = target_kernels.compile_layers(decoder.layers)
    assert plans == {"whole layer": 1, "mlp and norms": 3}
    assert "layers.3" in calls and "layers.0" not in calls
    assert "layers.0.mlp" in calls and "layers.0.linear_attn.norm" in calls
    assert not any(name.endswith("linear_attn") for name in calls)


def test_describe_kernels_names_the_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = target_kernels.importlib.util.find_spec
    monkeypatch.setattr(
        target_kernels.importlib.util,
        "find_spec",
        lambda name: None if name == "fla" else real_find_spec(name),
    )
    kernels = target_kernels.describe_kernels(_qwen3_5(), on_gpu=True)
    assert "torch fallback" in kernels["linear_attention"] and "222 ms" in kernels["linear_attention"]
    assert target_kernels.describe_kernels(_gpt_oss(), on_gpu=True)["attention"].startswith("flex")
    assert target_kernels.describe_kernels(_qwen3_moe(), on_gpu=True)["experts"] == EXPERTS_IMPLEMENTATION
    assert "linear_attention" not in target_kernels.describe_kernels(_qwen3_moe(), on_gpu=True)


def test_doctor_names_the_kernels_and_the_missing_extra(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_mp.launch.doctor import check_target_kernels

    hybrid, sinks = tmp_path / "hybrid", tmp_path / "sinks"
    _qwen3_5().save_pretrained(hybrid)
    _gpt_oss().save_pretrained(sinks)
    real_find_spec = target_kernels.importlib.util.find_spec
    monkeypatch.setattr(
        target_kernels.importlib.util,
        "find_spec",
        lambda name: None if name == "fla" else real_find_spec(name),
    )
    check = check_target_kernels(str(hybrid), on_gpu=True)
    assert check.ok and check.message.startswith("warning: ")
    assert "linear_attention: torch fallback" in check.message and "106 ms" in check.message
    monkeypatch.setattr(target_kernels.importlib.util, "find_spec", lambda name: object())
    assert "fla Triton kernels" in check_target_kernels(str(hybrid), on_gpu=True).message
    check = check_target_kernels(str(sinks), on_gpu=True)
    assert check.ok and not check.message.startswith("warning")
    assert (
        "attention: flex_attention with sinks" in check.message
        and f"experts: {EXPERTS_IMPLEMENTATION}" in check.message
        and "CUDA graphs: one per input shape" in check.message
    )
    assert "CUDA graphs: no" in check_target_kernels(str(sinks), on_gpu=True, cuda_graphs=False).message
    assert "CUDA graphs" not in check_target_kernels(str(sinks), on_gpu=False).message
    assert check_target_kernels(str(tmp_path / "absent"), on_gpu=True).message.startswith(
        "warning: cannot read"
    )


def _assert_close_in_bf16(actual: torch.Tensor, expected: torch.Tensor, routed: bool) -> None:
    """bf16 tolerance; where a router picks experts (gpt-oss here) a near-tie that rounds the other
    way sends a token to other experts, so up to 1% of the elements may differ more (on an H200,
    0.45% did). The fp32 CPU tests above hold every family to 2e-5."""
    if not routed:
        torch.testing.assert_close(actual, expected, atol=6e-2, rtol=6e-2)
        return
    outside = (actual.float() - expected.float()).abs() > 6e-2 + 6e-2 * expected.float().abs()
    assert outside.float().mean().item() <= 0.01, f"{int(outside.sum())} of {outside.numel()} elements differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_fast_kernels_match_hf_in_bf16_on_cuda(family: str) -> None:
    """The GPU path (compiled flex with sinks, grouped_mm, per-kind compile) without recompiles."""
    from torch._dynamo.utils import counters

    config = FAMILIES[family]()
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    layer_ids = [0, 2, config.num_hidden_layers - 1]
    extractor = TargetFeatureExtractor.build_random(config, layer_ids, torch.bfloat16, "cuda", seed=0)
    ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(0)).cuda()
    expected = extractor(ids)
    extractor.use_fast_kernels()
    extractor.compile_layers()
    torch._dynamo.reset()
    _assert_close_in_bf16(extractor(ids), expected, routed=family == "gpt_oss")
    frames = int(counters["frames"]["total"])
    for _ in range(2):  # the later calls run the cached graphs, compiling nothing
        _assert_close_in_bf16(extractor(ids), expected, routed=family == "gpt_oss")
    assert int(counters["frames"]["total"]) == frames
    torch._dynamo.reset()


def test_shifted_causal_conv_equals_transformers_fallback() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    fallback = getattr(causal_conv1d_fn, "dflash_original", causal_conv1d_fn)
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(2, 24, SEQ, generator=g),
        torch.randn(24, 4, generator=g),
        torch.randn(24, generator=g),
    )
    for b, act in ((bias, "silu"), (None, None)):
        expected = fallback(x, weight, b, activation=act)
        torch.testing.assert_close(target_kernels.shifted_causal_conv(x, weight, b, act), expected)


def test_compiled_deltanet_layers_route_their_convolution_and_keep_hf_features(monkeypatch) -> None:
    """compile_layers sends the short convolution of its own layers through the shifted kernel; another
    model of the same class (an HF reference) keeps transformers' path."""
    if importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("causal-conv1d installed: transformers' kernel is kept")
    calls = []
    real = target_kernels.shifted_causal_conv
    monkeypatch.setattr(target_kernels, "shifted_causal_conv", lambda *a: calls.append(1) or real(*a))
    config = _qwen3_5()
    layer_ids = [0, 2, config.num_hidden_layers - 1]
    expected, extractor = _reference_and_extractor(config, layer_ids)
    for module in extractor.decoder.modules():
        monkeypatch.setattr(module, "compile", lambda **_: None, raising=False)
    extractor.compile_layers()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(extractor(ids), expected, atol=2e-5, rtol=2e-5)
    assert len(calls) == 3  # the three deltanet layers of four
    calls.clear()
    other = TargetFeatureExtractor.build_random(config, layer_ids, torch.float32, "cpu", seed=3)
    with torch.no_grad():
        other.decoder(input_ids=ids, use_cache=False)
    assert calls == []


@pytest.mark.parametrize("num_experts", [256, 300])
def test_expert_ids_past_eight_bits_are_grouped_by_expert_too(num_experts: int) -> None:
    """The sort keys are as narrow as the expert count allows (uint8 up to 256 experts, else
    int16): the highest ids (255; 298 and 299) must not wrap onto low experts."""
    from dflash_mp.models import moe_experts

    assert moe_experts.register()
    config = _qwen3_moe()
    config.num_experts = num_experts
    config._experts_implementation = "eager"
    extractor = TargetFeatureExtractor.build_random(config, [0], torch.float32, "cpu", seed=6)
    experts = extractor.decoder.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(6, config.hidden_size, generator=g)
    high = [num_experts - 1, 255, 0, 1, num_experts - 2, 254]
    index = torch.tensor([[high[i], high[(i + 1) % 6]] for i in range(6)])
    weights = torch.rand(6, 2, generator=g)
    with torch.no_grad():
        expected = experts(tokens, index, weights)  # transformers' eager loop
        ours = moe_experts.grouped_experts_forward(experts, tokens, index, weights)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
