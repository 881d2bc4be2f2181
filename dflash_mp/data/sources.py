"""Where records come from: JSONL, Parquet, Arrow, a `datasets` save_to_disk directory, or the hub.

Every input gives a record count and record i by index as the JSON text of one record (a table's
row becomes the object of its columns), so parsing, bad records and the preflight are the same
for every format. Tables are memory-mapped Arrow: a rank touches only the pages of the rows it
reads. Parquet is compressed per column chunk and cannot be read one row at a time, so a Parquet
file is first converted, batch by batch, into an Arrow file in the cache ($DFLASH_MP_CACHE/arrow,
keyed by the file's path, size and modification time) that every later read maps; converting a
new version of a file removes the copies of its earlier versions.
"""

from __future__ import annotations

import bisect
import fcntl
import glob
import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from dflash_mp.data.errors import DataError, EmptyData
from dflash_mp.data.order import JsonlIndex
from dflash_mp.embedded import cache_dir

HUB_PREFIX = "hf:"
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
# Rows per record batch of a converted Parquet file: the unit converted at once (bounded memory).
CONVERT_BATCH_ROWS = 4096
CACHE_VERSION = 1  # bump when the cached layout changes


class Records(Protocol):
    """What the reader, the preflight, evaluation and regeneration need of an input."""

    paths: list[str]  # the files behind the records (checkpoints record their sizes)

    def __len__(self) -> int: ...

    def read_bytes(self, i: int) -> tuple[str, int, bytes]: ...

    def read(self, i: int) -> tuple[str, int, str]: ...


def input_kind(spec: str) -> str:
    """jsonl, parquet, arrow, dataset_dir or hub, from the input's name (and whether it is a directory)."""
    if spec.startswith(HUB_PREFIX):
        return "hub"
    if os.path.isdir(spec):
        return "dataset_dir"
    suffix = Path(spec).suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in ARROW_SUFFIXES:
        return "arrow"
    return "jsonl"


def input_problem(spec: str) -> str | None:
    """Why `spec` cannot be an input (None: it can), without reading its records."""
    kind = input_kind(spec)
    if kind == "hub":
        name = spec[len(HUB_PREFIX) :].partition(":")[0]
        if not name or name.count("/") > 1 or name.startswith("/"):
            return "not a hub data set: write hf:org/name or hf:org/name:split"
        return None
    if kind == "dataset_dir":
        if (Path(spec) / "state.json").is_file():
            return None
        if (Path(spec) / "dataset_dict.json").is_file():
            return _dataset_dict_problem(Path(spec))
        return "a directory, but not one written by datasets' save_to_disk (no state.json)"
    if not os.path.isfile(spec):
        return "file does not exist"
    return None


def open_records(specs: Sequence[str | Path]) -> Records:
    """The records of the inputs, one input after another; DataError names the input that fails."""
    specs = [str(spec) for spec in specs]
    for spec in specs:
        problem = input_problem(spec)
        if problem is not None and input_kind(spec) != "jsonl":  # JsonlIndex names a missing file
            raise DataError(f"{spec}: {problem}")
    # Consecutive JSONL files stay one index: the same records and messages as before.
    sources: list[Records] = []
    for is_jsonl, group in itertools.groupby(specs, lambda spec: input_kind(spec) == "jsonl"):
        group = list(group)
        sources.extend([JsonlIndex(group)] if is_jsonl else [_open_table(spec) for spec in group])
    if not sources:
        return JsonlIndex([])  # raises: no files given
    return sources[0] if len(sources) == 1 else ChainedRecords(sources)


class ChainedRecords:
    """Several inputs' records, numbered one input after another."""

    def __init__(self, sources: Sequence[Records]) -> None:
        self.sources = list(sources)
        self.paths = [path for source in self.sources for path in source.paths]
        self._ends = list(itertools.accumulate(len(source) for source in self.sources))

    def __len__(self) -> int:
        return self._ends[-1]

    def _locate(self, i: int) -> tuple[Records, int]:
        k = bisect.bisect_right(self._ends, i)
        return self.sources[k], i - (self._ends[k - 1] if k else 0)

    def read_bytes(self, i: int) -> tuple[str, int, bytes]:
        source, j = self._locate(i)
        return source.read_bytes(j)

    def read(self, i: int) -> tuple[str, int, str]:
        source, j = self._locate(i)
        return source.read(j)


class TableRecords:
    """The rows of an Arrow table, record i read as its row's JSON (numbered from 1 in messages)."""

    def __init__(self, name: str, table: Any, paths: Sequence[str]) -> None:
        self.name, self.paths = name, list(paths)
        self._batches = [batch for batch in table.to_batches() if batch.num_rows]  # zero-copy views
        self._ends = list(itertools.accumulate(batch.num_rows for batch in self._batches))
        if not self._batches:
            raise EmptyData(f"no records in {name}: the table has no rows")

    def __len__(self) -> int:
        return self._ends[-1]

    def read_bytes(self, i: int) -> tuple[str, int, bytes]:
        """(input, 1-based row, the row as UTF-8 JSON)."""
        k = bisect.bisect_right(self._ends, i)
        row = self._batches[k].slice(i - (self._ends[k - 1] if k else 0), 1).to_pylist()[0]
        # Arrow gives a struct every field of its column, null where a record had none: dropping
        # nulls gives back the record as JSON had it. default=str: a timestamp column is no error.
        text = json.dumps(_without_nulls(row), ensure_ascii=False, default=str)
        return self.name, i + 1, text.encode()

    def read(self, i: int) -> tuple[str, int, str]:
        name, row, raw = self.read_bytes(i)
        return name, row, raw.decode()


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _open_table(spec: str) -> TableRecords:
    kind = input_kind(spec)
    if kind == "hub":
        return _hub_records(spec)
    if kind == "parquet":
        return TableRecords(spec, read_arrow(parquet_as_arrow(spec), spec), [spec])
    if kind == "arrow":
        return TableRecords(spec, read_arrow(Path(spec), spec), [spec])
    return _saved_dataset(Path(spec))


def read_arrow(path: Path, spec: str) -> Any:
    """The table of an Arrow IPC file or stream, memory-mapped (no copy of its buffers)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        reader = pa.ipc.open_file(source) if source.read(6) == b"ARROW1" else _stream(source)
        return reader.read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(
            f"{spec}: not a readable Arrow IPC file or stream ({e}); give JSONL, Parquet, Arrow or a "
            "save_to_disk directory"
        ) from None


def _stream(source: Any) -> Any:
    import pyarrow as pa

    source.seek(0)
    return pa.ipc.open_stream(source)


def parquet_as_arrow(spec: str) -> Path:
    """The Arrow copy of a Parquet file in the cache, converted on first use (one process at a time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stat = os.stat(spec)
    source = hashlib.sha256(os.path.abspath(spec).encode()).hexdigest()[:12]
    version = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{CACHE_VERSION}".encode()).hexdigest()[:12]
    final = cache_dir() / "arrow" / f"{Path(spec).stem}-{source}-{version}.arrow"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Every rank opens the data at once: one converts, the others wait and map its result.
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return final
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
        try:
            # Page by page, one thread: memory stays near a batch, whatever the row groups' size.
            parquet = pq.ParquetFile(spec, pre_buffer=False, buffer_size=1 << 20)
            with os.fdopen(fd, "wb") as sink, pa.ipc.new_file(sink, parquet.schema_arrow) as writer:
                for batch in parquet.iter_batches(batch_size=CONVERT_BATCH_ROWS, use_threads=False):
                    writer.write_batch(batch)
            os.chmod(tmp, 0o644)  # a shared cache must be readable by all
            os.replace(tmp, final)
            _drop_superseded(final, f"{Path(spec).stem}-{source}-")
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{spec}: not a readable Parquet file ({e})") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return final


def _drop_superseded(final: Path, prefix: str) -> None:
    """Remove the cached copies of earlier versions of the same Parquet file (another size or
    modification time), which would otherwise pile up in the cache. A job still reading one keeps
    its memory map: the file's data lives until the last map of it goes."""
    for old in final.parent.glob(f"{glob.escape(prefix)}*.arrow"):
        if old != final:
            old.unlink(missing_ok=True)
            (old.parent / f".{old.name}.lock").unlink(missing_ok=True)


def _saved_dataset(directory: Path) -> TableRecords:
    """A Dataset written by datasets' save_to_disk: its Arrow files, in order, as one table."""
    import pyarrow as pa

    problem = input_problem(str(directory))
    if problem is not None:
        raise DataError(f"{directory}: {problem}")
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{directory}/state.json: not a save_to_disk state ({e})") from None
    tables = [read_arrow(path, str(path)) for path in files]
    table = pa.concat_tables(tables) if tables else pa.table({})
    return TableRecords(str(directory), table, [str(path) for path in files])


def _dataset_dict_problem(directory: Path) -> str:
    try:
        splits = json.loads((directory / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = []
    example = directory / (splits[0] if splits else "train")
    return (
        f"a DatasetDict (splits: {', '.join(map(str, splits)) or 'unknown'}): give one split's "
        f"directory, e.g. {example}"
    )


def _hub_records(spec: str) -> TableRecords:
    """hf:org/name[:split] (default split train) through `datasets`, cached as datasets caches it."""
    name, _, split = spec[len(HUB_PREFIX) :].partition(":")
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{spec}: reading from the Hugging Face hub needs the datasets package: "
            "pip install 'dflash_mp[hf]'"
        ) from None
    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline, unknown name, unknown split, network: all say the same to the user
        raise DataError(
            f"{spec}: cannot load {name} (split {split or 'train'}) from the Hugging Face hub "
            f"({type(e).__name__}: {str(e)[:300]}). Where the hub is not reachable, save it on a "
            "machine where it is (load_dataset(...).save_to_disk(DIR), or its Parquet files) and "
            "give that directory or those files"
        ) from None
    if dataset._indices is not None:
        dataset = dataset.flatten_indices()
    files = [entry["filename"] for entry in dataset.cache_files]
    return TableRecords(spec, dataset.data.table, files)
