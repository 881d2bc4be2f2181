"""Families outside docs/TARGETS.md's table (tests/other_families.py), in process: the target
stage finds each one's decoder and cuts it to the layers read, its features are HF's
`output_hidden_states`, each document of a packed row gets the features it gets alone, and the
drafter config it gives builds in the reference and in ours alike. Training and the export (two
steps each, about 4 s a family): `python -m tests.other_families`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from tests.other_families import OTHER_FAMILIES, build_other_family
from tests.test_packed_target import TOLERANCE, _packed_batch, _worst_document_error

VOCAB = 256  # small: no tokenizer is needed in process
LENGTH_DEPENDENT = {"deepseek_v32"}
# State-space, convolution and linear-attention mixers the target does not reset at a document, and
# BLOOM, which takes no position_ids: their packed rows run one row per document.
ONE_ROW_PER_DOCUMENT = {"bamba", "bloom", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm2",
                        "lfm2_moe", "mamba2", "minimax", "zamba2"}  # fmt: skip
TOKENS = torch.arange(3, 27).reshape(1, 24) * 7 % VOCAB


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_another_family_gives_hf_features_packed_documents_alone_and_a_drafter(
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
    # Packed rows: every document's features are its own, on whichever path the structure picks.
    # Not DeepSeek-V3.2's: its indexer's top-k breaks ties (ReLU's zeros) by where a key sits in
    # the whole row, so even a document alone changes with the length it is padded to.
    if name not in LENGTH_DEPENDENT:
        ids, document_ids = _packed_batch(vocab=VOCAB)
        assert _worst_document_error(extractor, ids, extractor(ids, document_ids)) < TOLERANCE
        assert extractor.packing.in_rows == (name not in ONE_ROW_PER_DOCUMENT), extractor.packing.describe()
    config = build_drafter_config(model.config, draft_layers=1, target_layer_ids=[1, 2], block_size=4,
                                  mask_token_id=VOCAB - 1)  # fmt: skip
    assert config.hidden_act == "silu" and config.hidden_size == 32
    assert DFlashDrafter(config).state_dict().keys() == DFlashDraftModel(config).state_dict().keys() - {
        "rotary_emb.inv_freq"
    }
