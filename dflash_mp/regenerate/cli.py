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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_mp.config.schema import TargetConfigError, read_target_config
from dflash_mp.data import DataError
from dflash_mp.embedded import embedded_path
from dflash_mp.regenerate.finish import TOO_FEW_FINISHED_EXIT_CODE, TooFewFinished, thinking_sampling_warning
from dflash_mp.regenerate.local import regenerate
from dflash_mp.regenerate.records import DEFAULT_MAX_LENGTH, RegenerateError, Settings, max_length_problem
from dflash_mp.regenerate.served import FAILED_EXIT_CODE, RecordsFailed, ServerSettings, regenerate_served
from dflash_mp.run import startup

log = logging.getLogger("dflash_mp.regenerate")
EMBEDDED = "embedded"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help ends with its default, unless it names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # By identity: a default of 0 or 0.0 is shown (`0 in (False,)` holds).
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text or not action.option_strings or unset:
            return text
        return f"{text} (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.regenerate", description=__doc__, formatter_class=_HelpFormatter
    )
    _add_data_options(parser)
    _add_answer_options(parser)
    _add_job_options(parser)
    _add_local_options(parser.add_argument_group("local backend (without --server)"))
    _add_server_options(
        parser.add_argument_group("server backend (an OpenAI-compatible /v1/chat/completions)")
    )
    return parser


def _add_data_options(parser: argparse.ArgumentParser) -> None:
    """What is read, what is written, and the target whose tokenizer measures it."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="chat data whose prompts are kept: JSONL, Parquet or Arrow files, save_to_disk directories, hf:org/name[:split]",
    )
    parser.add_argument("--output", type=Path, required=True, help="the regenerated JSONL file")
    parser.add_argument(
        "--target",
        help="the target's local HF directory, or `embedded` for the tiny embedded target; "
        "required for the local backend, with --server the tokenizer that fits responses into --max-length",
    )
    parser.add_argument("--work-dir", type=Path, help="per-rank parts (default: OUTPUT.parts)")
    parser.add_argument(
        "--max-length",
        type=int,
        help="longest record in tokens (data.max_length); default: the target's max_position_embeddings, "
        f"at most {DEFAULT_MAX_LENGTH} ({DEFAULT_MAX_LENGTH} with --server and no --target)",
    )


def _add_answer_options(parser: argparse.ArgumentParser) -> None:
    """How each answer is generated, and what becomes of one cut at its budget."""
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="longest response in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--top-p", type=float, help="nucleus sampling, e.g. 0.95 (default: the server's; locally none)"
    )
    parser.add_argument(
        "--top-k", type=int, help="top-k sampling, e.g. 20 (default: the server's; locally none)"
    )
    parser.add_argument(
        "--on-length",
        default="drop",
        choices=("drop", "keep", "fail"),
        help="an answer cut at its token budget, without its end of turn: drop it (the record ends "
        "after its last finished answer), keep it, or stop (exit 2)",
    )
    parser.add_argument(
        "--min-finished-fraction",
        type=float,
        default=0.5,
        help="below this fraction of answers that ended by themselves, OUTPUT is not written (exit 4)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        default="{}",
        help="JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--thinking", choices=("on", "off"), help="sets enable_thinking in the chat template kwargs (Qwen3)"
    )
    parser.add_argument(
        "--keep-reasoning",
        action="store_true",
        help="keep the target's reasoning in each answer's reasoning_content (default: drop it)",
    )


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    """Which records this process answers, and what it does with a bad one."""
    parser.add_argument("--limit", type=int, help="only the first N records")
    parser.add_argument(
        "--on-bad-record", default="fail", choices=("fail", "skip"), help="a record that cannot be used"
    )
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="default: $RANK")
    parser.add_argument(
        "--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="default: $WORLD_SIZE"
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the target's own modelling/tokenizer code"
    )


def _add_local_options(local: argparse._ArgumentGroup) -> None:
    local.add_argument("--batch-size", type=int, default=16, help="records generated together per rank")
    local.add_argument(
        "--round-trip-safe",
        action="store_true",
        help="generate only tokens whose text re-tokenizes to the same ids (small vocabularies, e.g. the embedded one)",
    )
    local.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available), cuda or cpu")
    local.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="auto: bf16 on GPU"
    )


def _add_server_options(served: argparse._ArgumentGroup) -> None:
    served.add_argument("--server", help="the server's URL, e.g. http://localhost:8000 (vLLM, SGLang)")
    served.add_argument("--model", help="the served model name (default: the only one the server lists)")
    served.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    served.add_argument(
        "--max-retries", type=int, default=5, help="retries on connection errors, timeouts, 408, 429, 5xx"
    )
    served.add_argument(
        "--retry-backoff", type=float, default=1.0, help="seconds before the first retry, doubling"
    )
    served.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    served.add_argument(
        "--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key (if any)"
    )
    served.add_argument(
        "--on-failed-request",
        default="fail",
        choices=("fail", "skip"),
        help="records still failing after the retries: exit 3 without writing OUTPUT (fail), or write "
        "OUTPUT without them (skip); a rerun retries them either way",
    )


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except ValueError as e:
        raise RegenerateError(
            f"--chat-template-kwargs {args.chat_template_kwargs!r} is not JSON ({e})"
        ) from None
    if not isinstance(kwargs, dict):
        raise RegenerateError(f"--chat-template-kwargs {args.chat_template_kwargs!r} must be a JSON object")
    if args.thinking is not None:
        kwargs["enable_thinking"] = args.thinking == "on"
    return kwargs


def _target(name: str | None, required: bool) -> Path | None:
    if name is None:
        if required:
            raise RegenerateError(
                "--target is required: the target model's local Hugging Face directory "
                "(--target embedded for the tiny embedded target), or --server URL to ask a served target"
            )
        return None
    if name == EMBEDDED:
        return embedded_path("target")
    if not Path(name).is_dir():
        raise RegenerateError(
            f"--target {name}: no such directory; give the target's local Hugging Face directory "
            "(config.json, weights, tokenizer), or --target embedded"
        )
    return Path(name)


def _max_length(requested: int | None, target: Path | None) -> int:
    """--max-length, or its default: the target's context, at most DEFAULT_MAX_LENGTH. A value beyond
    the context is refused here, before a model loads, naming the value that fits."""
    context = _context(target) if target is not None else None
    if requested is None:
        return DEFAULT_MAX_LENGTH if context is None else min(context, DEFAULT_MAX_LENGTH)
    if context is not None and requested > context:
        raise RegenerateError(max_length_problem(requested, context, target / "config.json"))
    return requested


def _context(target: Path) -> int | None:
    """The target's max_position_embeddings; None where its directory does not say (a tokenizer only)."""
    if not (target / "config.json").is_file():
        return None
    try:
        context = read_target_config(str(target)).get("max_position_embeddings")
    except TargetConfigError as e:
        raise RegenerateError(f"--target: {e}") from None
    return context if type(context) is int and context > 0 else None


def _warn_greedy_thinking(settings: Settings, target: Path | None) -> None:
    warning = thinking_sampling_warning(settings, target)
    if warning is not None:
        log.warning(warning)


def _settings(args: argparse.Namespace, target: Path | None) -> Settings:
    return Settings(
        max_length=_max_length(args.max_length, target),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        batch_size=args.batch_size,
        on_bad_record=args.on_bad_record,
        round_trip_safe=args.round_trip_safe,
        chat_template_kwargs=_template_kwargs(args),
        keep_reasoning=args.keep_reasoning,
        top_p=args.top_p,
        top_k=args.top_k,
        on_length=args.on_length,
        min_finished_fraction=args.min_finished_fraction,
    )


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The regeneration the options ask for; RegenerateError or RecordsFailed on failure."""
    if args.server is None:  # the local path's stack, imported before the collector resumes
        import torch  # noqa: F401
        import transformers  # noqa: F401
    startup.resume()
    target = _target(args.target, required=False)
    settings = _settings(args, target)
    if settings.temperature == 0 and (settings.top_p is not None or settings.top_k is not None):
        log.warning("--top-p and --top-k have no effect at --temperature 0 (greedy)")
    common = dict(rank=args.rank, world_size=args.world_size, work_dir=args.work_dir, limit=args.limit)
    if args.server is None:
        target = _target(args.target, required=True)  # after the settings: every bad option is named
        _warn_greedy_thinking(settings, target)
        return regenerate(
            args.input,
            args.output,
            target,
            settings,
            device=args.device,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
            **common,
        )
    server = ServerSettings(
        url=args.server,
        model=args.model,
        concurrency=args.concurrency,
        max_retries=args.max_retries,
        timeout=args.timeout,
        retry_backoff=args.retry_backoff,
        api_key_env=args.api_key_env,
        on_failed_request=args.on_failed_request,
    )
    _warn_greedy_thinking(settings, target)
    return regenerate_served(
        args.input,
        args.output,
        server,
        settings,
        tokenizer_path=target,
        trust_remote_code=args.trust_remote_code,
        **common,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {args.rank}] %(message)s")
    try:
        summary = run(args)
    except TooFewFinished as e:
        print(f"dflash_mp.regenerate: {e}", file=sys.stderr)
        return TOO_FEW_FINISHED_EXIT_CODE
    except (RegenerateError, DataError) as e:
        print(f"dflash_mp.regenerate: {e}", file=sys.stderr)
        return 2
    except RecordsFailed as e:
        print(f"dflash_mp.regenerate: {e}", file=sys.stderr)
        return FAILED_EXIT_CODE
    if summary is None:
        log.info("rank %d done; the last rank to finish writes %s", args.rank, args.output)
    else:
        log.info("wrote %s: %s", args.output, json.dumps(summary))
    return 0
