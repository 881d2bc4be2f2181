"""Rendering with the chat template, and the loss mask: what the model generates in each assistant turn.

The loss covers what the template renders of an assistant turn after its generation prompt
(`<|im_start|>assistant\\n` for Qwen), up to and including the special token that ends it:
reasoning the template keeps is trained on, reasoning it strips is simply absent.
"""

from __future__ import annotations

import bisect
import functools
import os
import re
from pathlib import Path
from typing import Any

from dflash_mp.data.errors import DataError
from dflash_mp.data.records import RecordError, split_inline_reasoning


def load_tokenizer(
    path: str | Path, trust_remote_code: bool = False, require_chat_template: bool = True
) -> Any:
    """The target's tokenizer from its local directory (never a hub); it must be fast.

    Read once per process for a directory's contents (a 150k-token vocabulary takes about a second
    to read, and a rank asks for it from the config checks, the data, the mask token and the
    evaluation): callers share the object and must not change it; `read_tokenizer` gives a private
    one. `require_chat_template=False` when data.chat_template supplies the template instead.
    """
    tokenizer = _shared_tokenizer(str(path), trust_remote_code, directory_stamp(path))
    if require_chat_template and not tokenizer.chat_template:
        raise DataError(
            f"{path}: the tokenizer has no chat template; add chat_template.jinja (or a chat_template "
            "entry in tokenizer_config.json) to the directory, or set data.chat_template=FILE.jinja"
        )
    return tokenizer


def read_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """A tokenizer of the caller's own, read from the local directory `path` (never a hub)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=trust_remote_code, local_files_only=True
    )
    if not tokenizer.is_fast:
        raise DataError(
            f"{path}: the tokenizer is not a fast tokenizer; add its tokenizer.json to the directory"
        )
    return tokenizer


def directory_stamp(path: str | Path) -> tuple | None:
    """Name, size and modification time of every file in `path` (None when it cannot be listed):
    a cache key that changes when the directory's files do."""
    try:
        with os.scandir(path) as entries:
            stats = [(e.name, e.stat()) for e in entries if e.is_file()]
    except OSError:
        return None
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


@functools.lru_cache(maxsize=8)
def _shared_tokenizer(path: str, trust_remote_code: bool, stamp: tuple | None) -> Any:
    return read_tokenizer(path, trust_remote_code)  # a failure is not cached: it raises again


def read_chat_template(path: str) -> str | None:
    """data.chat_template's text ('' or None: the tokenizer's own template)."""
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template={path!r}: cannot read the jinja file ({e})") from None


# Private-use characters: no real content contains them and templates pass them through untouched.
_PLACEHOLDER = "\ue000{}{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)([cr])\ue001")
_FIELDS = {"c": "content", "r": "reasoning_content"}
_UNALIGNED = (
    "cannot locate the assistant contents in the chat template's rendering (the template rewrites "
    "them beyond trimming); put reasoning in a reasoning_content field or pre-render the record as "
    '{"text": ..., "loss_spans": [...]}'
)


class ChatRenderer:
    """A tokenizer with the chat template and its arguments the job uses (data.chat_template[_kwargs])."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, template_kwargs: dict | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self._probed = False
        self._generation_prompt = ""
        self._renders_reasoning = False

    def apply(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        if self.chat_template is None and not self.tokenizer.chat_template:
            raise DataError(
                "the tokenizer has no chat template to render conversations with: set "
                "data.chat_template=FILE.jinja or add chat_template.jinja to the target directory"
            )
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def _probe(self) -> None:
        """What the template adds as a generation prompt, and whether it renders reasoning_content."""
        if self._probed:
            return
        user = [{"role": "user", "content": _PLACEHOLDER.format(0, "c")}]
        try:
            bare, prompted = self.apply(user), self.apply(user, generation_prompt=True)
            self._generation_prompt = prompted[len(bare) :] if prompted.startswith(bare) else ""
        except DataError:
            raise
        except Exception:  # a template that cannot render a lone user turn: no generation prompt known
            self._generation_prompt = ""
        marker = _PLACEHOLDER.format(1, "r")
        answer = {"role": "assistant", "content": _PLACEHOLDER.format(1, "c"), "reasoning_content": marker}
        try:
            self._renders_reasoning = marker in self.apply([*user, answer])
        except DataError:
            raise
        except Exception:
            self._renders_reasoning = False
        self._probed = True

    def _loss_start(self, before: str) -> int:
        """Where in `before` (the template's text up to a turn's first value) the turn's loss starts:
        after the generation prompt when it is there ("<think>\\n" is generated, the header is
        not), else at the value (e.g. a turn before the last user message, or, with
        enable_thinking=false, a turn whose reasoning the template still renders).
        """
        prompt = self._generation_prompt
        cut = before.rfind(prompt) if prompt else -1
        return cut + len(prompt) if cut >= 0 else len(before)

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn's loss in it.

        Rendering once more with placeholders for every content and reasoning gives the template's
        own text around them, for any template: real Qwen3 templates have no {% generation %}
        markers, trim contents, and move or drop <think> blocks, so prefix rendering cannot be trusted.
        """
        self._probe()
        if self._renders_reasoning:  # the template owns reasoning: hand it over as a field
            messages = split_inline_reasoning(messages)
        # Blank reasoning is no reasoning (a placeholder would render where the real one does not).
        messages = [
            {k: v for k, v in m.items() if k != "reasoning_content"}
            if not str(m.get("reasoning_content") or "").strip()
            else m
            for m in messages
        ]
        text = self.apply(messages)
        placeholders = []
        for i, message in enumerate(messages):
            marked = {**message, "content": _PLACEHOLDER.format(i, "c")}
            if "reasoning_content" in message:
                marked["reasoning_content"] = _PLACEHOLDER.format(i, "r")
            placeholders.append(marked)
        # re.split with two groups: template text, message index, field, template text, ...
        pieces = _PLACEHOLDER_RE.split(self.apply(placeholders))
        template_texts = pieces[0::3]
        markers = [(int(i), _FIELDS[f]) for i, f in zip(pieces[1::3], pieces[2::3], strict=True)]
        if not (text.startswith(template_texts[0]) and text.endswith(template_texts[-1])):
            raise RecordError("template mismatch", _UNALIGNED)
        turn_spans: dict[int, list[int]] = {}
        position = len(template_texts[0])
        for k, ((i, field), following) in enumerate(zip(markers, template_texts[1:], strict=True)):
            value = messages[i][field]
            if text.startswith(value + following, position):
                end = position + len(value)
            elif k == len(markers) - 1:
                end = len(text) - len(following)
            else:
                # The template changed the value (e.g. trimmed it): it ends where the template resumes.
                end = text.find(following, position) if following else -1
            if end < position:
                raise RecordError("template mismatch", _UNALIGNED)
            if messages[i]["role"] == "assistant":
                if i not in turn_spans:
                    before = template_texts[k]
                    turn_spans[i] = [position - len(before) + self._loss_start(before), end]
                turn_spans[i][1] = end
            position = end + len(following)
        return text, [(start, end) for start, end in turn_spans.values()]


def tokenize_spans(
    tokenizer: Any, text: str, spans: list[tuple[int, int]] | None, end_of_turn: bool
) -> tuple[list[int], list[int]]:
    """input_ids of text and a loss mask of 1 on every token reaching into a span (all: spans None).

    `end_of_turn`: the special token right after a span is in the loss too (<|im_end|> for Qwen):
    the drafter must learn to stop.
    """
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = encoding["input_ids"]
    if spans is None:
        return input_ids, [1] * len(input_ids)
    starts = [start for start, _ in encoding["offset_mapping"]]
    ends = [end for _, end in encoding["offset_mapping"]]
    special_ids = set(tokenizer.all_special_ids)
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in spans:
        first = bisect.bisect_right(ends, span_start)  # first token reaching into the span
        after = bisect.bisect_left(starts, span_end)  # first token starting after it
        loss_mask[first:after] = [1] * max(after - first, 0)
        if end_of_turn and after < len(input_ids) and input_ids[after] in special_ids:
            loss_mask[after] = 1
    return input_ids, loss_mask


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], max_length: int, renderer: ChatRenderer | None = None
) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask of a conversation (the tokenizer's own template unless `renderer`).

    Raises ValueError when longer than max_length tokens or when it cannot be masked.
    """
    text, spans = (renderer or ChatRenderer(tokenizer)).render(messages)
    input_ids, loss_mask = tokenize_spans(tokenizer, text, spans, end_of_turn=True)
    if len(input_ids) > max_length:
        raise ValueError(f"{len(input_ids)} tokens, longer than data.max_length={max_length}")
    return input_ids, loss_mask


def load_renderer(
    target_path: str | Path, trust_remote_code: bool, chat_template: str = "", template_kwargs: Any = None
) -> ChatRenderer:
    """The target's tokenizer with data.chat_template (a file; '' keeps the tokenizer's) and its kwargs."""
    tokenizer = load_tokenizer(target_path, trust_remote_code, require_chat_template=not chat_template)
    return ChatRenderer(tokenizer, read_chat_template(chat_template), dict(template_kwargs or {}))
