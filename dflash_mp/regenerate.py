"""Regenerate a chat data set's assistant turns with the target itself (the DFlash recipe, §3).

A drafter learns to predict what the target would say; training it on human-written or
another model's answers teaches it a different distribution. This keeps every record's
system and user turns and replaces each assistant turn by the target's own response to the
conversation so far (greedy, or sampled with --temperature), turn after turn.

    python -m dflash_mp.regenerate --input data/train.jsonl --output data/train_regen.jsonl \\
        --target /models/qwen3-8b [--max-length 3072] [--temperature 0] [--batch-size 16]
    torchrun --nproc-per-node 8 -m dflash_mp.regenerate --input ... --output ... --target ...

Ranks split the records by index (rank r takes records i with i % world == r; --rank and
--world-size also allow independent jobs, e.g. a Slurm array). Each rank appends its results
to OUTPUT.parts/part-RRRRR.jsonl keyed by record index, so a killed job rerun with the same
arguments, at any world size, skips what is written. Whichever rank finds every record done
merges the parts into OUTPUT in record order (atomically); the parts stay for provenance.

The embedded default's training set, dflash_mp/assets/data/train_regenerated.jsonl, is the
bundled prompts answered by the tiny target (one process, so the batches and seeds are fixed):

    python -m dflash_mp.regenerate --input dflash_mp/assets/data/train.jsonl \\
        --output dflash_mp/assets/data/train_regenerated.jsonl --work-dir /tmp/regen-parts \\
        --max-length 128 --max-new-tokens 48 --temperature 0.3 --round-trip-safe --batch-size 64

Low-temperature samples rather than greedy answers: the random target's greedy continuation
hardly depends on the prompt, so greedy data would be one sequence repeated 2000 times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash_mp.regenerate")


class RegenerateError(ValueError):
    """Input the regeneration cannot run on; the message names the file:line or option and the fix."""


@dataclass
class Conversation:
    """One record being regenerated: what is written so far and the original turns still to come."""

    index: int
    source: str  # file:line, for messages
    done: list[dict[str, str]] = field(default_factory=list)
    rest: list[dict[str, str]] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)  # per regenerated turn
    finished: list[bool] = field(default_factory=list)  # per turn: ended with a stop token
    same_tokens: list[bool] = field(default_factory=list)  # per turn: text re-tokenizes to the same ids
    problem: str | None = None  # why the record cannot be regenerated

    def next_prompt(self) -> list[dict[str, str]] | None:
        """The conversation to answer next, or None when the record is complete."""
        while self.rest and self.rest[0]["role"] != "assistant":
            self.done.append(self.rest.pop(0))
        if self.rest or (self.done and self.done[-1]["role"] == "user"):
            return self.done
        return None

    def answer(self, text: str, num_tokens: int, finished: bool, same_tokens: bool) -> None:
        if self.rest:
            self.rest.pop(0)  # the original assistant turn this one replaces
        self.done.append({"role": "assistant", "content": text})
        self.response_tokens.append(num_tokens)
        self.finished.append(finished)
        self.same_tokens.append(same_tokens)

    def cut_before_last_prompt(self) -> None:
        """End the conversation after its last assistant turn (the next prompt does not fit)."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        self.rest = []


def parse_conversation(index: int, source: str, text: str) -> Conversation:
    """A record's messages, checked; ValueError says what is wrong."""
    from dflash_mp.eval import chat_messages

    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    messages = chat_messages(record)
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and (i == 0 or messages[i - 1]["role"] == "assistant"):
            raise ValueError(f"message {i} is an assistant turn with no prompt before it")
    if not any(m["role"] in ("user", "assistant") for m in messages):
        raise ValueError("no user or assistant turn to regenerate")
    return Conversation(index=index, source=source, rest=messages)


# ----------------------------------------------------------------------------------------
# parts: per-rank results keyed by record index


def part_path(work_dir: Path, rank: int) -> Path:
    return work_dir / f"part-{rank:05d}.jsonl"


def read_parts(work_dir: Path) -> dict[int, dict[str, Any]]:
    """Every result written so far, by record index; a line cut short by a kill is ignored."""
    results: dict[int, dict[str, Any]] = {}
    for path in sorted(work_dir.glob("part-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
                results[int(entry["index"])] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return results


def _open_part(path: Path) -> Any:
    """This rank's part file for appending, with any half-written last line (a kill) cut off."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open while the rank works


def merge(work_dir: Path, output: Path, num_records: int) -> dict[str, Any] | None:
    """Write OUTPUT from the parts if every record is done (None otherwise); returns the summary.

    Every merger writes the same bytes through its own temporary file and an atomic rename, so
    two ranks finishing at once cannot leave a mixed file.
    """
    results = read_parts(work_dir)
    if any(i not in results for i in range(num_records)):
        return None
    entries = [results[i] for i in range(num_records)]
    kept = [e for e in entries if "messages" in e]
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make a shared data set private
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": e["messages"]}) + "\n" for e in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    turns = [n for e in kept for n in e["response_tokens"]]
    return {
        "records": len(kept),
        "skipped": dict(Counter(e["skipped"] for e in entries if "skipped" in e)),
        "turns": len(turns),
        "mean_response_tokens": sum(turns) / max(len(turns), 1),
        "finished_fraction": sum(f for e in kept for f in e["finished"]) / max(len(turns), 1),
        "same_tokens_fraction": sum(s for e in kept for s in e["same_tokens"]) / max(len(turns), 1),
    }


# ----------------------------------------------------------------------------------------
# generation


@dataclass
class Settings:
    max_length: int  # longest record (prompt + responses), in tokens
    max_new_tokens: int  # longest single response
    temperature: float  # 0: greedy
    seed: int
    batch_size: int
    on_bad_record: str  # "fail" or "skip"
    # Generate only tokens whose text re-tokenizes to the same ids (see RoundTripSafe).
    round_trip_safe: bool = False

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r}: must be >= {low}"
            for name, value, low in (
                ("--max-length", self.max_length, 2),
                ("--max-new-tokens", self.max_new_tokens, 1),
                ("--batch-size", self.batch_size, 1),
                ("--temperature", self.temperature, 0.0),
            )
            if not value >= low
        ]
        if self.on_bad_record not in ("fail", "skip"):
            problems.append(f"--on-bad-record={self.on_bad_record!r}: must be 'fail' or 'skip'")
        if problems:
            raise RegenerateError("; ".join(problems))


class RoundTripSafe:
    """A logits processor that forbids a token when the text of (previous token, token) would not
    tokenize back into those two ids.

    Records are stored as text and tokenized again by the trainer, so a response is only the
    target's own token sequence if decode -> encode gives back the same ids. Real BPE tokenizers
    almost always do, and so does the embedded one (built to be invertible), except for special
    tokens that text cannot carry: those are what this blocks there. A tokenizer that merges
    across tokens (" bird" + "hill" -> " birdhill", one unknown word) would otherwise hand the
    drafter <unk> where the target wrote words. Pairs suffice for pre-tokenizers that split text on local patterns; the summary's
    same_tokens_fraction checks it. The allowed set is built per distinct previous token with one
    pass over the vocabulary, which suits small vocabularies only.
    """

    def __init__(self, tokenizer: Any, always_allowed: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.always_allowed = list(always_allowed)  # the stop tokens end the text, they join nothing
        self.special = set(tokenizer.all_special_ids)
        self._allowed: dict[int, Any] = {}

    def allowed_after(self, previous: int, vocab_size: int) -> Any:
        import torch

        if previous not in self._allowed:
            num_tokens = min(vocab_size, len(self.tokenizer))
            texts = [
                self.tokenizer.decode([previous, t], skip_special_tokens=True) for t in range(num_tokens)
            ]
            encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            kept = [] if previous in self.special else [previous]
            allowed = torch.zeros(vocab_size, dtype=torch.bool)  # ids past the tokenizer never decode
            allowed[:num_tokens] = torch.tensor([ids == [*kept, t] for t, ids in enumerate(encoded)])
            allowed[self.always_allowed] = True
            self._allowed[previous] = allowed
        return self._allowed[previous]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        allowed = torch.stack([self.allowed_after(int(t), scores.shape[-1]) for t in input_ids[:, -1]])
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))


def _template_tail(tokenizer: Any) -> int:
    """Tokens the chat template adds after an assistant content (e.g. <|im_end|> and a newline)."""
    user = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)
    whole = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": ""}], tokenize=True, return_dict=True
    )
    return max(len(whole["input_ids"]) - len(prompt["input_ids"]), 0)


def _generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    budgets: list[int],
    stops: list[int],
    settings: Settings,
    seed: int,
    round_trip: RoundTripSafe | None,
) -> list[list[int]]:
    """New tokens per prompt (at most its budget, ending at the first stop token), batched."""
    import torch

    device = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    width = max(map(len, prompts))
    # Left padding: every row's next token is at the same column.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = settings.temperature > 0
    if sampling:
        torch.manual_seed(seed)  # generate() samples from the global generator
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max(budgets),
        do_sample=sampling,
        temperature=settings.temperature if sampling else None,
        top_k=0 if sampling else None,
        top_p=1.0 if sampling else None,
        eos_token_id=stops,
        pad_token_id=pad,
        logits_processor=[round_trip] if round_trip is not None else None,
    )
    results = []
    for row, budget in zip(output[:, width:].tolist(), budgets, strict=True):
        row = row[:budget]
        stop_at = next((i for i, token in enumerate(row) if token in stops), None)
        results.append(row if stop_at is None else row[: stop_at + 1])
    return results


def regenerate_batch(
    conversations: list[Conversation], model: Any, tokenizer: Any, stops: list[int], settings: Settings
) -> None:
    """Answer every assistant turn of `conversations`, all records advancing one turn at a time."""
    tail = _template_tail(tokenizer)
    round_trip = RoundTripSafe(tokenizer, stops) if settings.round_trip_safe else None
    active = list(conversations)
    while active:
        prompts, budgets, asking = [], [], []
        for conversation in active:
            messages = conversation.next_prompt()
            if messages is None:
                continue
            ids = list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
            budget = min(settings.max_new_tokens, settings.max_length - len(ids) - tail)
            if budget < 1:
                if conversation.response_tokens:
                    conversation.cut_before_last_prompt()  # keep the turns that fit
                else:
                    conversation.problem = (
                        f"the prompt has {len(ids)} tokens: no room for a response within "
                        f"--max-length {settings.max_length}"
                    )
                continue
            prompts.append(ids)
            budgets.append(budget)
            asking.append(conversation)
        if not asking:
            return
        # Seeded by (seed, first record of the batch, turn): a rerun with the same batches draws the same.
        seed = _stable_seed(settings.seed, asking[0].index, len(asking[0].response_tokens))
        outputs = _generate(model, tokenizer, prompts, budgets, stops, settings, seed, round_trip)
        for conversation, new_tokens in zip(asking, outputs, strict=True):
            finished = bool(new_tokens) and new_tokens[-1] in stops
            content_ids = new_tokens[:-1] if finished else new_tokens
            text = tokenizer.decode(content_ids, skip_special_tokens=True)
            same = tokenizer(text, add_special_tokens=False)["input_ids"] == content_ids
            conversation.answer(text, len(new_tokens), finished, same)
        active = asking


def _stable_seed(*parts: int) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _batches(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def regenerate(
    inputs: Sequence[str | Path],
    output: str | Path,
    target_path: str | Path,
    settings: Settings,
    rank: int = 0,
    world_size: int = 1,
    work_dir: str | Path | None = None,
    limit: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> dict[str, Any] | None:
    """This rank's share of the records, then the merge if every rank is done (its summary; else None)."""
    from dflash_mp.data import DataError, JsonlIndex, load_tokenizer, tokenize_chat
    from dflash_mp.eval import load_target_model, resolve_device, stop_token_ids

    output = Path(output)
    work_dir = Path(work_dir) if work_dir is not None else output.with_name(output.name + ".parts")
    try:
        index = JsonlIndex(list(inputs))
    except DataError as e:
        raise RegenerateError(str(e)) from None
    num_records = len(index) if limit is None else min(limit, len(index))
    done = read_parts(work_dir)
    mine = [i for i in range(rank, num_records, world_size) if i not in done]
    log.info("rank %d/%d: %d of %d records to regenerate", rank, world_size, len(mine), num_records)
    if mine:
        torch_device, torch_dtype = resolve_device(device, dtype)
        tokenizer = load_tokenizer(target_path, trust_remote_code=trust_remote_code)
        model = load_target_model(target_path, torch_dtype, torch_device, trust_remote_code)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and settings.max_length > context:
            raise RegenerateError(
                f"--max-length {settings.max_length} exceeds the target's context of {context} positions"
            )
        stops = stop_token_ids(tokenizer, model)
        with _open_part(part_path(work_dir, rank)) as part:
            for batch in _batches(mine, settings.batch_size):
                conversations, entries = [], []
                for i in batch:
                    path, line, text = index.read(i)
                    try:
                        conversations.append(parse_conversation(i, f"{path}:{line}", text))
                    except ValueError as e:
                        entries.append(_bad(i, f"{path}:{line}", str(e), settings))
                regenerate_batch(conversations, model, tokenizer, stops, settings)
                for conversation in conversations:
                    if conversation.problem is None:
                        # The record must pass the trainer's own tokenization (length, loss mask).
                        try:
                            tokenize_chat(tokenizer, conversation.done, settings.max_length)
                        except ValueError as e:
                            conversation.problem = str(e)
                    if conversation.problem is not None:
                        entries.append(
                            _bad(conversation.index, conversation.source, conversation.problem, settings)
                        )
                        continue
                    entries.append(
                        {
                            "index": conversation.index,
                            "messages": conversation.done,
                            "response_tokens": conversation.response_tokens,
                            "finished": conversation.finished,
                            "same_tokens": conversation.same_tokens,
                        }
                    )
                part.writelines(json.dumps(e) + "\n" for e in sorted(entries, key=lambda e: e["index"]))
                part.flush()
                os.fsync(part.fileno())
    return merge(work_dir, output, num_records)


def _bad(index: int, source: str, reason: str, settings: Settings) -> dict[str, Any]:
    if settings.on_bad_record == "fail":
        raise RegenerateError(f"{source}: {reason} (pass --on-bad-record skip to skip such records)")
    log.warning("skipping %s: %s", source, reason)
    return {"index": index, "skipped": reason}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, help="chat JSONL files whose prompts are kept")
    parser.add_argument("--output", type=Path, required=True, help="the regenerated JSONL file")
    parser.add_argument("--target", help="local HF target directory (default: the embedded tiny target)")
    parser.add_argument("--work-dir", type=Path, help="per-rank parts (default: OUTPUT.parts)")
    parser.add_argument(
        "--max-length", type=int, default=3072, help="longest record in tokens (data.max_length)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="longest response in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--batch-size", type=int, default=16, help="records generated together per rank")
    parser.add_argument(
        "--round-trip-safe",
        action="store_true",
        help="generate only tokens whose text re-tokenizes to the same ids (small vocabularies, e.g. the embedded one)",
    )
    parser.add_argument("--limit", type=int, help="only the first N records")
    parser.add_argument(
        "--on-bad-record", default="fail", choices=("fail", "skip"), help="a record that cannot be used"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available), cuda or cpu")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="auto: bf16 on GPU"
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the target's own modelling code"
    )
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="default: $RANK")
    parser.add_argument(
        "--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="default: $WORLD_SIZE"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {args.rank}] %(message)s")
    from dflash_mp.embedded import embedded_path

    try:
        if not 0 <= args.rank < args.world_size:
            raise RegenerateError(f"--rank {args.rank} must be in [0, --world-size {args.world_size})")
        settings = Settings(
            max_length=args.max_length,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            batch_size=args.batch_size,
            on_bad_record=args.on_bad_record,
            round_trip_safe=args.round_trip_safe,
        )
        summary = regenerate(
            args.input,
            args.output,
            args.target or embedded_path("target"),
            settings,
            rank=args.rank,
            world_size=args.world_size,
            work_dir=args.work_dir,
            limit=args.limit,
            device=args.device,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
    except RegenerateError as e:
        print(f"dflash_mp.regenerate: {e}", file=sys.stderr)
        return 2
    if summary is None:
        log.info("rank %d done; the last rank to finish writes %s", args.rank, args.output)
    else:
        log.info("wrote %s: %s", args.output, json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
