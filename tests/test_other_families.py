"""Families outside docs/TARGETS.md's table (tests/other_families.py), in process: the target
stage finds each one's decoder and cuts it to the layers read, its features are HF's
`output_hidden_states`, and the drafter config it gives builds in the reference and in ours alike.
Training and the export (two steps each, about 4 s a family): `python -m tests.other_families`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from tests.other_families import OTHER_FAMILIES, build_other_family

VOCAB = 256  # small: no tokenizer is needed in process
TOKENS = torch.arange(3, 27).reshape(1, 24) * 7 % VOCAB


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_another_family_gives_hf_features_and_a_drafter_every_reader_builds(
    name: str, tmp_path: Path
) -> None:
    small = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = build_other_family(name, tmp_path, **small)
    extractor = TargetFeatureExtractor(tmp_path, [1, 2], torch.float32, "cpu")
    assert len(extractor.layers) == 3  # the fourth is never built
    with torch.no_grad():
        hidden_states = model(input_ids=TOKENS, output_hidden_states=True).hidden_states
        features = extractor(TOKENS)
    torch.testing.assert_close(
        features, torch.cat([hidden_states[2], hidden_states[3]], dim=-1), rtol=0, atol=0
    )
    config = build_drafter_config(model.config, draft_layers=1, target_layer_ids=[1, 2], block_size=4,
                                  mask_token_id=VOCAB - 1)  # fmt: skip
    assert config.hidden_act == "silu" and config.hidden_size == 32
    assert DFlashDrafter(config).state_dict().keys() == DFlashDraftModel(config).state_dict().keys() - {
        "rotary_emb.inv_freq"
    }
