"""Helpers of bench/bench.py: shapes, synthetic data, random models, FLOP counts, timers, rank plumbing.

Nothing here reads a checkpoint or the network: targets, drafters, embeddings and LM heads are
random tensors built directly on the device, and micro-batches are random tokens of a fixed length
(so every compiled shape, the flex BlockMask included, is static).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Qwen3Config

from dflash_mp.block_diffusion import block_labels, sample_anchors
from dflash_mp.config import RootConfig, compose_config, default_target_layer_ids, to_dataclass
from dflash_mp.data import MicroBatch
from dflash_mp.models.dflash2 import GroupedDynamicConv
from dflash_mp.models.drafter import DFLASH2_FIELDS, SCALING_DEFAULTS, DFlashDrafter, build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.transport import Features, pack_tokens, unpack_tokens

GB = 1e9
GIB = 2**30


# ----------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """A target (Qwen3-shaped), the drafter over it, and the training sequence shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_layers: int
    seq_len: int
    num_anchors: int
    block_size: int
    matmul_n: int  # side of the square matmul that measures the peak

    @property
    def layer_ids(self) -> list[int]:
        return default_target_layer_ids(self.layers, self.draft_layers)

    def target_config(self) -> Qwen3Config:
        return Qwen3Config(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
            max_position_embeddings=max(40960, 2 * self.seq_len),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            initializer_range=0.02,
            attn_implementation="sdpa",
        )

    def describe(self) -> dict:
        d = dict(self.__dict__)
        d["target_layer_ids"] = self.layer_ids
        d["target_layers_run"] = max(self.layer_ids) + 1
        d["query_tokens_per_seq"] = self.num_anchors * self.block_size
        return d


SHAPES = {
    # Qwen3-8B: 36 layers, hidden 4096, 32/8 heads of 128, MLP 12288; 5-layer DFlash drafter.
    "qwen3-8b": Shape("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, 5, 3072, 512, 16, 8192),
    # Qwen3-4B at SpecForge's shape (max 2048 tokens, 512 anchors), for ANCHORS.md's first row.
    "qwen3-4b": Shape("qwen3-4b", 2560, 36, 32, 8, 128, 9728, 151936, 5, 2048, 512, 16, 8192),
    # A very small version for CPU (what the test runs).
    "tiny": Shape("tiny", 64, 6, 4, 2, 16, 192, 512, 2, 128, 16, 8, 256),
}


def bench_config(
    shape: Shape, device: torch.device, micro_batch: int, grad_accum: int, extra: list[str]
) -> RootConfig:
    """The composed conf/ with this benchmark's shape; model.target_path is never read."""
    overrides = [
        "model.target_path=/nonexistent/dflash-bench-random-target",
        f"model.draft_layers={shape.draft_layers}",
        f"model.block_size={shape.block_size}",
        f"data.max_length={shape.seq_len}",
        f"data.num_anchors={shape.num_anchors}",
        "topology.targets=1",
        "topology.drafters=1",
        f"train.micro_batch_size={micro_batch}",
        f"train.grad_accum={grad_accum}",
        "train.max_steps=100000",
        f"train.device={device.type}",
        # Random weights on random tokens: a rare non-finite step must not stop the measurement.
        "train.on_nonfinite=skip",
        "optim.lr=6e-4",
        *extra,
    ]
    return to_dataclass(compose_config(overrides))


# ----------------------------------------------------------------------------------------- data


class SyntheticReader:
    """Stands in for MicroBatchReader: micro-batch m = B random sequences of exactly seq_len tokens.

    The loss mask covers the second half (the "response"); sample ids are distinct per sequence, so
    every micro-batch draws its own anchors. Token rows come from a small pool, so reading is free.
    """

    def __init__(self, shape: Shape, micro_batch: int, seed: int = 0, pool: int = 8) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.shape, self.micro_batch = shape, micro_batch
        # The last id is the drafter's MASK token; keep it out of the data.
        self.pool = [
            torch.randint(0, shape.vocab - 1, (micro_batch, shape.seq_len), generator=generator)
            for _ in range(pool)
        ]
        self.loss_mask = torch.zeros(micro_batch, shape.seq_len, dtype=torch.uint8)
        self.loss_mask[:, shape.seq_len // 2 :] = 1
        self.lengths = torch.full((micro_batch,), shape.seq_len, dtype=torch.long)
        self.bad_records = self.too_long_records = 0  # the counters run_target reads

    def read(self, m: int) -> MicroBatch:
        b = self.micro_batch
        return MicroBatch(
            index=m,
            epoch=0,
            input_ids=self.pool[m % len(self.pool)],
            loss_mask=self.loss_mask,
            lengths=self.lengths,
            sample_ids=torch.arange(m * b, (m + 1) * b, dtype=torch.long),
        )


def batch_to(batch: MicroBatch, device: torch.device) -> MicroBatch:
    return replace(
        batch,
        input_ids=batch.input_ids.to(device),
        loss_mask=batch.loss_mask.to(device),
        lengths=batch.lengths.to(device),
        sample_ids=batch.sample_ids.to(device),
    )


def received_form(batch: MicroBatch, hidden: torch.Tensor, device: torch.device) -> Features:
    """`batch` exactly as a drafter's Receiver hands it over (same views, dtypes, device)."""
    tokens = pack_tokens(batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids).to(device)
    input_ids, loss_mask, lengths, sample_ids = unpack_tokens(tokens, batch.input_ids.shape[1])
    return Features(
        index=batch.index,
        epoch=batch.epoch,
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        sample_ids=sample_ids,
        hidden_states=hidden.contiguous(),
        nbytes=tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size(),
    )


# ----------------------------------------------------------------------------------------- models


class DeviceInitDrafter(DFlashDrafter):
    """DFlashDrafter initialised on its own device (GPU RNG) instead of from a CPU generator.

    Built under `torch.device(device)`, so 1B parameters never pass through host memory; the
    distribution (HF Qwen3 init) is the runtime's, only the random stream differs.
    """

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)
        # DFlash 2: the convolutions start as the identity, the selector as a no-op (as in training).
        for module in self.modules():
            if isinstance(module, GroupedDynamicConv):
                module.reset_to_identity()
        if self.candidate_selector is not None:
            self.candidate_selector.predecessor_codebook.normal_(0.0, std)
            self.candidate_selector.successor_codebook.zero_()


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Draw from the global RNG of `device`, seeded, without disturbing it for anyone else."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def random_drafter(shape: Shape, device: torch.device, seed: int, model_cfg: Any = None) -> DFlashDrafter:
    """`model_cfg` (cfg.model) picks the architecture, DFlash or DFlash 2 with its fields."""
    arch = model_cfg.arch if model_cfg is not None else "dflash"
    config = build_drafter_config(
        shape.target_config(),
        draft_layers=shape.draft_layers,
        target_layer_ids=shape.layer_ids,
        block_size=shape.block_size,
        mask_token_id=shape.vocab - 1,
        arch=arch,
        dflash2={key: getattr(model_cfg, key) for key in DFLASH2_FIELDS} if arch == "dflash2" else None,
        # Sliding layers and logit scaling change the step's masks and loss: bench them as configured.
        layer_types=None
        if model_cfg is None or model_cfg.layer_types is None
        else list(model_cfg.layer_types),
        sliding_window=None if model_cfg is None else model_cfg.sliding_window,
        scaling=None if model_cfg is None else {key: getattr(model_cfg, key) for key in SCALING_DEFAULTS},
    )
    with seeded(device, seed), device:
        return DeviceInitDrafter(config, seed=seed)


def random_embed_and_head(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int):
    with seeded(device, seed + 1):
        embed = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype).mul_(0.02)
        head = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype).mul_(0.02)
    return embed, head


def random_target(
    shape: Shape, dtype: torch.dtype, device: torch.device, seed: int, compile_layers: bool
) -> TargetFeatureExtractor:
    extractor = TargetFeatureExtractor.build_random(
        shape.target_config(), shape.layer_ids, dtype, device, seed=seed
    )
    if compile_layers:  # as the runtime does (train.compile)
        extractor.compile_layers()
    return extractor


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------------------- FLOPs

TARGET_FLOPS_COUNTING = (
    "per sequence: 2 * P * S (P = parameters of the decoder layers run, embedding lookup excluded) "
    "+ causal attention 2 * 2 * S^2 * heads * head_dim * layers_run / 2"
)

DRAFTER_FLOPS_COUNTING = (
    "train = 3 x (forward without the LM head) + 2 x LM head: the head is frozen, so its backward is "
    "the input gradient only (no weight gradient). forward per micro-batch = "
    "draft layers' q/o projections and MLP over all N*Bs query tokens "
    "+ k/v projections over the S context + N*Bs block tokens "
    "+ fc over the S context tokens (K*H -> H) "
    "+ block-sparse attention actually needed: 4 * heads * head_dim * sum over valid anchors of Bs * (anchor + Bs) "
    "(each block sees the context before its anchor and its own Bs tokens) per layer "
    "+ LM head 2 * H * V over the tokens with loss weight > 0. "
    "Counted on the resident micro-batch (the anchors the trainer draws for it); "
    "not counted: norms, RoPE, softmax, the optimizer"
)


def target_flops_per_seq(extractor: TargetFeatureExtractor, shape: Shape) -> dict:
    layers = extractor.decoder.layers
    params = count_params(layers)
    s = shape.seq_len
    matmul = 2 * params * s
    attention = 2 * 2 * s * s * shape.heads * shape.head_dim * len(layers) / 2
    return {
        "per_seq": matmul + attention,
        "params_used": params,
        "layers_run": len(layers),
        "linear": matmul,
        "attention": attention,
        "counting": TARGET_FLOPS_COUNTING,
    }


def drafter_flops_per_micro_batch(shape: Shape, cfg: RootConfig, batch: MicroBatch) -> dict:
    """Useful FLOPs of one drafter micro-step on `batch` (see DRAFTER_FLOPS_COUNTING)."""
    h, nh, nkv, hd, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    num_layers, k_layers, bs, n = (
        shape.draft_layers,
        len(shape.layer_ids),
        shape.block_size,
        shape.num_anchors,
    )
    b, s = batch.input_ids.shape
    anchors, valid = sample_anchors(
        batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, cfg.train.seed, n
    )
    _, weights = block_labels(
        batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, bs, cfg.train.gamma
    )
    q = n * bs
    per_layer_linear = b * (
        2 * q * h * nh * hd  # q_proj
        + 2 * 2 * (s + q) * h * nkv * hd  # k_proj, v_proj over context + block tokens
        + 2 * q * nh * hd * h  # o_proj
        + 2 * 3 * q * h * inter  # gate, up, down
    )
    attended_pairs = int((((anchors + bs) * valid).sum()) * bs)
    per_layer_attention = 4 * nh * hd * attended_pairs
    fc = 2 * b * s * k_layers * h * h
    scored = int((weights > 0).sum())
    lm_head = 2 * scored * h * shape.vocab
    forward = num_layers * (per_layer_linear + per_layer_attention) + fc + lm_head
    return {
        "forward": forward,
        "train": 3 * (forward - lm_head) + 2 * lm_head,
        # What the previous counting (3 x forward, head included) gave, to compare runs across it.
        "train_head_as_trainable": 3 * forward,
        "layers_linear": num_layers * per_layer_linear,
        "layers_attention": num_layers * per_layer_attention,
        "fc": fc,
        "lm_head": lm_head,
        "query_tokens": b * q,
        "context_tokens": b * s,
        "valid_anchors": int(valid.sum()),
        "scored_tokens": scored,
        "attended_pairs_per_layer": attended_pairs,
        "dense_pairs_per_layer": b * q * (s + q),
        "counting": DRAFTER_FLOPS_COUNTING,
    }


# ----------------------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Marks:
    """Timestamps on the device timeline (CUDA events) or the host clock (CPU); no synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        """Seconds from mark a to mark b (synchronises on CUDA: call after the run)."""
        if self.cuda:
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]

    def intervals(self) -> list[float]:
        return [self.seconds(i, i + 1) for i in range(len(self.marks) - 1)]


def distribution(seconds: list[float]) -> dict:
    """ms statistics of per-iteration times."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    mean = sum(ordered) / len(ordered)
    var = sum((x - mean) ** 2 for x in ordered) / len(ordered)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] * 1e3

    return {
        "n": len(ordered),
        "mean_ms": mean * 1e3,
        "median_ms": pct(0.5),
        "p10_ms": pct(0.1),
        "p90_ms": pct(0.9),
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "cv": (var**0.5) / mean if mean > 0 else None,
    }


def matmul_peak(device: torch.device, n: int, warmup: int, iters: int) -> dict:
    """Dense n^3 matmul throughput: bf16 on GPU (the MFU denominator), fp32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    sync(device)
    marks = Marks(device)
    marks.mark()
    for _ in range(iters):
        torch.matmul(a, b, out=out)
    marks.mark()
    seconds = marks.seconds(0, 1)
    flops = 2 * n**3 * iters
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "iters": iters,
        "ms_per_matmul": seconds / iters * 1e3,
        "tflops": flops / seconds / 1e12,
    }


# ----------------------------------------------------------------------------------------- compile


class RecompileLog(logging.Handler):
    """Collects dynamo's recompile reasons (the `recompiles` log artifact)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with suppress(Exception):  # a log record must never break a step
            self.messages.append(record.getMessage()[:600])


_RECOMPILE_LOG: RecompileLog | None = None


def install_recompile_log() -> None:
    """Route dynamo's recompile reasons to RecompileLog (and to stderr, unless TORCH_LOGS is set)."""
    global _RECOMPILE_LOG
    if _RECOMPILE_LOG is not None:
        return
    _RECOMPILE_LOG = RecompileLog()
    try:
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(_RECOMPILE_LOG)
    except Exception:  # older/newer torch: the frame counter below still counts
        pass


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class CompileWatch:
    """Frames dynamo (re)compiles between `start()` and `result()`: 0 after warm-up means no recompiles."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.frames0 = _frames_compiled()
        self.reasons0 = len(_RECOMPILE_LOG.messages) if _RECOMPILE_LOG else 0

    def result(self) -> dict:
        reasons = _RECOMPILE_LOG.messages[self.reasons0 :] if _RECOMPILE_LOG else []
        return {"recompiles": _frames_compiled() - self.frames0, "recompile_reasons": reasons[:5]}


def frames_compiled_total() -> int:
    return _frames_compiled()


def compile_seconds() -> dict[str, list[float]]:
    """Seconds per compilation phase so far (dynamo's `dynamo_timed` metrics), one entry per frame/graph.

    Where a cold start goes: tracing (`_compile.compile_inner`), the forward and backward inductor
    builds (`compile_fx.<locals>.fw_compiler_base`, `...bw_compiler`), waiting on Triton workers.
    """
    from torch._dynamo.utils import compilation_time_metrics

    return {name: [round(t, 2) for t in times] for name, times in compilation_time_metrics.items()}


# ----------------------------------------------------------------------------------------- memory


def memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_report(device: torch.device) -> dict:
    import resource

    report = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}
    if device.type == "cuda":
        report.update(
            peak_allocated_gb=torch.cuda.max_memory_allocated(device) / GB,
            peak_reserved_gb=torch.cuda.max_memory_reserved(device) / GB,
            allocated_now_gb=torch.cuda.memory_allocated(device) / GB,
        )
    return report


# ----------------------------------------------------------------------------------------- rank plumbing


def gather_json(obj: dict, group) -> list[dict]:
    """Every rank's `obj` on every rank, as JSON bytes over a gloo group (no pickling)."""
    world = dist.get_world_size(group)
    payload = json.dumps(obj, default=str).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(buffers, buffer, group=group)
    return [json.loads(bytes(b[: int(s)].tolist()).decode()) for b, s in zip(buffers, sizes, strict=True)]


def deep_merge(into: dict, other: dict) -> dict:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def write_json(path: str, obj: dict) -> None:
    """Atomic write (tmp + rename), non-finite numbers as null."""

    def clean(x):
        if isinstance(x, float) and not (x == x and abs(x) != float("inf")):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(clean(obj), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Watchdog:
    """Bounds every blocking phase: past its deadline, or when the other rank reported a failure
    in the same phase (or its exit) and this rank is still inside the phase `grace_s` later,
    `on_abort(phase, reason)` runs (it writes what is known and exits the process). A rank blocked
    in a receive from a peer that failed can therefore never hang the job."""

    def __init__(
        self, peer_state: Callable[[], dict | None], on_abort: Callable[[str, str], None], grace_s: float
    ):
        self.peer_state, self.on_abort, self.grace_s = peer_state, on_abort, grace_s
        self.lock = threading.Lock()
        self.phase: str | None = None
        self.deadline = 0.0
        self.timeout = 0.0
        self.peer_failed_seen: float | None = None
        threading.Thread(target=self._loop, name="bench-watchdog", daemon=True).start()

    def arm(self, phase: str, timeout_s: float) -> None:
        with self.lock:
            self.phase, self.timeout = phase, timeout_s
            self.deadline = time.monotonic() + timeout_s
            self.peer_failed_seen = None

    def disarm(self) -> None:
        with self.lock:
            self.phase = None

    def _loop(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                phase, deadline, timeout = self.phase, self.deadline, self.timeout
            if phase is None:
                continue
            reason = None
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:.0f}s (raise --timeout-scale if this is just slow)"
            else:
                peer = self.peer_state() or {}
                failed = peer.get("failed") or {}
                if peer.get("exited") or failed.get("phase") == phase:
                    if self.peer_failed_seen is None:
                        self.peer_failed_seen = time.monotonic()
                    elif time.monotonic() - self.peer_failed_seen > self.grace_s:
                        what = "exited" if peer.get("exited") else "failed in this section"
                        reason = (
                            f"the other rank {what} ({str(failed.get('error', '?'))[:300]}) and this "
                            f"rank was still blocked {self.grace_s:.0f}s later"
                        )
            if reason is not None:
                with self.lock:
                    if self.phase != phase:
                        continue
                self.on_abort(phase, reason)
                return
