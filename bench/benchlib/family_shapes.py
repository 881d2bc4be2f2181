"""Target shapes of the families users train drafters for (hybrid, MoE, sinks), for
bench/target_families.py: the text model's config at the published checkpoint's numbers.

Sources (the checkpoints' config.json / model cards on the Hugging Face hub):
- Qwen3.5-9B: 32 layers (3 gated-deltanet : 1 gated-attention), hidden 4096, attention 16 Q / 4 KV
  heads of 256, linear attention 16 QK / 32 V heads of 128, MLP 12288, vocab 248320 (also
  transformers' Qwen3_5TextConfig defaults).
- Qwen3.5-27B: 64 layers, hidden 5120, attention 24 Q / 4 KV heads of 256, linear attention
  16 QK / 48 V heads of 128, MLP 17408, vocab 248320.
- Qwen3-30B-A3B: 48 layers, hidden 2048, 32 Q / 4 KV heads of 128, 128 experts, top 8, expert
  MLP 768, vocab 151936.
- Qwen3.5-35B-A3B: 40 layers, hidden 2048, attention 16 Q / 2 KV heads of 256, linear attention
  16 QK / 32 V heads of 128, 256 experts, top 8 + 1 shared expert, expert MLP 512 (shared 512),
  vocab 248320 (also transformers' Qwen3_5MoeTextConfig defaults).
- gpt-oss-20b: 24 layers alternating sliding (window 128) and full attention with sinks, hidden
  2880, 64 Q / 8 KV heads of 64, 32 experts, top 4, expert MLP 2880, vocab 201088, YaRN RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dflash_mp.config.schema import default_target_layer_ids


@dataclass(frozen=True)
class FamilyShape:
    """A target of one family at a checkpoint's shape; the drafter reads `layer_ids`."""

    name: str
    model_type: str  # transformers' text-model type
    fields: dict = field(default_factory=dict)  # the config's numbers (the rest: transformers' defaults)
    seq_len: int = 3072
    draft_layers: int = 5

    def config(self) -> PretrainedConfig:
        positions = max(8192, 2 * self.seq_len)
        return CONFIG_MAPPING[self.model_type](
            max_position_embeddings=positions, tie_word_embeddings=False, **self.fields
        )

    @property
    def layer_ids(self) -> list[int]:
        return default_target_layer_ids(self.fields["num_hidden_layers"], self.draft_layers)


def _qwen3_5(layers: int, hidden: int, heads: int, kv_heads: int, value_heads: int, mlp: int) -> dict:
    return dict(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, intermediate_size=mlp, vocab_size=248320,
    )  # fmt: skip


FAMILY_SHAPES = {
    s.name: s
    for s in [
        FamilyShape("qwen3.5-9b", "qwen3_5_text", _qwen3_5(32, 4096, 16, 4, 32, 12288)),
        FamilyShape("qwen3.5-27b", "qwen3_5_text", _qwen3_5(64, 5120, 24, 4, 48, 17408)),
        FamilyShape(
            "qwen3-30b-a3b",
            "qwen3_moe",
            dict(
                num_hidden_layers=48,
                hidden_size=2048,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                vocab_size=151936,
            ),
        ),  # fmt: skip
        FamilyShape(
            "qwen3.5-35b-a3b",
            "qwen3_5_moe_text",
            dict(
                num_hidden_layers=40,
                hidden_size=2048,
                num_attention_heads=16,
                num_key_value_heads=2,
                head_dim=256,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
                num_experts=256,
                num_experts_per_tok=8,
                vocab_size=248320,
            ),
        ),  # fmt: skip
        FamilyShape(
            "gpt-oss-20b",
            "gpt_oss",
            dict(
                num_hidden_layers=24,
                hidden_size=2880,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                intermediate_size=2880,
                num_local_experts=32,
                num_experts_per_tok=4,
                sliding_window=128,
                vocab_size=201088,
            ),
        ),  # fmt: skip
        # Tiny versions of two families for CPU (what the test runs).
        FamilyShape(
            "tiny-qwen3.5-moe",
            "qwen3_5_moe_text",
            dict(
                num_hidden_layers=4,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                vocab_size=128,
            ),
            seq_len=48,
            draft_layers=2,
        ),  # fmt: skip
        FamilyShape(
            "tiny-gpt-oss",
            "gpt_oss",
            dict(
                num_hidden_layers=4,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                vocab_size=128,
            ),
            seq_len=48,
            draft_layers=2,
        ),  # fmt: skip
    ]
}
