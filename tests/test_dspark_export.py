"""A DSpark drafter's export: speculators' format, which vLLM serves, checked against speculators 0.9.0.

The config.json must parse as speculators' `DSparkSpeculatorConfig` with our fields, the weights must
be exactly the tensors speculators' `DSparkDraftModel` saves (its state dict without the keys it
leaves out of a full-vocabulary checkpoint) and load into it with strict key and shape checks, and
the loaded reference must compute our Markov bias and confidence logits. The export also reads back
into our drafter unchanged (eval of an export). Its `verifier` is the run's target, as the XPress
export's.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash_mp.export import cli
from dflash_mp.export.hf import CONFIG_NAME, WEIGHTS_NAME, export_drafter, load_exported_drafter
from dflash_mp.export.speculators_format import run_verifier
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.runtime.job import finish
from tests.speculators_reference import speculators_module

TARGET = Qwen3Config(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=256,
)


def _drafter(head_type: str) -> DFlashDrafter:
    fields = {"markov_rank": 8, "markov_head_type": head_type}
    config = build_drafter_config(
        TARGET, 2, [1, 3], block_size=4, mask_token_id=299, arch="dspark", dspark=fields
    )
    drafter = DFlashDrafter(config, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return drafter.eval()


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_export_loads_strictly_into_the_speculators_dspark_model(tmp_path, head_type: str) -> None:
    core = speculators_module("models.dspark.core")
    drafter = _drafter(head_type)
    out = export_drafter(drafter, tmp_path / "export", dtype=None)
    config_json = json.loads((out / CONFIG_NAME).read_text())
    reference_config = core.DSparkSpeculatorConfig.from_dict(config_json)
    assert reference_config.markov_head_type == head_type and reference_config.sample_from_anchor
    assert (
        reference_config.speculators_config.proposal_methods[0].speculative_tokens == 4
    )  # sample_from_anchor
    assert reference_config.transformer_layer_config.num_hidden_layers == 2
    reference = core.DSparkDraftModel(reference_config)
    saved = load_file(out / WEIGHTS_NAME)
    expected = {
        name: param.shape
        for name, param in reference.state_dict().items()
        if not any(name.startswith(skip) for skip in reference._keys_to_ignore_on_save)
    }
    assert {name: tensor.shape for name, tensor in saved.items()} == expected
    missing, unexpected = reference.load_state_dict(saved, strict=False)
    assert not unexpected
    assert set(missing) <= set(reference._keys_to_ignore_on_load_missing), missing
    # The loaded reference heads compute ours.
    generator = torch.Generator().manual_seed(4)
    prev = torch.randint(0, 300, (3, 4), generator=generator)
    hidden = torch.randn(3, 4, 64, generator=generator)
    ours = drafter.markov_head
    torch.testing.assert_close(
        reference.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden),
        ours.bias(ours.features(ours.embed(prev), hidden)),
    )
    prev_emb = ours.embed(prev)
    torch.testing.assert_close(
        reference.confidence_head(torch.cat([hidden, prev_emb], dim=-1)),
        drafter.confidence_head(hidden, prev_emb),
    )
    # Our eval reads the export back as the same drafter.
    loaded = load_exported_drafter(out)
    assert loaded.arch == "dspark" and loaded.markov_head.head_type == head_type
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_scaled_target_is_refused_by_the_speculators_export(tmp_path) -> None:
    config = build_drafter_config(
        TARGET, 1, [2], block_size=4, mask_token_id=299, arch="dspark", scaling={"output_multiplier": 0.5}
    )
    with pytest.raises(ValueError, match="output_multiplier"):
        export_drafter(DFlashDrafter(config), tmp_path / "export")
    assert not (tmp_path / "export").exists()


def _run_dir(tmp_path):
    """A run directory whose config.yaml names a target directory with its config.json."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"model:\n  target_path: {target}\n")
    return run_dir, {"name_or_path": str(target), "architectures": ["Qwen3ForCausalLM"]}


def _verifier_of(export_dir):
    core = speculators_module("models.dspark.core")
    config_json = json.loads((export_dir / CONFIG_NAME).read_text())
    verifier = core.DSparkSpeculatorConfig.from_dict(config_json).speculators_config.verifier
    assert verifier.name_or_path == config_json["speculators_config"]["verifier"]["name_or_path"]
    return config_json["speculators_config"]["verifier"]


def test_the_export_names_the_run_target_as_its_verifier(tmp_path, monkeypatch) -> None:
    """As the XPress export does (speculators_format.run_verifier): the CLI's and the job's export."""
    run_dir, expected = _run_dir(tmp_path)
    assert run_verifier(run_dir) == expected
    drafter = _drafter("vanilla")
    monkeypatch.setattr(cli, "drafter_from_checkpoint", lambda *args, **kwargs: drafter)
    assert cli.main([str(run_dir), "--dtype", "float32"]) == 0
    assert _verifier_of(run_dir / "export") == expected
    cfg = SimpleNamespace(
        logger=SimpleNamespace(plots=False),
        train=SimpleNamespace(export=True),
        model=SimpleNamespace(target_path=expected["name_or_path"]),
    )
    (run_dir / "export" / CONFIG_NAME).unlink()
    finish(cfg, run_dir, SimpleNamespace(drafter=drafter, step=0))
    assert _verifier_of(run_dir / "export") == expected
