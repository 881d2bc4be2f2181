"""Families outside docs/TARGETS.md's table, as tiny random targets: what a user may bring.

Each is built with transformers' own classes from the shared fields of tests/target_families.py
(4 layers of width 32) and a few of its own where the defaults would not fit that width (MLA ranks,
Mamba state sizes, expert counts). The suite checks them in process (tests/test_other_families.py:
the target stage's features against HF's, the drafter config every reader builds); this module
trains each for two steps and loads its export in the reference, which is too long for the suite:

    python -m tests.other_families [NAME ...]   # a table: family, outcome, packed rows, export
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.target_families import ALTERNATING, COMMON, TOKENIZER_FILES

MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
ROUTED = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
CONV = ["conv", "full_attention"] * 2
NO_HEAD_DIM = dict(head_dim=None)  # families that derive it (hidden / heads) and take no field

# name: (config class, causal-LM class, fields over COMMON; None drops a COMMON field)
OTHER_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(NO_HEAD_DIM, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", NO_HEAD_DIM),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(NO_HEAD_DIM, **EXPERTS, shared_expert_intermediate_size=32),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(NO_HEAD_DIM, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", NO_HEAD_DIM),
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(NO_HEAD_DIM, num_local_experts=4, num_experts_per_tok=2),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8, final_logit_softcapping=30.0)),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=8, layer_types=ALTERNATING)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", NO_HEAD_DIM),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", NO_HEAD_DIM),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(NO_HEAD_DIM, num_experts=4, num_experts_per_tok=2)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            NO_HEAD_DIM,
            logits_scaling=4.0,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            attention_multiplier=0.1,
        ),
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(NO_HEAD_DIM, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            NO_HEAD_DIM,
            **MAMBA2,
            layer_types=["mamba", "attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", NO_HEAD_DIM),
    "glm": ("GlmConfig", "GlmForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(**MLA, **ROUTED)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(NO_HEAD_DIM, **MLA, **ROUTED)),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(**MLA, **ROUTED, index_n_heads=2, index_head_dim=16, index_topk=8),
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            **MLA,
            **EXPERTS,
            linear_attn_config={
                "kda_layers": [1, 3],
                "full_attn_layers": [2, 4],
                "num_heads": 4,
                "head_dim": 8,
                "short_conv_kernel_size": 4,
            },
        ),
    ),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", ROUTED),
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=8,
            layer_types=["linear_attention", "full_attention"] * 2,
        ),
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(num_experts=4, moe_topk=2)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(**EXPERTS, num_dense_layers=1)),
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
    ),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {}),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", {}),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),
    "doge": ("DogeConfig", "DogeForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", NO_HEAD_DIM),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(NO_HEAD_DIM, partial_rotary_factor=0.25)),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(NO_HEAD_DIM, new_decoder_architecture=True, num_kv_heads=2),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=4, n_head=4, n_positions=512)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=4, n_head=4)),
    # State-space and convolution hybrids; Jamba, Bamba and Falcon-H1 derive their layer types.
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(MAMBA2, mamba_d_ssm=64)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(MAMBA2, attn_layer_indices=[1, 3])),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
        ),
    ),
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            NO_HEAD_DIM,
            mamba_d_state=8,
            mamba_headdim=8,
            n_mamba_heads=8,
            layers_block_type=["mamba", "hybrid"] * 2,
            num_mem_blocks=1,
        ),
    ),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(num_heads=8, head_dim=8, state_size=8, n_groups=1, chunk_size=8),
    ),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=CONV)),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(**EXPERTS, layer_types=CONV, num_dense_layers=1),
    ),
}


def other_family_config(name: str, **overrides: Any) -> Any:
    import transformers

    config_class, _, fields = OTHER_FAMILIES[name]
    merged = {**COMMON, **fields, "dtype": "bfloat16", **overrides}
    return getattr(transformers, config_class)(
        **{key: value for key, value in merged.items() if value is not None}
    )


def build_other_family(name: str, out_dir: Path, **overrides: Any) -> Any:
    """Save a random target of family `name` (its config's fields over `overrides`) to `out_dir`;
    returns the model, in fp32."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, OTHER_FAMILIES[name][1])(other_family_config(name, **overrides)).eval()
    model.save_pretrained(out_dir)
    return model.float()


def _train_and_load(names: list[str], root: Path) -> None:
    from dflash.model import DFlashDraftModel

    from tests.conftest import run_tiny_colocated_sweep
    from tests.stock_qwen3 import ensure_stock_target

    stock = ensure_stock_target()
    for name in names:
        build_other_family(name, root / name)
        for file in TOKENIZER_FILES:
            shutil.copyfile(stock / file, root / name / file)
    targets = ",".join(str(root / name) for name in names)
    sweep, _ = run_tiny_colocated_sweep(
        root, f"model.target_path={targets}", "model.target_layer_ids=[1,3]", timeout=60 * len(names)
    )
    for index, name in enumerate(names):
        point = json.loads((sweep / "points" / f"{index}.json").read_text())
        run = Path(point["run_dir"])
        log = (run / "logs" / "job.log").read_text() if (run / "logs" / "job.log").exists() else ""
        packed = next(
            (line.split("packed rows: ")[1][:60] for line in log.splitlines() if "packed rows: " in line), "-"
        )
        loaded = "-"
        if point["outcome"] == "succeeded":
            _, info = DFlashDraftModel.from_pretrained(str(run / "export"), output_loading_info=True)
            loaded = "strict" if not any(info.values()) else str({k: v for k, v in info.items() if v})
        print(f"{name:18} {point['outcome']:10} {loaded:8} {packed}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        _train_and_load(sys.argv[1:] or list(OTHER_FAMILIES), Path(scratch))
