"""Parquet, Arrow, save_to_disk directories and hf:org/name read like their JSONL twin, lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.data import (
    BadRecord,
    DataError,
    input_problem,
    load_tokenizer,
    open_records,
    parse_record,
)
from dflash_mp.runtime.roles import make_reader

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _arrow_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted Parquet files go to the test's own cache (the embedded target stays where it is)."""
    from dflash_mp.data import sources

    monkeypatch.setattr(sources, "cache_dir", lambda: tmp_path / "cache")


def _table(lines: list[str]) -> pa.Table:
    # pa.array infers one struct over every record's keys (nulls where a record has none), as
    # a data set mixing record shapes is stored.
    return pa.Table.from_struct_array(pa.array([json.loads(line) for line in lines]))


def _twins(jsonl: Path, out: Path) -> dict[str, list[str]]:
    """The JSONL file as Parquet (several row groups), Arrow file and stream, and save_to_disk."""
    import datasets

    lines = [line for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    table = _table(lines)
    pq.write_table(table, out / "data.parquet", row_group_size=max(len(lines) // 7, 1))
    with pa.OSFile(str(out / "data.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=97)
    with pa.OSFile(str(out / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=300)
    datasets.Dataset(table).save_to_disk(str(out / "saved"), num_shards=3)
    return {
        "parquet": [str(out / "data.parquet")],
        "arrow": [str(out / "data.arrow")],
        "stream": [str(out / "stream.arrow")],
        "save_to_disk": [str(out / "saved")],
    }


def _cfg(files: list[str] | None = None):
    """The embedded experiment (its bundled JSONL by default) for 3 steps on CPU."""
    overrides = ["train.device=cpu", "train.max_steps=3"]
    if files is not None:
        overrides.append(f"data.train_files=[{','.join(files)}]")
    return to_dataclass(compose_config(overrides))


def test_every_format_gives_the_micro_batches_of_its_jsonl_twin(tmp_path: Path) -> None:
    jsonl_cfg = _cfg()
    jsonl = [str(f) for f in jsonl_cfg.data.train_files]
    twins = _twins(Path(jsonl[0]), tmp_path)
    expected_reader = make_reader(jsonl_cfg, open_records(jsonl))
    per_epoch = expected_reader.order.per_epoch
    # Early and late micro-batches of the first epoch, and the start of the second.
    ms = [*range(6), per_epoch - 1, per_epoch, per_epoch + 1]
    expected = [expected_reader.read(m) for m in ms]
    for kind, files in twins.items():
        records = open_records(files)
        assert len(records) == len(open_records(jsonl)), kind
        reader = make_reader(_cfg(files), records)
        for m, want in zip(ms, expected, strict=True):
            got = reader.read(m)
            assert got.input_ids.equal(want.input_ids), (kind, m)
            assert got.loss_mask.equal(want.loss_mask), (kind, m)
            assert got.sample_ids.equal(want.sample_ids), (kind, m)


def test_parquet_and_saved_dataset_train_the_loss_column_of_their_jsonl_twin(tmp_path: Path) -> None:
    # The single-process reference trainer gives the torchrun job's loss column bit for bit
    # (tests/test_runtime_e2e.py); the data reaches both through open_records and make_reader.
    from dflash_mp.reference import reference_train

    jsonl_cfg = _cfg()
    twins = _twins(Path(jsonl_cfg.data.train_files[0]), tmp_path)

    def losses(cfg) -> list[float]:
        steps: list[dict] = []
        reference_train(cfg, on_step=steps.append)
        return [step["loss"] for step in steps]

    expected = losses(jsonl_cfg)
    assert len(expected) == 3
    assert losses(_cfg(twins["parquet"])) == expected
    assert losses(_cfg(twins["save_to_disk"])) == expected


def test_mixed_record_shapes_and_nulls_read_as_in_jsonl(tmp_path: Path) -> None:
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Yo", "reasoning_content": "think"},
                ]
            }
        ),
        json.dumps({"text": "plain text", "loss_spans": [[0, 5]]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
    ]
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    pq.write_table(_table(lines), tmp_path / "mixed.parquet")
    a, b = open_records([str(jsonl)]), open_records([str(tmp_path / "mixed.parquet")])
    for i in range(len(lines)):
        assert json.loads(b.read(i)[2]) == json.loads(a.read(i)[2])
    # A bad row is named by file and row (counted from 1), like a JSONL line.
    tokenizer = load_tokenizer(_cfg().model.target_path)
    path, row, raw = b.read_bytes(3)
    with pytest.raises(BadRecord, match=r"mixed\.parquet:4: no assistant turn"):
        parse_record(raw, path, row, tokenizer, 64)


def test_mixed_inputs_chain_in_order(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"record {i}"}) for i in range(5)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:2]) + "\n")
    pq.write_table(_table(lines[2:4]), tmp_path / "b.parquet")
    (tmp_path / "c.jsonl").write_text(lines[4] + "\n")
    records = open_records([str(tmp_path / name) for name in ("a.jsonl", "b.parquet", "c.jsonl")])
    assert [json.loads(records.read(i)[2])["text"] for i in range(5)] == [f"record {i}" for i in range(5)]
    assert [records.read(i)[:2] for i in (1, 2, 4)] == [
        (str(tmp_path / "a.jsonl"), 2),
        (str(tmp_path / "b.parquet"), 1),
        (str(tmp_path / "c.jsonl"), 1),
    ]
    assert records.paths == [str(tmp_path / name) for name in ("a.jsonl", "b.parquet", "c.jsonl")]


def test_a_new_version_of_a_parquet_file_replaces_its_cached_copy(tmp_path: Path) -> None:
    """The Arrow cache keeps one copy per Parquet file: converting a changed file removes the copy
    of its earlier version (a job still mapping it keeps reading it), not another file's copy."""
    from dflash_mp.data.sources import parquet_as_arrow

    lines = [json.dumps({"text": f"record {i}"}) for i in range(4)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    pq.write_table(_table(lines[:2]), tmp_path / "a" / "data.parquet")
    pq.write_table(_table(lines[:3]), tmp_path / "b" / "data.parquet")  # same name, other file
    first, other = (
        parquet_as_arrow(str(tmp_path / "a" / "data.parquet")),
        parquet_as_arrow(str(tmp_path / "b" / "data.parquet")),
    )
    mapped = pa.ipc.open_file(pa.memory_map(str(first))).read_all()  # a job reading the old copy
    pq.write_table(_table(lines), tmp_path / "a" / "data.parquet")  # the file changes
    second = parquet_as_arrow(str(tmp_path / "a" / "data.parquet"))
    assert second != first and not first.exists() and second.is_file() and other.is_file()
    assert sorted(p.name for p in first.parent.glob("*.arrow")) == sorted([second.name, other.name])
    assert not (first.parent / f".{first.name}.lock").exists()
    assert mapped.num_rows == 2 and open_records([str(tmp_path / "a" / "data.parquet")]).read(3)[1] == 4


def test_inputs_that_cannot_be_read_are_named_with_the_fix(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert "give one split's directory, e.g. " + str(tmp_path / "dict" / "train") in input_problem(
        str(tmp_path / "dict")
    )
    (tmp_path / "plain").mkdir()
    assert "not one written by datasets' save_to_disk" in input_problem(str(tmp_path / "plain"))
    assert input_problem(str(tmp_path / "missing.parquet")) == "file does not exist"
    assert "hf:org/name" in input_problem("hf:")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        open_records([str(tmp_path / "bad.parquet")])
    with pytest.raises(DataError, match=r"dict: a DatasetDict \(splits: train\)"):
        open_records([str(tmp_path / "dict")])


def test_config_validation_accepts_every_input_kind_and_names_a_bad_one(tmp_path: Path) -> None:
    from dflash_mp.config.validation import ConfigError, validate

    pq.write_table(_table([json.dumps({"text": "x"})]), tmp_path / "a.parquet")
    validate(_cfg([str(tmp_path / "a.parquet"), "hf:org/name:train"]), world_size=3)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"data.train_files\[0\]=.*plain.*save_to_disk"):
        validate(_cfg([str(tmp_path / "plain")]), world_size=3)


def test_hub_input_without_hub_access_fails_naming_it_and_the_way_round(tmp_path: Path) -> None:
    # This machine has no hub access; HF_HUB_OFFLINE=1 makes that immediate wherever it runs.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mp.regenerate", "--input", "hf:nobody/no-such-set:test"]
        + ["--output", str(tmp_path / "out.jsonl"), "--target", "embedded"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "hf:nobody/no-such-set:test: cannot load nobody/no-such-set (split test)" in done.stderr
    assert "save_to_disk(DIR)" in done.stderr


# Peak RSS from Linux's high-water mark, restarted after the imports (whose own peak would hide
# what follows): how far the peak rises over the RSS before is what that part costs.
MEMORY_PROBE = """
import json, re, sys
import pyarrow.parquet as pq
from dflash_mp.data import open_records

def rise_of_peak(rss_before):
    status = open("/proc/self/status").read()
    peak, rss = (int(re.search(key + r":\\s+(\\d+)", status).group(1)) * 1024 for key in ("VmHWM", "VmRSS"))
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts at the current RSS
    return peak - rss_before, rss

_, rss = rise_of_peak(0)
records = open_records([sys.argv[1]])
texts = [records.read(i)[2] for i in range(0, len(records), len(records) // 8)]
lazy, rss = rise_of_peak(rss)
table = pq.read_table(sys.argv[1])  # the control: what loading the file whole costs here
whole, _ = rise_of_peak(rss)
print(json.dumps({"records": len(records), "lazy": lazy, "whole": whole, "first": texts[0]}))
"""


def _large_parquet(path: Path, num_records: int) -> int:
    """A Parquet file of `num_records` chat records in row groups of 100k; its decoded bytes."""
    decoded = 0
    row = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("messages", pa.list_(row))])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, num_records, 100_000):
            ids = range(start, min(start + 100_000, num_records))
            questions = pa.array([f"What comes after {i}?" for i in ids])
            answers = pa.array([f"The number after {i} is {i + 1}. " * 12 for i in ids])
            roles = pa.array(["user", "assistant"] * len(ids))
            contents = pa.chunked_array([questions, answers]).combine_chunks()
            # interleave: message 2k is question k, 2k+1 its answer
            order = pa.array([k // 2 + (k % 2) * len(ids) for k in range(2 * len(ids))])
            messages = pa.StructArray.from_arrays([roles, contents.take(order)], fields=list(row))
            offsets = pa.array(range(0, 2 * len(ids) + 1, 2), pa.int32())
            table = pa.table({"messages": pa.ListArray.from_arrays(offsets, messages)})
            decoded += table.nbytes
            writer.write_table(table)
    return decoded


def test_a_million_record_parquet_file_is_not_loaded_to_read_a_few_records(tmp_path: Path) -> None:
    path = tmp_path / "large.parquet"
    decoded = _large_parquet(path, 1_000_000)
    env = {**os.environ, "DFLASH_MP_CACHE": str(tmp_path / "cache")}
    probe = [sys.executable, "-c", MEMORY_PROBE, str(path)]
    # The first open converts the file into the cache (once per cache: ranks wait for one
    # another); every later open, i.e. every rank of a job, only maps the converted copy. What
    # remains is about constant (pyarrow's allocator arenas, the batches' metadata), not the data.
    for attempt, bound in (("converts", decoded / 4), ("maps the cached copy", decoded / 10)):
        out = subprocess.run(probe, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["records"] == 1_000_000
        assert json.loads(result["first"])["messages"][0]["content"] == "What comes after 0?"
        print(
            f"{attempt}: peak RSS +{result['lazy'] / 2**20:.0f} MiB to open and read 8 records, "
            f"+{result['whole'] / 2**20:.0f} MiB to load the file whole; file "
            f"{path.stat().st_size / 2**20:.0f} MiB, decoded {decoded / 2**20:.0f} MiB"
        )
        assert result["whole"] > decoded / 2, result  # the probe sees a whole load
        assert result["lazy"] < bound, (attempt, result, decoded)
