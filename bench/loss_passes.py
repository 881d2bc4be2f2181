"""The vocabulary passes of DSpark's and XPress's losses alone, at one chunk of Qwen3-8B's shape
([880, 151936] bf16 by default): each statistics pass (kernels/row_statistics.py: the logits alone,
biased, biased with the base from the same read) and XPress's gradient pass (kernels/fused_xpress.py),
with the bytes each moves per millisecond. Needs CUDA and Triton:

    python bench/loss_passes.py [--rows 880] [--vocab 151936] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_mp.kernels.fused_xpress import xpress_gradients_in_place
from dflash_mp.kernels.row_statistics import ChunkLogits, ce_with_base, row_statistics


def _milliseconds(fn, iters: int = 40) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=880)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--passes", type=int, default=4, help="XPress's biased passes (1 + rounds)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows, vocab, device = args.rows, args.vocab, torch.device("cuda")
    raw = (torch.randn(rows, vocab, device=device) * 3).bfloat16()
    biases = torch.randn(args.passes, rows, vocab, device=device).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device=device)
    unit = rows * vocab * raw.element_size()  # bytes of one [rows, V] tensor
    lse = torch.zeros(args.passes + 1, rows, device=device)
    weights = torch.full((args.passes + 1, rows), 1e-3, device=device)
    scratch = raw.clone()
    runs = {  # name: (the call, [rows, V] tensors it reads or writes)
        "statistics, logits alone": (lambda: row_statistics(ChunkLogits(raw, None, None, labels)), 1),
        "statistics, biased": (lambda: row_statistics(ChunkLogits(raw, biases[0], None, labels)), 2),
        "statistics, biased with the base": (
            lambda: ce_with_base(ChunkLogits(raw, biases[0], None, labels)),
            2,
        ),
        f"gradient pass, {args.passes} biased passes and the base": (
            lambda: xpress_gradients_in_place(scratch.copy_(raw), biases, labels, lse, weights),
            2 * args.passes + 2,
        ),
    }
    results = {"device": torch.cuda.get_device_name(), "rows": rows, "vocab": vocab, "passes": {}}
    copy_ms = _milliseconds(lambda: scratch.copy_(raw))
    for name, (call, tensors) in runs.items():
        ms = _milliseconds(call) - (copy_ms if name.startswith("gradient") else 0.0)
        results["passes"][name] = {"ms": round(ms, 4), "GB_per_s": round(tensors * unit / ms / 1e6)}
        print(f"{name:50s} {ms:7.4f} ms {tensors * unit / ms / 1e6:7.0f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
