"""Answers cut at their token budget: dropped (default), kept or fatal; the finished-fraction floor
and an output without a record; parts made with other settings; --max-length's default; progress;
--help's defaults; top-p/top-k; the warning for greedy thinking."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dflash_mp.embedded import embedded_path
from dflash_mp.regenerate import RegenerateError, Settings, main, read_parts, regenerate
from dflash_mp.regenerate import local as regen
from dflash_mp.regenerate.finish import TOO_FEW_FINISHED_EXIT_CODE, TooFewFinished, thinking_sampling_warning
from dflash_mp.regenerate.parts import check_made_with, made_with, record_made_with
from dflash_mp.regenerate.progress import Progress
from dflash_mp.regenerate.served import Reply, _RecordAnswerer

RECORDS = [
    [{"role": "user", "content": "Count from 3 to 9."}, {"role": "assistant", "content": "3 4 5"}],
    [
        {"role": "system", "content": "You are a patient teacher."},
        {"role": "user", "content": "Spell the word cat."},
        {"role": "assistant", "content": "c a t"},
        {"role": "user", "content": "Reverse these words: sun moon"},  # its answer is cut
        {"role": "assistant", "content": "moon sun"},
    ],
    [{"role": "user", "content": "What is 2 plus 3?"}],
    [{"role": "user", "content": "Repeat these words: tree bird"}],  # its only answer is cut
    [{"role": "user", "content": "Continue the alphabet from d for 4 letters."}],
]
CUT = ("Reverse these words", "Repeat these words")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in RECORDS))
    return path


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target answers "sun" and stops, except to the CUT prompts, which run to the budget."""

    def generate(model, tokenizer, prompts, budgets, stops, settings, seed, round_trip):
        word = tokenizer("sun", add_special_tokens=False)["input_ids"]
        return [
            word * budget if any(cut in tokenizer.decode(prompt) for cut in CUT) else [*word, stops[0]]
            for prompt, budget in zip(prompts, budgets, strict=True)
        ]

    monkeypatch.setattr(regen, "_generate", generate)


def _settings(**changes) -> Settings:
    values = dict(
        max_length=128, max_new_tokens=6, temperature=0.0, seed=0, batch_size=2, on_bad_record="fail"
    )
    return Settings(**{**values, **changes})


def _read(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_a_cut_answer_is_dropped_and_counted(scripted, data: Path, tmp_path: Path) -> None:
    target = embedded_path("target")
    summary = regenerate([data], tmp_path / "out.jsonl", target, _settings(min_finished_fraction=0.0))
    assert summary is not None
    assert summary["records"] == 4 and summary["dropped_records"] == 1  # "Repeat" had nothing else
    assert summary["turns"] == 4 and summary["dropped_turns"] == 2 and summary["truncated_turns"] == 2
    assert summary["finished_fraction"] == pytest.approx(4 / 6)
    written = _read(tmp_path / "out.jsonl")
    # The two-turn record ends after its finished first answer; no cut answer is written.
    assert written[1] == [*RECORDS[1][:2], {"role": "assistant", "content": "sun"}]
    assert all(m["content"] == "sun" for messages in written for m in messages if m["role"] == "assistant")
    assert all(
        all(e["finished"]) for e in read_parts(tmp_path / "out.jsonl.parts").values() if "messages" in e
    )


def test_keep_writes_the_cut_answer_and_fail_stops_naming_the_record(scripted, data: Path, tmp_path) -> None:
    target = embedded_path("target")
    kept = regenerate(
        [data], tmp_path / "k.jsonl", target, _settings(on_length="keep", min_finished_fraction=0)
    )
    assert kept is not None and kept["records"] == 5 and kept["turns"] == 6 and kept["truncated_turns"] == 2
    assert kept["finished_fraction"] == pytest.approx(4 / 6) and kept["dropped_turns"] == 0
    assert _read(tmp_path / "k.jsonl")[3][-1]["content"] == " ".join(["sun"] * 6)
    with pytest.raises(RegenerateError, match=r"in.jsonl:2: the answer to turn 2 was cut .*--on-length drop"):
        regenerate([data], tmp_path / "f.jsonl", target, _settings(on_length="fail"))


def test_too_few_finished_answers_fail_without_writing_the_output(scripted, data: Path, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    target = embedded_path("target")
    with pytest.raises(TooFewFinished, match=r"only 66.7% of the 6 responses .*--min-finished-fraction 0.7"):
        regenerate([data], out, target, _settings(min_finished_fraction=0.7))
    assert not out.exists()
    args = ["--input", str(data), "--output", str(out), "--target", "embedded", "--max-new-tokens", "6"]
    args += ["--max-length", "128"]
    assert main(args) == 0  # the default floor, 0.5: the same parts are merged, nothing regenerated
    assert len(_read(out)) == 4
    assert main([*args, "--output", str(tmp_path / "b.jsonl"), "--min-finished-fraction", "0.9"]) == (
        TOO_FEW_FINISHED_EXIT_CODE
    )


def test_a_rerun_with_other_settings_is_refused_naming_them(scripted, data: Path, tmp_path, capsys) -> None:
    """The parts of a run that exited 4 under --on-length drop hold no cut answer: a rerun with keep
    merging them would write what neither setting asks for. Other settings are refused by name."""
    out = tmp_path / "out.jsonl"
    args = ["--input", str(data), "--output", str(out), "--target", "embedded", "--max-new-tokens", "6"]
    args += ["--max-length", "128", "--min-finished-fraction", "0.7"]
    assert main(args) == TOO_FEW_FINISHED_EXIT_CODE
    capsys.readouterr()
    assert main([*args, "--on-length", "keep", "--min-finished-fraction", "0"]) == 2
    assert (
        f"{out}.parts holds answers made with other settings: --on-length drop (now keep)."
        in capsys.readouterr().err
    )
    assert main([*args, "--max-new-tokens", "8", "--temperature", "0.5", "--thinking", "off"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 6 (now 8), --temperature 0.0 (now 0.5)" in err
    assert '--chat-template-kwargs (--thinking) {} (now {"enable_thinking": false})' in err
    assert "or regenerate with these into a new --work-dir" in err and not out.exists()
    assert main([*args, "--min-finished-fraction", "0.5"]) == 0  # the floor makes no answer: merged


def test_parts_of_another_target_server_or_model_are_refused(tmp_path: Path) -> None:
    record_made_with(tmp_path, made_with(_settings(), server="http://a:8000", model="m1", target=""))
    other = made_with(_settings(), server="http://b:8000", model="m2", target="/t")
    check_made_with(tmp_path, other)  # no answer written yet: nothing to mix with
    (tmp_path / "part-00000.jsonl").write_text('{"index": 0}\n')
    model_not_asked_yet = made_with(_settings(), server="http://a:8000", target="")
    check_made_with(tmp_path, model_not_asked_yet)
    named = r"--server http://a:8000 \(now http://b:8000\), --model m1 \(now m2\), --target unset \(now /t\)"
    with pytest.raises(RegenerateError, match=named):
        check_made_with(tmp_path, other)
    with pytest.raises(RegenerateError, match=named):
        record_made_with(tmp_path, other)  # a rank is refused before it writes
    assert json.loads((tmp_path / "settings.json").read_text())["server"] == "http://a:8000"


def test_a_merge_with_no_record_to_write_fails_instead_of_writing_an_empty_file(
    scripted, tmp_path, capsys
) -> None:
    data = tmp_path / "cut.jsonl"
    data.write_text("".join(json.dumps({"messages": RECORDS[3]}) + "\n" for _ in range(2)))
    out = tmp_path / "out.jsonl"
    args = ["--input", str(data), "--output", str(out), "--target", "embedded", "--max-new-tokens", "6"]
    assert main([*args, "--max-length", "128", "--min-finished-fraction", "0"]) == TOO_FEW_FINISHED_EXIT_CODE
    err = capsys.readouterr().err
    assert f"no record left to write to {out}: 2 record(s) lost every answer, cut at its token budget" in err
    assert not out.exists()


def test_max_length_defaults_to_the_targets_context_and_names_the_value_that_fits(
    scripted, data: Path, tmp_path, capsys, caplog
) -> None:
    """The embedded target has 512 positions: the default fits it (3072 was refused), and a value
    beyond it is refused before the model loads, naming 512. Progress comes as log lines."""
    out = tmp_path / "out.jsonl"
    args = ["--input", str(data), "--output", str(out), "--target", "embedded", "--max-new-tokens", "6"]
    assert main([*args, "--max-length", "3072"]) == 2
    assert "--max-length 3072 exceeds the target's context of 512 positions" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="dflash_mp.regenerate"):
        assert main([*args, "--min-finished-fraction", "0"]) == 0
    assert json.loads((tmp_path / "out.jsonl.parts" / "settings.json").read_text())["max_length"] == 512
    assert "rank 0: 5 of 5 records written; done in" in caplog.text


def test_progress_lines_give_the_rate_and_an_eta(caplog) -> None:
    now = [0.0]
    progress = Progress(100, rank=1, every_s=30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="dflash_mp.regenerate"):
        for at, written, failed in ((10, 10, 0), (20, 10, 0), (40, 15, 5), (100, 60, 0)):
            now[0] = at
            progress.advance(written, failed)
    assert [r.getMessage() for r in caplog.records] == [
        "rank 1: 10 of 100 records written, 1.00 records/s, ETA 1m30s",  # the first estimate at once
        "rank 1: 35 of 100 records written, 5 failed, 1.00 records/s, ETA 1m00s",  # 30 s after it
        "rank 1: 95 of 100 records written, 5 failed; done in 1m40s (1.00 records/s)",
    ]


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for text in (
        "longest response in tokens (default: 2048)",
        "0: greedy; > 0: sampling (default: 0.0)",
        "keep it, or stop (exit 2) (default: drop)",
        "OUTPUT is not written (exit 4) (default: 0.5)",
        "records generated together per rank (default: 16)",
        "requests in flight at most (default: 8)",
        "default: the target's max_position_embeddings, at most 3072",
    ):
        assert text in shown, text


def test_top_p_and_top_k_reach_the_sampler_and_the_server() -> None:
    sampled = _settings(temperature=0.6, top_p=0.95, top_k=20)

    class Model:
        def get_input_embeddings(self):
            import torch

            return torch.nn.Embedding(1, 1)

        def generate(self, **kwargs):
            self.kwargs = kwargs
            return kwargs["input_ids"]

    class Tokenizer:
        pad_token_id = 0

    model = Model()
    regen._generate(model, Tokenizer(), [[1, 2]], [3], [0], sampled, seed=1, round_trip=None)
    assert (model.kwargs["temperature"], model.kwargs["top_p"], model.kwargs["top_k"]) == (0.6, 0.95, 20)
    regen._generate(
        model, Tokenizer(), [[1, 2]], [3], [0], _settings(temperature=0.6), seed=1, round_trip=None
    )
    assert (model.kwargs["top_p"], model.kwargs["top_k"]) == (1.0, 0)  # the plain distribution

    class Client:
        def chat(self, body):
            self.body = body
            return Reply(content="ok", reasoning=None, completion_tokens=1, finish_reason="stop")

    from dflash_mp.regenerate.records import Conversation

    for settings, expected in ((sampled, {"top_p": 0.95, "top_k": 20}), (_settings(), {})):
        client = Client()
        _RecordAnswerer(client, "m", settings, None)(Conversation(0, "x:1", rest=[RECORDS[2][0]]))
        assert {key: client.body[key] for key in ("top_p", "top_k") if key in client.body} == expected


def test_bad_sampling_options_are_named() -> None:
    with pytest.raises(RegenerateError, match=r"--top-p=1.5.*--top-k=0.*--on-length='cut'.*fraction=2"):
        _settings(top_p=1.5, top_k=0, on_length="cut", min_finished_fraction=2)


def test_greedy_thinking_warns_where_the_card_advises_sampling(tmp_path: Path) -> None:
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    # Qwen3-8B's generation_config.json, and a template with its thinking switch.
    advice = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (qwen3 / "generation_config.json").write_text(json.dumps(advice))
    (qwen3 / "chat_template.jinja").write_text("{% if enable_thinking is defined %}{% endif %}")
    warning = thinking_sampling_warning(_settings(), qwen3)
    assert warning is not None and "--temperature 0.6 --top-p 0.95 --top-k 20" in warning
    assert "Qwen3-8B#best-practices" in warning
    assert (
        thinking_sampling_warning(_settings(chat_template_kwargs={"enable_thinking": False}), qwen3) is None
    )
    assert thinking_sampling_warning(_settings(temperature=0.6), qwen3) is None
    # A target whose template has no thinking switch, or that advises greedy decoding: no warning.
    (qwen3 / "chat_template.jinja").write_text("{{ messages }}")
    assert thinking_sampling_warning(_settings(), qwen3) is None
    assert thinking_sampling_warning(_settings(), embedded_path("target")) is None
    # Thinking asked for explicitly, no target to read: Qwen3's advice as the example.
    explicit = thinking_sampling_warning(_settings(chat_template_kwargs={"enable_thinking": True}), None)
    assert explicit is not None and "--temperature 0.6 --top-p 0.95 --top-k 20" in explicit
