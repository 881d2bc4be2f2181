"""An export loads through `AutoModel.from_pretrained(dir, trust_remote_code=True)`, as the published
drafters do, into our own modelling file, and computes what the reference `dflash` package computes
from the same export; its config.json carries what SGLang and vLLM key on
(docs/evaluation-and-serving.md: Serve it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash import model as reference
from transformers import AutoConfig, AutoModel, Qwen3Config

from dflash_mp.export.hf import MODELING_NAME, export_drafter, vllm_path_note
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

HIDDEN, VOCAB, BLOCK = 64, 300, 4
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}
VARIANTS = {
    "dflash": {},
    "dflash2": {"arch": "dflash2", "dflash2": DFLASH2},
    # Sliding layers (window smaller than the context) and logit scaling: the config-driven paths.
    "dflash2-sliding-scaled": {
        "arch": "dflash2",
        "dflash2": DFLASH2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 5,
        "scaling": {"output_multiplier": 0.6, "final_logit_softcapping": 1.5},
    },
}


def _export(tmp_path: Path, variant: str) -> tuple[Path, str]:
    """A drafter with every parameter random (DFlash 2 starts as identity convs and a zero codebook,
    which would hide them), exported in fp32."""
    config = build_drafter_config(
        TARGET, 2, [1, 3], block_size=BLOCK, mask_token_id=VOCAB - 1, **VARIANTS[variant]
    )
    drafter = DFlashDrafter(config, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return export_drafter(drafter, tmp_path / f"{variant}-export", dtype=None), config.architectures[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_automodel_matches_the_reference(tmp_path: Path, variant: str) -> None:
    out, architecture = _export(tmp_path, variant)
    ours, info = AutoModel.from_pretrained(
        out, trust_remote_code=True, local_files_only=True, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # The class came from the export's own file, not from an installed package.
    assert type(ours).__name__ == architecture
    assert Path(type(ours).__module__.replace(".", "/")).name == Path(MODELING_NAME).stem
    reference_class = getattr(reference, architecture)
    theirs, info = reference_class.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours.eval(), theirs.eval()
    assert (ours.block_size, ours.mask_token_id, ours.target_layer_ids) == (
        theirs.block_size,
        theirs.mask_token_id,
        theirs.target_layer_ids,
    )

    generator = torch.Generator().manual_seed(2)
    context_len = 9
    inputs = {
        "target_hidden": torch.randn(2, context_len, 2 * HIDDEN, generator=generator),
        "noise_embedding": torch.randn(2, BLOCK, HIDDEN, generator=generator),
        "position_ids": torch.arange(context_len + BLOCK).expand(2, -1),
    }
    with torch.no_grad():
        expected, got = theirs(**inputs), ours(**inputs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        torch.testing.assert_close(
            ours.compute_logits(got, head), theirs.compute_logits(expected, head), atol=1e-5, rtol=1e-5
        )
        if architecture == "DFlash2DraftModel":
            anchors = torch.tensor([7, 11])
            tokens, candidates, _ = ours.propose(got[:, 1:], anchors, head, 0.0)
            expected_tokens, expected_candidates, _ = theirs.propose(expected[:, 1:], anchors, head, 0.0)
            assert torch.equal(tokens, expected_tokens) and torch.equal(candidates, expected_candidates)


def test_config_carries_what_the_engines_key_on(tmp_path: Path) -> None:
    """SGLang picks the model class by `architectures` (models/dflash.py EntryClass) and reads
    block_size for its default number of draft tokens; vLLM maps `architectures` in its registry
    and reads `is_causal`; transformers reads `model_type` and `auto_map`."""
    for variant, architecture in (("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")):
        out, _ = _export(tmp_path, variant)
        written = json.loads((out / "config.json").read_text())
        assert written["architectures"] == [architecture]
        assert written["auto_map"] == {"AutoModel": f"modeling_dflash.{architecture}"}
        assert written["model_type"] == "qwen3" and written["is_causal"] is False
        assert written["block_size"] == written["dflash_config"]["block_size"] == BLOCK
        config = AutoConfig.from_pretrained(out, trust_remote_code=True, local_files_only=True)
        assert type(config) is Qwen3Config and config.dflash_config["target_layer_ids"] == [1, 3]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", MODELING_NAME]
    source = (out / MODELING_NAME).read_text()
    imported = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from ")) and not line.startswith("from __future__")
    }
    assert imported == {"torch", "transformers"}


@pytest.mark.parametrize("variant", ["dflash", "dflash2-sliding-scaled"])
def test_automodel_with_a_kv_cache_matches_the_reference(tmp_path: Path, variant: str) -> None:
    """Decoding keeps the context's K/V in a cache across blocks (the reference's loop: draft a
    block, crop the cache back to the block start, feed the accepted tokens' features next)."""
    out, architecture = _export(tmp_path, variant)
    ours = AutoModel.from_pretrained(out, trust_remote_code=True, local_files_only=True, dtype=torch.float32)
    theirs = getattr(reference, architecture).from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(1, 12, 2 * HIDDEN, generator=generator)
    blocks = torch.randn(2, 1, BLOCK, HIDDEN, generator=generator)
    outputs = []
    for model in (ours.eval(), theirs.eval()):
        cache, steps = reference._make_cache(model.config), []
        with torch.no_grad():
            # Block one at positions 9..12 over context 0..8; block two at 11..14 once 9..10 are accepted.
            for (start, end), block in zip(((0, 9), (9, 11)), blocks, strict=True):
                steps.append(
                    model(
                        target_hidden=features[:, start:end],
                        noise_embedding=block,
                        position_ids=torch.arange(start, end + BLOCK)[None],
                        past_key_values=cache,
                        use_cache=True,
                    )
                )
                reference._crop_to(cache, end)
        outputs.append(steps)
    for got, expected in zip(*outputs, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_path_without_dflash_gets_the_vllm_note() -> None:
    assert vllm_path_note("/models/Qwen3-8B-DFlash") is None
    assert vllm_path_note("runs/dflash-x/export") is None
    note = vllm_path_note("runs/x/export")
    assert note is not None and '"method": "dflash"' in note and "runs/x/export" in note
