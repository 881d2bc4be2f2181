"""The token that fills the masked positions of every draft block, and its id.

Stock tokenizers (Qwen3's among them) have no mask token. Then it is added as the next free id,
`len(tokenizer)`: 151669 for Qwen3, the id the published Qwen3 DFlash drafters carry.
`model.mask_token_id` pins an id instead. The drafter looks the id up in the *target's* embedding
matrix, and the reference inference does the same, so the id must be below the target's
vocab_size (config.json), which may exceed len(tokenizer) (Qwen3: 151936 rows, 151669 tokens).

Training, evaluation and export all take the id from `resolve_mask_token`, and the run keeps the
tokenizer with the added token in RUN_DIR/tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class MaskTokenError(ValueError):
    """A mask token or id that cannot work with the target; the message says what to set."""


@dataclass(frozen=True)
class MaskToken:
    token: str
    id: int
    # Not in the target's tokenizer: the run's tokenizer gets it appended at `id`.
    added: bool


def target_vocab_size(target_path: str | Path) -> int:
    """Rows of the target's embedding and LM head, from its config.json."""
    config = json.loads((Path(target_path) / "config.json").read_text())
    config = config if "vocab_size" in config else config.get("text_config", {})
    if "vocab_size" not in config:
        raise MaskTokenError(f"{target_path}/config.json has no vocab_size: is it a causal LM directory?")
    return int(config["vocab_size"])


def _existing_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return int(token_id)


def resolve_mask_token(tokenizer: Any, token: str, pinned_id: int | None, vocab_size: int) -> MaskToken:
    """The mask token's id for this target: `pinned_id`, else the token's own id, else len(tokenizer).

    Raises MaskTokenError when the id is not a row of the target's embedding and LM head
    (>= `vocab_size`), or when a pinned id contradicts the tokenizer's own id for the token.
    """
    existing = _existing_id(tokenizer, token)
    if pinned_id is not None:
        if existing is not None and existing != pinned_id:
            raise MaskTokenError(
                f"model.mask_token_id={pinned_id}, but the target tokenizer has {token!r} at id {existing}: "
                f"drop model.mask_token_id or set it to {existing}"
            )
        mask = MaskToken(token, int(pinned_id), added=existing is None and pinned_id == len(tokenizer))
        source = "model.mask_token_id"
    elif existing is not None:
        mask, source = MaskToken(token, existing, added=False), f"the tokenizer's id of {token!r}"
    else:
        mask, source = MaskToken(token, len(tokenizer), added=True), f"{token!r} added as id len(tokenizer)"
    if not 0 <= mask.id < vocab_size:
        raise MaskTokenError(
            f"mask token id {mask.id} ({source}) is not covered by the target's embedding and LM head, "
            f"whose vocab_size is {vocab_size}: set model.mask_token_id to an unused id below {vocab_size}"
        )
    return mask


def target_mask_token(
    target_path: str | Path, token: str, pinned_id: int | None, trust_remote_code: bool = False
) -> MaskToken:
    """The resolved mask token of the target at `target_path`, from its shared tokenizer (what the
    checks, training and evaluation need: the id; only a written tokenizer needs the token added)."""
    from dflash_mp.data import load_tokenizer

    tokenizer = load_tokenizer(target_path, trust_remote_code=trust_remote_code)
    return resolve_mask_token(tokenizer, token, pinned_id, target_vocab_size(target_path))


def load_mask_token(
    target_path: str | Path, token: str, pinned_id: int | None, trust_remote_code: bool = False
) -> tuple[MaskToken, Any]:
    """(the resolved mask token, the target's tokenizer with the token added when it was missing).
    The added copy is a second read of the tokenizer (about a CPU-second for a 150k vocabulary)."""
    from dflash_mp.data import load_tokenizer
    from dflash_mp.data.chat import directory_stamp

    tokenizer = load_tokenizer(target_path, trust_remote_code=trust_remote_code)
    mask = resolve_mask_token(tokenizer, token, pinned_id, target_vocab_size(target_path))
    if mask.added:  # never into the shared tokenizer
        tokenizer = _with_added_token(
            str(target_path), trust_remote_code, token, mask.id, directory_stamp(target_path)
        )
    return mask, tokenizer


@functools.lru_cache(maxsize=4)
def _with_added_token(target_path: str, trust_remote_code: bool, token: str, mask_id: int, stamp) -> Any:
    """The target's tokenizer with `token` added as `mask_id`, read once per process (shared, like
    load_tokenizer's)."""
    from tokenizers import AddedToken

    from dflash_mp.data.chat import read_tokenizer

    tokenizer = read_tokenizer(target_path, trust_remote_code)
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=True)], special_tokens=True)
    if tokenizer.convert_tokens_to_ids(token) != mask_id:
        raise MaskTokenError(f"adding {token!r} to the tokenizer of {target_path} did not give id {mask_id}")
    return tokenizer


def mask_token_problems(model_cfg: Any, target_path: str | Path) -> list[str]:
    """Why `model_cfg`'s mask token cannot work with the target (loads its tokenizer), or nothing."""
    m = model_cfg
    if not any(Path(target_path).glob("tokenizer*")):
        return []  # no tokenizer at all: the doctor's target check says which files to copy
    try:
        target_mask_token(target_path, m.mask_token, m.mask_token_id, m.trust_remote_code)
    except MaskTokenError as e:
        return [f"model.mask_token_id: {e}"]
    except Exception as e:  # no or a broken tokenizer (the doctor's target check names the files)
        return [
            f"model.target_path={str(target_path)!r}: cannot load its tokenizer ({type(e).__name__}: {e})"
        ]
    return []


def mask_token_id(model_cfg: Any) -> int:
    """The mask id for `model_cfg` (a ModelConfig): what the drafter is built and exported with."""
    mask = target_mask_token(
        model_cfg.target_path, model_cfg.mask_token, model_cfg.mask_token_id, model_cfg.trust_remote_code
    )
    return mask.id


def save_run_tokenizer(model_cfg: Any, out_dir: str | Path) -> Path:
    """Write the target's tokenizer, with the mask token when it was added, to `out_dir` (once).

    Written beside and renamed into place, world-readable; an existing directory is kept (a
    resumed run keeps its tokenizer).
    """
    out_dir = Path(out_dir)
    if out_dir.is_dir():
        return out_dir
    _, tokenizer = load_mask_token(
        model_cfg.target_path, model_cfg.mask_token, model_cfg.mask_token_id, model_cfg.trust_remote_code
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(staging)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
