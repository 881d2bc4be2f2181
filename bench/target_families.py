"""The target stage of each model family next to HF's own forward, on one GPU (no torchrun).

    python bench/target_families.py --out families.json          # the five family shapes, one GPU
    python bench/target_families.py --shapes qwen3.5-9b,gpt-oss-20b --out families.json
    python bench/target_families.py --shapes tiny-gpt-oss --device cpu   # CPU smoke run
    python bench/target_families.py --shapes qwen3-30b-a3b --experts grouped_mm --profile   # A/B, kernels
    python bench/target_families.py --shapes qwen3-30b-a3b --batch 4   # 4 sequences per forward

For each shape (bench/benchlib/family_shapes.py) a random bf16 target is built on the GPU, layers up
to the last one a 5-layer drafter reads, and three forwards of the same weights are timed on one
batch of --batch sequences (a job's train.micro_batch_size, default 1) of S random tokens, and
on a GPU a fourth:
- hf: the plain HF forward with output_hidden_states and transformers' defaults (SDPA where the
  model allows it, eager attention for gpt-oss; its default experts implementation);
- kernels: TargetFeatureExtractor after use_fast_kernels (sink attention on flex, grouped-GEMM
  experts; fla's kernels for linear attention whenever installed, in every variant);
- compiled: the same, compiled per layer kind (compile_layers), issued call by call;
  `--experts grouped_mm` runs transformers' experts there instead of ours, `--profile` adds its
  top kernels;
- target_stage: as a training job runs it: on a GPU the compiled forward replayed from a CUDA
  graph (train.cuda_graphs=auto), on a CPU the compiled forward itself.
MFU = 2 x (parameters of the layers run, experts scaled by top-k / experts) x B x S per forward over
the bf16 matmul peak measured at the start of the same run (attention left out; reported apart
for the softmax-attention layers). Peak memory is the GPU's allocated peak during each variant.
Every shape is written to --out as soon as it is measured; a failed shape records its error.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

import torch  # noqa: E402
import transformers  # noqa: E402
from benchlib.family_shapes import FAMILY_SHAPES, FamilyShape  # noqa: E402
from benchlib.timing import GB, Marks, distribution, matmul_peak, memory_reset, sync  # noqa: E402

from dflash_mp.models import moe_experts  # noqa: E402
from dflash_mp.models.moe_experts import EXPERTS_IMPLEMENTATION  # noqa: E402
from dflash_mp.models.target import TargetFeatureExtractor  # noqa: E402
from dflash_mp.models.target_kernels import linear_attention_kernels  # noqa: E402

DEFAULT_SHAPES = "qwen3.5-9b,qwen3-30b-a3b,gpt-oss-20b,qwen3.5-27b,qwen3.5-35b-a3b"


def active_params(layers: torch.nn.Module, config) -> tuple[int, int]:
    """(all, active) parameters of `layers`: a routed expert's weights count top_k / experts of the time."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = active = 0
    for name, p in layers.named_parameters():
        total += p.numel()
        routed = experts and ".experts." in name and p.dim() >= 2 and p.shape[0] == experts
        active += p.numel() * top_k // experts if routed else p.numel()
    return total, active


def attention_flops(config, layers_run: int, s: int) -> int:
    """Causal softmax attention (QK^T and PV) of the layers run; sliding layers over their window."""
    types = (getattr(config, "layer_types", None) or ["full_attention"] * layers_run)[:layers_run]
    per_pair = 4 * config.num_attention_heads * config.head_dim
    window = getattr(config, "sliding_window", None) or s
    pairs = {"full_attention": s * (s + 1) // 2, "sliding_attention": s * min(window, s)}
    return sum(per_pair * pairs.get(t, 0) for t in types)


def timed(forward, device: torch.device, warmup: int, iters: int) -> dict:
    """First call (compile included), then mean ms over `iters` after `warmup` and the peak memory."""
    memory_reset(device)
    start = time.perf_counter()
    out = forward()
    sync(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        out = forward()
    sync(device)
    marks = Marks(device)
    marks.mark()
    issued = time.perf_counter()
    for _ in range(iters):
        out = forward()
        marks.mark()
    issued = time.perf_counter() - issued  # the host's time to issue the calls (no sync inside)
    sync(device)
    times = marks.intervals()
    result = {
        "first_call_s": first_s,
        "ms": sum(times) / len(times) * 1e3,
        "forward_time": distribution(times),
        # Near `ms`: the device waited for the host (launch overhead or a sync in the forward).
        "host_ms": issued / iters * 1e3,
    }
    if device.type == "cuda":
        result["peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GB
    return result, out


def top_kernels(forward, device: torch.device, calls: int = 2, top: int = 25) -> list[dict]:
    """The kernels (GPU) or operators (CPU) taking the most self time over `calls` forwards."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            forward()
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in rows)
    rows.sort(key=lambda e: -getattr(e, key))
    return [
        {
            "name": e.key[:160],
            "ms_per_forward": getattr(e, key) / 1e3 / calls,
            "share": getattr(e, key) / total,
            "count_per_forward": e.count / calls,
        }
        for e in rows[:top]
    ]


def measure(
    shape: FamilyShape, device: torch.device, dtype: torch.dtype, args, peak_flops: float | None
) -> dict:
    config = shape.config()
    extractor = TargetFeatureExtractor.build_random(config, shape.layer_ids, dtype, device, seed=args.seed)
    decoder = extractor.decoder
    s = shape.seq_len
    b = args.batch
    ids = torch.randint(0, config.vocab_size, (b, s), generator=torch.Generator().manual_seed(args.seed)).to(
        device
    )
    total, active = active_params(decoder.layers, config)
    linear_flops = 2 * active * s * b
    result: dict = {
        "model_type": shape.model_type,
        "config": shape.fields,
        "seq_len": s,
        "batch": b,
        "layer_ids": shape.layer_ids,
        "layers_run": len(decoder.layers),
        "params_layers_run": total,
        "active_params_layers_run": active,
        "weights_gb": sum(p.numel() * p.element_size() for p in decoder.parameters()) / GB,
        "matmul_flops_per_forward": linear_flops,
        "attention_flops_per_forward": b * attention_flops(config, len(decoder.layers), s),
        "hf_implementations": {
            "attention": decoder.config._attn_implementation,
            "experts": getattr(decoder.config, "_experts_implementation", None),
        },
        "variants": {},
    }

    def hf_forward():
        with torch.inference_mode():
            hidden = decoder(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        # HF's last entry carries the final norm (the truncated top layer's raw output is not kept).
        return torch.cat([hidden[i + 1] for i in shape.layer_ids], dim=-1)

    def as_hf_returns(features: torch.Tensor) -> torch.Tensor:
        """Our features with the final norm on the truncated top layer, as HF's hidden_states hold it."""
        *below, top = features.split(config.hidden_size, dim=-1)
        if max(shape.layer_ids) < extractor.num_target_layers - 1:
            with torch.inference_mode():
                top = decoder.norm(top)
        return torch.cat([*below, top], dim=-1)

    variants = result["variants"]
    variants["hf"], reference = timed(hf_forward, device, args.warmup, args.iters)
    result["kernels"] = extractor.use_fast_kernels()
    variants["kernels"], features = timed(lambda: extractor(ids), device, args.warmup, args.iters)
    result["compiled"] = extractor.compile_layers()
    outputs = {"kernels": features}
    # On a GPU the job replays CUDA graphs of the compiled forward (train.cuda_graphs=auto); the
    # compiled forward issued call by call is measured first, as "compiled".
    stage = "compiled" if device.type == "cuda" else "target_stage"
    variants[stage], outputs[stage] = timed(lambda: extractor(ids), device, args.warmup, args.iters)
    if args.profile:
        result["target_stage_top_kernels"] = top_kernels(lambda: extractor(ids), device)
    if device.type == "cuda":
        extractor.use_cuda_graphs()
        variants["target_stage"], outputs["target_stage"] = timed(
            lambda: extractor(ids), device, args.warmup, args.iters
        )
        result["cuda_graphs_off_because"] = extractor.cuda_graphs_off_because
    scale = reference.float().abs().max().item()
    for name, out in outputs.items():
        variants[name]["max_abs_diff_vs_hf"] = (
            (as_hf_returns(out).float() - reference.float()).abs().max().item()
        )
        variants[name]["hf_max_abs"] = scale
    for v in variants.values():
        v["tflops"] = linear_flops / v["ms"] / 1e9
        v["mfu"] = v["tflops"] * 1e12 / peak_flops if peak_flops else None
    result["speedup_vs_hf"] = variants["hf"]["ms"] / variants["target_stage"]["ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(FAMILY_SHAPES)}")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", default="bench-target-families.json")
    # A stage compiled from a cold inductor cache speeds up over its next calls (BENCHMARKS.md, "Warm
    # a MoE forward up well before timing it").
    p.add_argument("--warmup", type=int, default=30, help="calls after the first (compiling) one")
    p.add_argument("--iters", type=int, default=5, help="measured forwards per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="sequences per forward (train.micro_batch_size)")
    p.add_argument(
        "--experts",
        choices=(EXPERTS_IMPLEMENTATION, "grouped_mm"),
        default=EXPERTS_IMPLEMENTATION,
        help="the target stage's MoE experts: ours (pointwise combine) or transformers' grouped_mm",
    )
    p.add_argument("--profile", action="store_true", help="top kernels of the target stage (torch.profiler)")
    p.add_argument(
        "--time-budget", type=float, default=450.0, help="start no shape after this many s (0: none)"
    )
    args = p.parse_args(argv)
    if args.experts != EXPERTS_IMPLEMENTATION:
        moe_experts.register = lambda: False  # use_fast_kernels keeps transformers' grouped_mm
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FAMILY_SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(FAMILY_SHAPES)}")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    start = time.perf_counter()
    peak = matmul_peak(device, 8192 if cuda else 256, warmup=3, iters=50 if cuda else 3)
    report: dict = {
        "schema": "dflash_mp.bench.target_families/1",
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "linear_attention_kernels": linear_attention_kernels(),
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_peak": peak,
        "args": vars(args),
        "shapes": {},
    }
    failed = False
    for name in names:
        elapsed = time.perf_counter() - start
        if args.time_budget and elapsed > args.time_budget:
            report["shapes"][name] = {"status": "skipped", "reason": f"time budget: {elapsed:.0f}s elapsed"}
            continue
        print(f"[families {elapsed:6.1f}s] {name}: start", flush=True)
        try:
            result = {
                "status": "ok",
                **measure(FAMILY_SHAPES[name], device, dtype, args, peak["tflops"] * 1e12),
            }
        except Exception as e:
            traceback.print_exc()
            result, failed = {"status": "error", "error": f"{type(e).__name__}: {e}"}, True
        result["elapsed_s"] = time.perf_counter() - start - elapsed
        report["shapes"][name] = result
        report["total_s"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"[families] {name}: {_line(result)}", flush=True)
        gc.collect()
        torch._dynamo.reset()  # the compiled graphs hold the layers' weights
        if cuda:
            torch.cuda.empty_cache()
    print(_table(report), flush=True)
    return 1 if failed else 0


def _line(result: dict) -> str:
    if result["status"] != "ok":
        return result["status"] + ": " + result.get("error", "")
    v = result["variants"]
    return (
        ", ".join(
            f"{k} {v[k]['ms']:.1f} ms (MFU {v[k]['mfu'] or 0:.2f}, peak {v[k].get('peak_allocated_gb', 0):.1f} GB)"
            for k in v
        )
        + f"; target stage issued in {v['target_stage']['host_ms']:.1f} ms of host time"
        + f"; x{result['speedup_vs_hf']:.2f} vs hf; first compiled call {v.get('compiled', v['target_stage'])['first_call_s']:.1f}s"
    )


def _table(report: dict) -> str:
    rows = [
        f"matmul peak {report['matmul_peak']['tflops']:.0f} TFLOP/s on {report['device_name']}; "
        f"linear attention: {report['linear_attention_kernels']}",
        "| shape | active / all params run | hf ms (MFU) | kernels ms | compiled ms | target stage ms (MFU) "
        "| host ms | x hf | peak GB | first call s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["shapes"].items():
        if r["status"] != "ok":
            rows.append(f"| {name} | {r['status']}: {r.get('error', r.get('reason', ''))} |")
            continue
        v = r["variants"]
        hf, kernels, stage = v["hf"], v["kernels"], v["target_stage"]
        compiled = v.get("compiled", stage)
        rows.append(
            f"| {name} | {r['active_params_layers_run'] / 1e9:.2f} B / {r['params_layers_run'] / 1e9:.2f} B "
            f"| {hf['ms']:.1f} ({hf['mfu'] or 0:.2f}) | {kernels['ms']:.1f} | {compiled['ms']:.1f} "
            f"| {stage['ms']:.1f} ({stage['mfu'] or 0:.2f}) "
            f"| {stage.get('host_ms', 0):.1f} | {r['speedup_vs_hf']:.2f} | {stage.get('peak_allocated_gb', 0):.1f} | {compiled['first_call_s']:.1f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
