"""Drafter export: bitwise round trip, config fields, and a crash mid-export keeps the old export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash_mp.export import hf as export
from dflash_mp.export.hf import export_drafter, load_exported_drafter
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

TARGET = Qwen3Config(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=100,
)


def _drafter(seed: int) -> DFlashDrafter:
    config = build_drafter_config(TARGET, 1, [0, 2], block_size=4, mask_token_id=99)
    return DFlashDrafter(config, seed=seed)


def _assert_same_weights(loaded: DFlashDrafter, expected: dict[str, torch.Tensor]) -> None:
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype
        assert torch.equal(state[name], tensor), name


def test_same_seed_same_weights() -> None:
    first, second, other = _drafter(0).state_dict(), _drafter(0).state_dict(), _drafter(1).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["fc.weight"], other["fc.weight"])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path: Path, dtype: torch.dtype | None) -> None:
    drafter = _drafter(0)
    out_dir = export_drafter(drafter, tmp_path / "export", dtype=dtype)
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "config.json",
        "model.safetensors",
        "modeling_dflash.py",
    ]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_target_layers"] == TARGET.num_hidden_layers
    assert config["dflash_config"] == {"target_layer_ids": [0, 2], "block_size": 4, "mask_token_id": 99}
    assert config["dtype"] == config["torch_dtype"] == ("float32" if dtype is None else "bfloat16")

    loaded = load_exported_drafter(out_dir)
    expected = {name: t.to(dtype or t.dtype) for name, t in drafter.state_dict().items()}
    _assert_same_weights(loaded, expected)
    assert (loaded.target_layer_ids, loaded.block_size, loaded.mask_token_id) == ([0, 2], 4, 99)


def test_crash_mid_export_keeps_previous_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out_dir = tmp_path / "export"
    old = _drafter(0)
    export_drafter(old, out_dir, dtype=None)

    def crash_while_writing(tensors: dict, path: Path, metadata: dict) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", crash_while_writing)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(_drafter(1), out_dir, dtype=None)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging directory left behind
    _assert_same_weights(load_exported_drafter(out_dir), old.state_dict())

    monkeypatch.undo()
    new = _drafter(2)
    export_drafter(new, out_dir, dtype=None)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    _assert_same_weights(load_exported_drafter(out_dir), new.state_dict())


def test_config_serves_every_reader(tmp_path: Path) -> None:
    """Top-level DFlash fields (z-lab/dflash reads block_size only there), transformers-4 RoPE keys,
    an explicit non-causal flag; the reference package loads it as such."""
    from dflash import model as reference

    target = Qwen3Config(**{**TARGET.to_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    config = build_drafter_config(target, 1, [0, 2], block_size=4, mask_token_id=99)
    out_dir = export_drafter(DFlashDrafter(config), tmp_path / "export")
    written = json.loads((out_dir / "config.json").read_text())
    assert (written["block_size"], written["mask_token_id"], written["target_layer_ids"]) == (4, 99, [0, 2])
    assert written["rope_theta"] == target.rope_parameters["rope_theta"]
    assert written["rope_scaling"]["rope_type"] == "yarn" and written["rope_scaling"]["factor"] == 4.0
    assert written["is_causal"] is False
    loaded = reference.DFlashDraftModel.from_pretrained(str(out_dir))
    assert (loaded.block_size, loaded.mask_token_id) == (4, 99)
    assert not loaded.layers[0].self_attn.is_causal
    plain = json.loads((export_drafter(_drafter(0), tmp_path / "plain") / "config.json").read_text())
    assert plain["rope_scaling"] is None and plain["rope_theta"] == TARGET.rope_parameters["rope_theta"]


def test_export_is_readable_by_other_users_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        out_dir = export_drafter(_drafter(0), tmp_path / "export")
    finally:
        os.umask(previous)
    assert out_dir.stat().st_mode & 0o777 == 0o755
    assert sorted(p.stat().st_mode & 0o777 for p in out_dir.iterdir()) == [0o644] * 3
