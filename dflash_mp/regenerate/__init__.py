"""Regenerate a chat data set's assistant turns with the target itself (the DFlash recipe, §3).

A drafter learns to predict what the target would say; training it on human-written or
another model's answers teaches it a different distribution. This keeps every record's
system and user turns and replaces each assistant turn by the target's own response to the
conversation so far (greedy, or sampled with --temperature), turn after turn. A prompt-only
record ({"messages": [..., user]}) gets its answer appended.

Local backend (transformers in this process; one process per GPU under torchrun):

    python -m dflash_mp.regenerate --input data/train.jsonl --output data/train_regen.jsonl \\
        --target /models/qwen3-8b [--max-length N] [--temperature 0] [--batch-size 16]
    torchrun --nproc-per-node 8 -m dflash_mp.regenerate --input ... --output ... --target ...

Server backend (an OpenAI-compatible /v1/chat/completions: `vllm serve`, SGLang):

    python -m dflash_mp.regenerate --input data/train.jsonl --output data/train_regen.jsonl \\
        --server http://localhost:8000 [--model NAME] [--target /models/qwen3-8b] \\
        [--concurrency 64] [--max-retries 5] [--thinking off] [--keep-reasoning]

--target names the target's directory (`--target embedded`: the tiny embedded one); with
--server it is optional and gives the tokenizer that fits every response into --max-length and
checks each record as the trainer will tokenize it. --max-length defaults to the target's
max_position_embeddings, at most 3072 (the presets' data.max_length; 3072 with --server and no
--target); a value beyond the target's context is refused naming the one that fits. --chat-template-kwargs JSON (or --thinking
on|off for enable_thinking) reaches the chat template, locally or as the request's
chat_template_kwargs. The target's reasoning (a server's reasoning_content, or a leading
<think>...</think> block) is dropped, or kept in the turn's reasoning_content with
--keep-reasoning. The API key is read from $OPENAI_API_KEY (--api-key-env names another).
Requests carry temperature, max_tokens, --top-p/--top-k when given and (when sampling) a seed per
record and turn; other sampling parameters are the server's defaults (vLLM: the model's
generation_config), whereas the local backend samples from the temperature-scaled distribution,
cut by --top-p/--top-k when given.

An answer cut at its token budget (finish_reason "length") has no end of turn, yet training would
teach one after it: --on-length drop (default) ends the record after its last finished answer
(a record left without one is dropped), keep writes it anyway, fail stops (exit 2). The summary
counts truncated_turns, dropped_turns and dropped_records; when fewer than
--min-finished-fraction (0.5) of all answers finished, or no record is left to write, OUTPUT is
not written (exit 4; every record skipped as bad: exit 2): never an empty file. Greedy
decoding with thinking on where the target's generation_config asks for sampling (Qwen3's cards:
temperature 0.6, top-p 0.95, top-k 20) gets a warning.

Ranks split the records by index (rank r takes records i with i % world == r; --rank and
--world-size also allow independent jobs, e.g. a Slurm array or one client per server). Each
appends its results to OUTPUT.parts/part-RRRRR.jsonl keyed by record index (with a digest of
the input line: resuming onto a changed input is an error), so a killed job rerun with the same
arguments, at any world size, skips what is written. OUTPUT.parts/settings.json records what the
answers were made with (target or server and model, --max-length, --max-new-tokens, sampling,
--on-length, the chat template kwargs, --keep-reasoning, --round-trip-safe): a rerun with other
settings is refused naming each one, old and new. Each rank logs its progress (records written,
records/s, ETA) after its first records, every 30 s and at its end. Whichever rank finds
every record done merges the parts into OUTPUT in record order (atomically); the parts stay for
provenance. Exit status: 0 done, 2 bad input or settings (also other settings than the parts'),
3 records whose requests failed after their retries (a rerun retries them), 4 too few answers
finished (--min-finished-fraction) or none left to write.

The embedded default's training set, dflash_mp/assets/data/train_regenerated.jsonl, is the
bundled prompts answered by the tiny target (one process, so the batches and seeds are fixed):

    python -m dflash_mp.regenerate --input dflash_mp/assets/data/train.jsonl \\
        --output dflash_mp/assets/data/train_regenerated.jsonl --work-dir /tmp/regen-parts \\
        --target embedded --max-length 128 --max-new-tokens 48 --temperature 0.3 --round-trip-safe \\
        --batch-size 64 --on-length keep --min-finished-fraction 0

Low-temperature samples rather than greedy answers: the random target's greedy continuation
hardly depends on the prompt, so greedy data would be one sequence repeated 2000 times. Its
answers seldom stop by themselves, so cut ones are kept there; a real target should not need that.

The package's rooms: records.py (settings, records being answered), parts.py (the part files,
their settings, resume and merge), finish.py (cut answers, the floors), progress.py, local.py,
served.py (the two backends), cli.py, and serve.py (a small OpenAI-compatible server around a local target, for
smoke tests).
"""

from dflash_mp.regenerate.cli import main
from dflash_mp.regenerate.local import RoundTripSafe, regenerate, regenerate_batch
from dflash_mp.regenerate.parts import merge, read_parts
from dflash_mp.regenerate.records import (
    Conversation,
    RegenerateError,
    Settings,
    parse_conversation,
    split_reasoning,
)
from dflash_mp.regenerate.served import RecordsFailed, ServerSettings, regenerate_served

__all__ = [
    "Conversation",
    "RecordsFailed",
    "RegenerateError",
    "RoundTripSafe",
    "ServerSettings",
    "Settings",
    "main",
    "merge",
    "parse_conversation",
    "read_parts",
    "regenerate",
    "regenerate_batch",
    "regenerate_served",
    "split_reasoning",
]
