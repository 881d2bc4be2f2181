"""What every backend shares: records in, regenerated records out, and the bookkeeping that resumes.

Each rank (or independent job) appends its results to WORK_DIR/part-RRRRR.jsonl keyed by record
index, one fsynced line per record or batch, so a killed run rerun with the same arguments skips
what is written. Whoever finds every record done merges the parts into OUTPUT in record order,
atomically; the parts stay for provenance.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("dflash_mp.regenerate")


class RegenerateError(ValueError):
    """Input the regeneration cannot run on; the message names the file:line or option and the fix."""


@dataclass
class Settings:
    """How answers are generated, whichever backend generates them."""

    max_length: int  # longest record (prompt + responses), in tokens
    max_new_tokens: int  # longest single response
    temperature: float  # 0: greedy
    seed: int
    batch_size: int  # local backend: records generated together
    on_bad_record: str  # "fail" or "skip"
    # Local backend: generate only tokens whose text re-tokenizes to the same ids (see RoundTripSafe).
    round_trip_safe: bool = False
    # Extra variables for the chat template, e.g. {"enable_thinking": False} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Store the target's reasoning in the assistant turn's reasoning_content (else drop it).
    keep_reasoning: bool = False
    top_p: float | None = None  # None: the server's default; locally no nucleus cut
    top_k: int | None = None  # None: the server's default; locally no top-k cut
    on_length: str = "drop"  # an answer cut at its token budget: drop, keep or fail (finish.py)
    # Below this fraction of responses that ended by themselves, OUTPUT is not written.
    min_finished_fraction: float = 0.5

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
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"--top-p={self.top_p!r}: must be in (0, 1], e.g. 0.95")
        if self.top_k is not None and not self.top_k >= 1:
            problems.append(f"--top-k={self.top_k!r}: must be >= 1, e.g. 20")
        if self.on_length not in ("drop", "keep", "fail"):
            problems.append(f"--on-length={self.on_length!r}: must be drop, keep or fail")
        if not 0 <= self.min_finished_fraction <= 1:
            problems.append(f"--min-finished-fraction={self.min_finished_fraction!r}: must be in [0, 1]")
        if self.on_bad_record not in ("fail", "skip"):
            problems.append(f"--on-bad-record={self.on_bad_record!r}: must be 'fail' or 'skip'")
        if not isinstance(self.chat_template_kwargs, dict):
            problems.append(f"--chat-template-kwargs={self.chat_template_kwargs!r}: must be a JSON object")
        if problems:
            raise RegenerateError("; ".join(problems))


@dataclass
class Conversation:
    """One record being regenerated: what is written so far and the original turns still to come."""

    index: int
    source: str  # file:line, for messages
    done: list[dict[str, str]] = field(default_factory=list)
    rest: list[dict[str, str]] = field(default_factory=list)
    response_tokens: list[int | None] = field(default_factory=list)  # per regenerated turn
    finished: list[bool] = field(default_factory=list)  # per turn: ended with a stop token
    # Per turn: the text re-tokenizes to the same ids (None where the ids are unknown: a server).
    same_tokens: list[bool | None] = field(default_factory=list)
    problem: str | None = None  # why the record cannot be regenerated
    dropped_turns: int = 0  # answers cut at their token budget and left out (--on-length drop)

    def next_prompt(self) -> list[dict[str, str]] | None:
        """The conversation to answer next (roles and contents only), or None when the record is complete.

        Earlier answers go back without their reasoning: Qwen3-style templates drop the reasoning
        of turns before the last user message anyway, and servers need not accept the field.
        """
        while self.rest and self.rest[0]["role"] != "assistant":
            self.done.append(self.rest.pop(0))
        if self.rest or (self.done and self.done[-1]["role"] == "user"):
            return [{"role": m["role"], "content": m["content"]} for m in self.done]
        return None

    def answer(
        self,
        text: str,
        num_tokens: int | None,
        finished: bool,
        same_tokens: bool | None,
        reasoning: str | None = None,
    ) -> None:
        if self.rest:
            self.rest.pop(0)  # the original assistant turn this one replaces
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self.done.append(message)
        self.response_tokens.append(num_tokens)
        self.finished.append(finished)
        self.same_tokens.append(same_tokens)

    def cut_before_last_prompt(self) -> None:
        """End the conversation after its last assistant turn (the next prompt does not fit)."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        self.rest = []

    def fit_response(self, prompt_tokens: int, template_tail: int, settings: Settings) -> int | None:
        """Tokens the next response may take within --max-length, or None when it gets none: then
        the record ends after its last answer, or (with no answer yet) has a problem."""
        budget = min(settings.max_new_tokens, settings.max_length - prompt_tokens - template_tail)
        if budget >= 1:
            return budget
        if self.response_tokens:
            self.cut_before_last_prompt()  # keep the turns that fit
        else:
            self.problem = (
                f"the prompt has {prompt_tokens} tokens: no room for a response within "
                f"--max-length {settings.max_length}"
            )
        return None


def parse_conversation(index: int, source: str, text: str) -> Conversation:
    """A record's messages, checked; ValueError says what is wrong."""
    from dflash_mp.evaluation.prompts import chat_messages

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


def split_reasoning(text: str, reasoning: str | None = None) -> tuple[str, str | None]:
    """(answer, reasoning) of a response: a server's separate reasoning, or a <think>...</think>
    block leading the text (templates that open <think> in the generation prompt leave only its end).

    Kept inline, the block would break the trainer's alignment of contents with Qwen3-style
    templates, which move reasoning into a <think> block of their own.
    """
    head, closing, tail = text.partition("</think>")
    if closing and (head.lstrip().startswith("<think>") or "<think>" not in head):
        inline = head.lstrip().removeprefix("<think>")
        reasoning = inline if reasoning is None else reasoning
        text = tail
    elif reasoning is None:
        return text, None
    return text.lstrip("\n"), reasoning.strip("\n")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], settings: Settings) -> list[int]:
    """Token ids of the conversation with the generation prompt, as the target sees it."""
    encoding = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **settings.chat_template_kwargs
    )
    return list(encoding["input_ids"])


def prompt_and_budget(
    conversation: Conversation, tokenizer: Any, messages: list[dict[str, str]], tail: int, settings: Settings
) -> tuple[list[int], int] | None:
    """The next prompt's ids and the room for its response, or None when it gets no response (see
    Conversation.fit_response); a template that rejects the conversation gives the record a problem."""
    from jinja2 import TemplateError

    try:
        ids = render_prompt(tokenizer, messages, settings)
    except (ValueError, TemplateError) as e:  # a template's raise_exception() is a TemplateError
        conversation.problem = f"the chat template cannot render the conversation: {e}"
        return None
    budget = conversation.fit_response(len(ids), tail, settings)
    return None if budget is None else (ids, budget)


def template_tail(tokenizer: Any) -> int:
    """Tokens the chat template adds after an assistant content (e.g. <|im_end|> and a newline)."""
    user = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)
    whole = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": ""}], tokenize=True, return_dict=True
    )
    return max(len(whole["input_ids"]) - len(prompt["input_ids"]), 0)


def stable_seed(*parts: int) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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


def open_part(path: Path) -> IO[str]:
    """A part file for appending, with any half-written last line (a kill) cut off."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open while the rank works


def append_entries(part: IO[str], entries: Sequence[dict[str, Any]]) -> None:
    """Whole lines, on disk before the next record starts: a kill loses at most the line being written."""
    part.writelines(json.dumps(e) + "\n" for e in entries)
    part.flush()
    os.fsync(part.fileno())


def merge(
    work_dir: Path,
    output: Path,
    num_records: int,
    left_out: Collection[int] = (),
    min_finished_fraction: float = 0.0,
) -> dict[str, Any] | None:
    """Write OUTPUT from the parts if every record is done or `left_out` (None otherwise); returns
    the summary. Raises TooFewFinished, writing nothing, when fewer responses than
    `min_finished_fraction` ended by themselves.

    Every merger writes the same bytes through its own temporary file and an atomic rename, so
    two ranks finishing at once cannot leave a mixed file.
    """
    from dflash_mp.regenerate.finish import check_finished, summarize

    results = read_parts(work_dir)
    if any(i not in results and i not in left_out for i in range(num_records)):
        return None
    entries = [results[i] for i in range(num_records) if i in results]
    kept = [e for e in entries if "messages" in e]
    summary = summarize(entries)
    check_finished(summary, min_finished_fraction, output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make a shared data set private
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": e["messages"]}) + "\n" for e in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    if left_out:
        summary["failed"] = len(left_out)
    return summary


def _digest(text: str) -> str:
    return hashlib.sha256(text.strip().encode()).hexdigest()[:16]


class RecordJob:
    """One rank's share of the input records (index i with i % world == rank), less what a previous
    run already wrote, and the writing of its results."""

    def __init__(
        self,
        inputs: Sequence[str | Path],
        output: str | Path,
        settings: Settings,
        rank: int = 0,
        world_size: int = 1,
        work_dir: str | Path | None = None,
        limit: int | None = None,
    ) -> None:
        from dflash_mp.data import DataError, open_records

        if not 0 <= rank < world_size:
            raise RegenerateError(f"--rank {rank} must be in [0, --world-size {world_size})")
        self.settings, self.rank = settings, rank
        self.output = Path(output)
        self.work_dir = (
            Path(work_dir) if work_dir is not None else self.output.with_name(self.output.name + ".parts")
        )
        try:
            self.index = open_records(list(inputs))
        except DataError as e:
            raise RegenerateError(str(e)) from None
        self.num_records = len(self.index) if limit is None else min(limit, len(self.index))
        done = read_parts(self.work_dir)
        self._check_same_input(done)
        self.pending = [i for i in range(rank, self.num_records, world_size) if i not in done]
        self._digests: dict[int, str] = {}  # of the records being answered, for their entries
        log.info(
            "rank %d/%d: %d of %d records to regenerate",
            rank,
            world_size,
            len(self.pending),
            self.num_records,
        )

    def _check_same_input(self, done: dict[int, dict[str, Any]]) -> None:
        """Resume only onto answers to the same records: an edited input would mix in stale ones."""
        for i, entry in sorted(done.items()):
            written = entry.get("input_sha256")  # absent from parts written by older versions
            if written is not None and i < len(self.index) and written != _digest(self.index.read(i)[2]):
                raise RegenerateError(
                    f"{self.source(i)} is not the record {self.work_dir} holds an answer to (the input "
                    "changed since); pass a new --work-dir, or remove that one, to regenerate this input"
                )

    def source(self, i: int) -> str:
        path, line, _ = self.index.read(i)
        return f"{path}:{line}"

    def conversation(self, i: int) -> Conversation | dict[str, Any]:
        """Record i ready to answer, or its skip entry when it cannot be (or the error, with fail)."""
        path, line, text = self.index.read(i)
        self._digests[i] = _digest(text)
        try:
            return parse_conversation(i, f"{path}:{line}", text)
        except ValueError as e:
            return self.bad(i, f"{path}:{line}", str(e))

    def result(self, conversation: Conversation, tokenizer: Any | None) -> dict[str, Any]:
        """The entry to write for an answered record; with a tokenizer, the record must also pass the
        trainer's own tokenization (length, loss mask)."""
        from jinja2 import TemplateError

        from dflash_mp.data import tokenize_chat

        if conversation.dropped_turns and not conversation.response_tokens:  # nothing left to keep
            entry = {"index": conversation.index, "input_sha256": self._digests.pop(conversation.index)}
            return {**entry, "dropped_turns": conversation.dropped_turns}
        if conversation.problem is None and tokenizer is not None:
            try:
                tokenize_chat(tokenizer, conversation.done, self.settings.max_length)
            except (ValueError, TemplateError) as e:  # a template's raise_exception() is a TemplateError
                conversation.problem = str(e)
        if conversation.problem is not None:
            return self.bad(conversation.index, conversation.source, conversation.problem)
        return {
            "index": conversation.index,
            "input_sha256": self._digests.pop(conversation.index),
            "messages": conversation.done,
            "response_tokens": conversation.response_tokens,
            "finished": conversation.finished,
            "same_tokens": conversation.same_tokens,
            "dropped_turns": conversation.dropped_turns,
        }

    def bad(self, index: int, source: str, reason: str) -> dict[str, Any]:
        if self.settings.on_bad_record == "fail":
            raise RegenerateError(f"{source}: {reason} (pass --on-bad-record skip to skip such records)")
        log.warning("skipping %s: %s", source, reason)
        return {"index": index, "input_sha256": self._digests.pop(index), "skipped": reason}

    def open_part(self) -> IO[str]:
        return open_part(part_path(self.work_dir, self.rank))

    def merge(self, left_out: Collection[int] = ()) -> dict[str, Any] | None:
        return merge(
            self.work_dir, self.output, self.num_records, left_out, self.settings.min_finished_fraction
        )
