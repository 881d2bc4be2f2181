"""Benchmark shapes (Qwen3- or Llama-shaped targets, the drafter over them, the sequence shape) and their config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dflash_mp.config.schema import default_target_layer_ids
from dflash_mp.plan.costs import ModelShape

if TYPE_CHECKING:  # imported where used: bench.py reads SHAPES' names before torch is imported
    import torch
    from transformers import PretrainedConfig

    from dflash_mp.config.schema import RootConfig


@dataclass(frozen=True)
class Shape:
    """A target (Qwen3- or Llama-shaped), the drafter over it, and the training sequence shape.

    The target is the plan's own ModelShape (dflash_mp.plan.costs), its `model_type` "qwen3"
    (Qwen3Config: q/k norms, RoPE theta 1e6) or "llama" (LlamaConfig: Llama 3's RoPE theta 500000,
    RMS eps 1e-5, no q/k norms; its base_model_tp_plan splits the target). The drafter is always a
    DFlash (Qwen3-style) stack whose layers copy the target's shape (hidden size, heads, MLP, RoPE):
    models.drafter_config.build_drafter_config reads them off the target's config, so a Llama-shaped
    target gets a drafter at its hidden size and RoPE theta.
    """

    target: ModelShape
    draft_layers: int
    seq_len: int
    num_anchors: int
    block_size: int
    matmul_n: int  # side of the square matmul that measures the peak

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def layer_ids(self) -> list[int]:
        return default_target_layer_ids(self.target.layers, self.draft_layers)

    def target_config(self) -> PretrainedConfig:
        from transformers import LlamaConfig, Qwen3Config

        t = self.target
        shared = dict(
            hidden_size=t.hidden,
            num_hidden_layers=t.layers,
            num_attention_heads=t.heads,
            num_key_value_heads=t.kv_heads,
            head_dim=t.head_dim,
            intermediate_size=t.intermediate,
            vocab_size=t.vocab,
            tie_word_embeddings=False,
            initializer_range=0.02,
            attn_implementation="sdpa",
        )
        if t.model_type == "llama":  # Llama 3's RoPE base and norm epsilon
            positions = max(8192, 2 * self.seq_len)
            return LlamaConfig(
                **shared, max_position_embeddings=positions, rope_theta=500000.0, rms_norm_eps=1e-5
            )
        return Qwen3Config(**shared, max_position_embeddings=max(40960, 2 * self.seq_len), rms_norm_eps=1e-6)

    def target_weight_bytes(self, itemsize: int, tensor_parallel: int = 1) -> int:
        """Bytes of the target one rank holds: the embedding and final norm (whole on every rank)
        and the layers run (to the last one the drafter reads), split over `tensor_parallel` ranks."""
        t = self.target
        h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
        qk_norms = 2 * t.head_dim if t.model_type == "qwen3" else 0
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * t.intermediate + 2 * h + qk_norms
        layers_run = max(self.layer_ids) + 1
        return itemsize * (t.vocab * h + h + layers_run * per_layer // tensor_parallel)

    def with_row(self, seq_len: int | None, num_anchors: int | None = None) -> Shape:
        """This shape with rows of `seq_len` tokens; the anchors scale with the row (512 per 3072
        tokens at qwen3-8b) unless `num_anchors` is given."""
        if seq_len is None:
            return self if num_anchors is None else replace(self, num_anchors=num_anchors)
        if num_anchors is None:
            num_anchors = max(1, round(self.num_anchors * seq_len / self.seq_len))
        return replace(self, seq_len=seq_len, num_anchors=num_anchors)

    def describe(self) -> dict:
        """The shape as the benchmark's JSON records it (flat: dflash_mp.plan.measured reads it)."""
        t = self.target
        d = dict(name=t.name, hidden=t.hidden, layers=t.layers, heads=t.heads, kv_heads=t.kv_heads)
        d |= dict(head_dim=t.head_dim, intermediate=t.intermediate, vocab=t.vocab)
        d |= dict(draft_layers=self.draft_layers, seq_len=self.seq_len, num_anchors=self.num_anchors)
        d |= dict(block_size=self.block_size, matmul_n=self.matmul_n, family=t.model_type)
        d["target_layer_ids"] = self.layer_ids
        d["target_layers_run"] = max(self.layer_ids) + 1
        d["query_tokens_per_seq"] = self.num_anchors * self.block_size
        return d


SHAPES = {
    # Qwen3-8B: 36 layers, hidden 4096, 32/8 heads of 128, MLP 12288; 5-layer DFlash drafter.
    "qwen3-8b": Shape(
        ModelShape(4096, 36, 32, 8, 128, 12288, 151936, name="qwen3-8b", model_type="qwen3"),
        5,
        3072,
        512,
        16,
        8192,
    ),
    # Qwen3-4B at SpecForge's shape (max 2048 tokens, 512 anchors), for ANCHORS.md's first row.
    "qwen3-4b": Shape(
        ModelShape(2560, 36, 32, 8, 128, 9728, 151936, name="qwen3-4b", model_type="qwen3"),
        5,
        2048,
        512,
        16,
        8192,
    ),
    # Llama-3-70B: 80 layers, hidden 8192, 64/8 heads of 128, MLP 28672, vocab 128256 (140 GB in
    # bf16: one TP replica over several GPUs); a 5-layer DFlash drafter at hidden 8192.
    "llama3-70b": Shape(
        ModelShape(8192, 80, 64, 8, 128, 28672, 128256, name="llama3-70b", model_type="llama"),
        5,
        3072,
        512,
        16,
        8192,
    ),
    # A very small version for CPU (what the test runs).
    "tiny": Shape(ModelShape(64, 6, 4, 2, 16, 192, 512, name="tiny", model_type="qwen3"), 2, 128, 16, 8, 256),
}


def bench_config(
    shape: Shape,
    device: torch.device,
    micro_batch: int,
    grad_accum: int,
    extra: list[str],
    targets: int = 1,
    drafters: int = 1,
    target_parallel: int = 1,
) -> RootConfig:
    """The composed conf/ with this benchmark's shape and layout; model.target_path is never read."""
    from dflash_mp.config.schema import compose_config, to_dataclass

    overrides = [
        "model.target_path=/nonexistent/dflash-bench-random-target",
        f"model.draft_layers={shape.draft_layers}",
        f"model.block_size={shape.block_size}",
        f"data.max_length={shape.seq_len}",
        f"data.num_anchors={shape.num_anchors}",
        f"topology.targets={targets}",
        f"topology.drafters={drafters}",
        f"topology.target_parallel={target_parallel}",
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


def predicted_memory(shape: Shape, cfg: RootConfig, drafters: int, world: int) -> dict:
    """dflash_mp.plan.memory's peaks for this run, to set beside the measured ones: a colocated rank
    (DDP over `world`), a target rank and a drafter rank (DDP over `drafters`). The benchmark's
    target replays no CUDA graphs."""
    from dflash_mp.config.dspark_checks import feature_layer_ids
    from dflash_mp.plan.memory import TrainingShape, colocated_rank, drafter_rank, target_rank
    from dflash_mp.plan.memory_check import drafter_head_fields

    m, t, tr = cfg.model, cfg.topology, cfg.train
    sent = feature_layer_ids(shape.layer_ids, shape.target.layers, m)  # a DSpark teacher's layer too
    common = TrainingShape(
        target=shape.target,
        target_layers_kept=max(sent) + 1,
        feature_layers=len(sent),
        draft_layers=shape.draft_layers,
        block_size=shape.block_size,
        seq_len=shape.seq_len,
        num_anchors=shape.num_anchors,
        micro_batch=tr.micro_batch_size,
        grad_accum=tr.grad_accum,
        drafters=drafters,
        activation_checkpointing=tr.activation_checkpointing,
        **drafter_head_fields(m),
        vocabulary_chunk_rows=tr.vocabulary_chunk_rows,
        teacher_layer=len(sent) > len(shape.layer_ids),
        target_parallel=t.target_parallel,
        max_inflight_sends=t.max_inflight_sends,
        cuda_graphs=False,
    )
    return {
        "colocated": colocated_rank(replace(common, drafters=world, target_parallel=1)).as_dict(),
        "target_rank": target_rank(common).as_dict(),
        "drafter_rank": drafter_rank(common).as_dict(),
    }
