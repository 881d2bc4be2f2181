"""Answers cut at their token budget: dropped (default), kept or fatal; the finished-fraction floor;
top-p/top-k; the warning for greedy thinking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_mp.embedded import embedded_path
from dflash_mp.regenerate import RegenerateError, Settings, main, read_parts, regenerate
from dflash_mp.regenerate import local as regen
from dflash_mp.regenerate.finish import TOO_FEW_FINISHED_EXIT_CODE, TooFewFinished, thinking_sampling_warning
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
