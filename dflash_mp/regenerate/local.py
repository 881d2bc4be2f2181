"""The local backend: the target loaded with transformers in this process, one process per GPU.

Ranks split the records by index (--rank/--world-size, or torchrun's RANK/WORLD_SIZE; independent
jobs such as a Slurm array work too) and write their parts for the shared merge (parts.py).
Batches of records advance one assistant turn at a time, left-padded, through `generate`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dflash_mp.regenerate.finish import take_answer
from dflash_mp.regenerate.parts import RecordJob, append_entries, made_with
from dflash_mp.regenerate.progress import Progress
from dflash_mp.regenerate.records import (
    Conversation,
    RegenerateError,
    Settings,
    max_length_problem,
    prompt_and_budget,
    split_reasoning,
    stable_seed,
    template_tail,
)


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
        top_k=(settings.top_k or 0) if sampling else None,
        top_p=(settings.top_p or 1.0) if sampling else None,
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
    tail = template_tail(tokenizer)
    round_trip = RoundTripSafe(tokenizer, stops) if settings.round_trip_safe else None
    active = list(conversations)
    while active:
        prompts, budgets, asking = [], [], []
        for conversation in active:
            messages = conversation.next_prompt()
            if messages is None:
                continue
            fitted = prompt_and_budget(conversation, tokenizer, messages, tail, settings)
            if fitted is None:
                continue
            ids, budget = fitted
            prompts.append(ids)
            budgets.append(budget)
            asking.append(conversation)
        if not asking:
            return
        # Seeded by (seed, first record of the batch, turn): a rerun with the same batches draws the same.
        seed = stable_seed(settings.seed, asking[0].index, len(asking[0].response_tokens))
        outputs = _generate(model, tokenizer, prompts, budgets, stops, settings, seed, round_trip)
        for conversation, new_tokens in zip(asking, outputs, strict=True):
            finished = bool(new_tokens) and new_tokens[-1] in stops
            content_ids = new_tokens[:-1] if finished else new_tokens
            text = tokenizer.decode(content_ids, skip_special_tokens=True)
            same = tokenizer(text, add_special_tokens=False)["input_ids"] == content_ids
            content, reasoning = split_reasoning(text)
            kept = reasoning if settings.keep_reasoning else None
            take_answer(conversation, settings, content, len(new_tokens), finished, same, kept)
        active = asking


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
    from dflash_mp.data import load_tokenizer
    from dflash_mp.evaluation.acceptance import load_target_model, resolve_device, stop_token_ids

    made = made_with(settings, target=str(Path(target_path).resolve()))
    job = RecordJob(inputs, output, settings, rank, world_size, work_dir, limit, made)
    if job.pending:
        torch_device, torch_dtype = resolve_device(device, dtype)
        tokenizer = load_tokenizer(target_path, trust_remote_code=trust_remote_code)
        model = load_target_model(target_path, torch_dtype, torch_device, trust_remote_code)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and settings.max_length > context:
            raise RegenerateError(max_length_problem(settings.max_length, context, target_path))
        stops = stop_token_ids(tokenizer, model)
        progress = Progress(len(job.pending), rank)
        with job.open_part() as part:
            for batch in _batches(job.pending, settings.batch_size):
                items = [job.conversation(i) for i in batch]
                conversations = [c for c in items if isinstance(c, Conversation)]
                regenerate_batch(conversations, model, tokenizer, stops, settings)
                entries = [c if isinstance(c, dict) else job.result(c, tokenizer) for c in items]
                append_entries(part, entries)
                progress.advance(len(entries))
    return job.merge()
