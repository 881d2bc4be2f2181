"""An XPress drafter's export in speculators' format loads into speculators 0.9.0's XPressDraftModel:
its config through the reference's own config class, its weights with exactly the reference model's
parameter names and shapes, and the loaded refiner computes our refiner's bias."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from speculators_reference import speculators_module

from dflash_mp.export.speculators_format import export_speculators
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

TARGET = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 53,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
}
XPRESS = {"xpress_rank": 8, "xpress_mlp_ratio": 2, "num_jacobi_passes": 4}


def test_the_export_loads_into_the_reference_xpress_model(tmp_path):
    config = build_drafter_config(TARGET, 2, [1, 3], 4, 52, arch="xpress", xpress=XPRESS)
    drafter = DFlashDrafter(config, seed=3)
    with torch.no_grad():  # a mixer away from its zero init
        drafter.refiner_head.mix_l.normal_(generator=torch.Generator().manual_seed(0))
    # A local verifier: the reference's model reads its config (a hub name costs a network timeout).
    verifier = tmp_path / "target"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({**TARGET, "architectures": ["Qwen3ForCausalLM"]}))
    out = export_speculators(drafter, tmp_path / "xpress", str(verifier), ["Qwen3ForCausalLM"], torch.float32)

    xpress = speculators_module("models.xpress")
    speculators_module("config").reload_schemas()  # once the models are registered, as its __init__
    fields = json.loads((out / "config.json").read_text())
    reference_config = xpress.XPressSpeculatorConfig(**fields)
    assert (reference_config.xpress_rank, reference_config.num_jacobi_passes) == (8, 4)
    assert reference_config.aux_hidden_state_layer_ids == [2, 4]  # hidden-state indices
    assert reference_config.speculators_config.proposal_methods[0].speculative_tokens == 3
    model = xpress.XPressDraftModel(reference_config)

    weights = load_file(out / "model.safetensors")
    expected = {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if name not in model._keys_to_ignore_on_save  # the verifier's: embedding, heads, norm
    }
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    # What the reference takes from the verifier, and expects absent from a checkpoint.
    assert set(missing) == {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_norm.weight",
        "verifier_lm_head.weight",
    }
    assert set(missing) <= set(model._keys_to_ignore_on_load_missing)

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 32, generator=g)
    prev = torch.randint(0, 53, (3, 4), generator=g)
    ours = drafter.refiner_head.block_bias(prev, drafter.refiner_head.hidden_cache(hidden))
    torch.testing.assert_close(
        model.refiner_head.block_bias(prev, hidden_states=hidden), ours, rtol=0, atol=0
    )
