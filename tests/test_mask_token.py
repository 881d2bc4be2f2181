"""The mask token on a stock target: added as the next free id, pinnable, refused when out of range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_mp.config.mask_token import (
    MaskTokenError,
    load_mask_token,
    resolve_mask_token,
    save_run_tokenizer,
)
from dflash_mp.config.schema import ConfigError, compose_config, run_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.embedded import embedded_path
from dflash_mp.launch.doctor import check_config
from dflash_mp.training.recipe import build_drafter

QWEN3_MASK_ID = 151669  # len(Qwen3's tokenizer), the id of the published Qwen3 DFlash drafters


def _cfg(target: Path, *overrides: str):
    return to_dataclass(
        compose_config(
            [
                # A real target: experiment=custom, shrunk to the tiny stock target and the bundled data.
                "experiment=custom",
                f"model.target_path={target}",
                "model.draft_layers=2",
                "model.block_size=8",
                "model.target_layer_ids=[1,2]",
                "topology=2t1d",
                f"data.train_files=[{embedded_path('data/train.jsonl')}]",
                "eval.every=0",
                *overrides,
            ]
        )
    )


def test_a_stock_qwen3_target_gets_mask_id_151669_and_the_drafter_builds(stock_qwen3_target: Path) -> None:
    mask, tokenizer = load_mask_token(stock_qwen3_target, "<|MASK|>", None)
    assert (mask.id, mask.added) == (QWEN3_MASK_ID, True)
    assert tokenizer.convert_tokens_to_ids("<|MASK|>") == QWEN3_MASK_ID
    assert tokenizer.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    cfg = _cfg(stock_qwen3_target)
    validate(cfg, world_size=3)
    assert build_drafter(cfg).mask_token_id == QWEN3_MASK_ID  # the old code died here


def test_a_pinned_id_is_used_and_written_into_the_run_config(stock_qwen3_target: Path) -> None:
    cfg = _cfg(stock_qwen3_target, "model.mask_token_id=151900")
    validate(cfg, world_size=3)
    assert build_drafter(cfg).mask_token_id == 151900
    assert run_config(cfg).model.mask_token_id == 151900
    unpinned = run_config(_cfg(stock_qwen3_target, "train.gamma=null"))
    assert unpinned.model.mask_token_id == QWEN3_MASK_ID
    assert unpinned.train.gamma == 4.0  # block 8


def test_an_id_outside_the_embedding_is_refused_before_any_work_naming_both_numbers(
    stock_qwen3_target: Path, tmp_path: Path
) -> None:
    cfg = _cfg(stock_qwen3_target, "model.mask_token_id=151936")
    with pytest.raises(ConfigError, match="mask token id 151936 .*vocab_size is 151936"):
        validate(cfg, world_size=3)
    failed = [c for c in check_config(cfg, world_size=3) if not c.ok]
    assert len(failed) == 1 and "151936" in failed[0].message
    # A target whose embedding has no spare row: the next free id does not fit either.
    full = tmp_path / "full"
    shutil.copytree(stock_qwen3_target, full)
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "vocab_size": QWEN3_MASK_ID}))
    with pytest.raises(ConfigError, match=f"mask token id {QWEN3_MASK_ID} .*vocab_size is {QWEN3_MASK_ID}"):
        validate(_cfg(full), world_size=3)


def test_the_tokenizers_own_mask_token_wins_and_a_contradicting_pin_is_refused() -> None:
    cfg = to_dataclass(compose_config([]))  # the embedded target has <|MASK|> at id 3
    mask, _ = load_mask_token(cfg.model.target_path, "<|MASK|>", None)
    assert (mask.id, mask.added) == (3, False)
    with pytest.raises(ConfigError, match="has '<\\|MASK\\|>' at id 3"):
        validate(to_dataclass(compose_config(["model.mask_token_id=5"])), world_size=3)


def test_resolution_rules_without_a_target() -> None:
    class Tokenizer:
        unk_token, unk_token_id = None, None

        def __len__(self) -> int:
            return 10

        def convert_tokens_to_ids(self, token: str) -> int | None:
            return {"<m>": 4}.get(token)

    assert resolve_mask_token(Tokenizer(), "<m>", None, 16).id == 4
    assert resolve_mask_token(Tokenizer(), "<new>", None, 16) == resolve_mask_token(
        Tokenizer(), "<new>", 10, 16
    )
    assert not resolve_mask_token(Tokenizer(), "<new>", 12, 16).added  # no token at 12: the id is used as is
    with pytest.raises(MaskTokenError, match="below 10"):
        resolve_mask_token(Tokenizer(), "<new>", None, 10)


def test_the_run_tokenizer_keeps_the_added_token_and_is_world_readable(
    stock_qwen3_target: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    out = save_run_tokenizer(_cfg(stock_qwen3_target).model, tmp_path / "run" / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("<|MASK|>") == QWEN3_MASK_ID
    assert len(tokenizer) == QWEN3_MASK_ID + 1
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())


def test_a_tokenizer_is_read_once_shared_untouched_and_read_again_when_its_files_change(
    stock_qwen3_target: Path, tmp_path: Path
) -> None:
    """load_tokenizer shares one object per directory's contents; the mask token goes into a copy."""
    from dflash_mp.data import load_tokenizer

    target = tmp_path / "target"
    shutil.copytree(stock_qwen3_target, target)
    shared = load_tokenizer(target)
    assert load_tokenizer(target) is shared
    mask, with_mask = load_mask_token(target, "<|MASK|>", None)
    assert mask.added and with_mask is not shared
    assert load_mask_token(target, "<|MASK|>", None)[1] is with_mask
    assert len(with_mask) == QWEN3_MASK_ID + 1 and len(shared) == QWEN3_MASK_ID  # the shared one untouched
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": 77}))
    changed = load_tokenizer(target)
    assert changed is not shared and changed.model_max_length == 77


def test_the_checks_and_the_drafter_read_the_tokenizer_once(
    stock_qwen3_target: Path, tmp_path: Path, monkeypatch
) -> None:
    """The id needs only the shared tokenizer: the copy with the token added (a second read, about a
    CPU-second in every process) is made only where a tokenizer is written (RUN_DIR/tokenizer)."""
    from dflash_mp.data import chat

    target = tmp_path / "target"
    shutil.copytree(stock_qwen3_target, target)  # a directory no earlier test read
    reads: list[str] = []
    real_read = chat.read_tokenizer
    monkeypatch.setattr(
        chat, "read_tokenizer", lambda path, *a: reads.append(str(path)) or real_read(path, *a)
    )
    cfg = _cfg(target)
    validate(cfg)
    assert build_drafter(cfg).mask_token_id == QWEN3_MASK_ID
    assert run_config(cfg).model.mask_token_id == QWEN3_MASK_ID
    assert reads == [str(target)]
    save_run_tokenizer(cfg.model, tmp_path / "run" / "tokenizer")
    assert reads == [str(target)] * 2  # the written one has the token added
