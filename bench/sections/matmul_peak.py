"""The bf16 matmul peak of each GPU (fp32 on CPU): the MFU denominator; and, with
--matmul-sustain-s, the rate matmuls hold once the GPU runs at its power limit."""

from __future__ import annotations

import torch
from benchlib.state import BenchState
from benchlib.timing import matmul_peak

TIMEOUT_S = 90


def run(bench: BenchState) -> dict:
    n = bench.args.matmul_n or bench.shape.matmul_n
    result = matmul_peak(
        bench.device,
        n,
        warmup=max(3, bench.args.warmup),
        iters=bench.args.matmul_iters,
        sustain_s=bench.args.matmul_sustain_s,
    )
    result["device_name"] = torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu"
    bench.peak_flops = result["tflops"] * 1e12
    bench.sustained_flops = result["sustained_tflops"] * 1e12 if "sustained_tflops" in result else None
    return {"per_rank": {str(bench.rank): result}}
