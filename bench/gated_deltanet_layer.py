"""One Qwen3.5 gated-deltanet layer at S=3072 on GPU: transformers' forward (its short convolution routed
as a target rank routes it) against dflash_mp's (models/linear_attention.py), each replayed from a CUDA
graph, at the 35B-A3B, 9B and 27B layer shapes. Needs CUDA and fla-core: python bench/gated_deltanet_layer.py"""

import copy

import torch
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from dflash_mp.models import linear_attention, target_kernels

SHAPES = {"35b-a3b": (2048, 16, 32), "9b": (4096, 16, 32), "27b": (5120, 16, 48)}


def timed(m, x, iters=50):
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                m(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(x)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        return out.clone(), a.elapsed_time(b) / iters


def main() -> None:
    for name, (hidden, kh, vh) in SHAPES.items():
        cfg = Qwen3_5MoeTextConfig(
            hidden_size=hidden,
            linear_num_key_heads=kh,
            linear_num_value_heads=vh,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
        )
        torch.manual_seed(0)
        old = Qwen3_5MoeGatedDeltaNet(cfg, 0).to("cuda", torch.bfloat16).eval().requires_grad_(False)
        new = copy.deepcopy(old)
        target_kernels.route_short_convolution(old)
        for m in (old, new):
            m.norm.compile()
        assert linear_attention.use_fast_forward(new)
        x = torch.randn(1, 3072, hidden, device="cuda", dtype=torch.bfloat16)
        ref, t_old = timed(old, x)
        out, t_new = timed(new, x)
        rel = ((out - ref).float().norm() / ref.float().norm()).item()
        print(
            f"{name}: layer S=3072 transformers {t_old:.3f} ms, dflash_mp {t_new:.3f} ms ({t_old / t_new:.2f}x), rel diff {rel:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
