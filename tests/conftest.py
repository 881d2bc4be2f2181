"""Shared fixtures: the stock-layout Qwen3 target, helpers to run real jobs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4, on CPU. With a GPU the
    suite runs in one process: GPU tests share one device and some count its synchronisations."""
    if _has_gpu():
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _triton_skip_reason(has_gpu: bool) -> str | None:
    """Why a `triton` test cannot run its kernel here (None: it can)."""
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (pip install -e '.[dev]')"
    if not has_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        return "a Triton kernel: on CUDA, or on the CPU in tests/test_triton_interpreter.py's interpreter run"
    return None


def pytest_collection_modifyitems(config, items):
    has_gpu = _has_gpu()
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    triton_reason = _triton_skip_reason(has_gpu)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
        elif item.get_closest_marker("triton") and triton_reason is not None:
            item.add_marker(pytest.mark.skip(reason=triton_reason))
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return  # one process: the files' own order (GPU tests share compile caches across files)
    # The longest files first: xdist hands out whole files (--dist loadfile, so a module's shared
    # jobs run once) in this order (pytest_configure turns off xdist's own order, by number of tests,
    # which leaves the long files of few tests for the end: one worker runs them, the other idles).
    cost: dict[str, float] = {}
    for item in items:
        cost[str(item.path)] = cost.get(str(item.path), 0.0) + _item_cost(item)
    for path in cost:
        cost[path] = FILE_SECONDS.get(Path(path).name, cost[path])
    items.sort(key=lambda item: -cost[str(item.path)])


# What a file takes on one worker of the 2-core CI machine (seconds, CPU or wall, whichever is more:
# waits on a job's timeouts hold the worker too), measured on 2026-12-06 per test (own and
# children's CPU time from getrusage, and wall time). Only the order of the files follows from it:
# a file missing here, or a number out of date, costs time, not correctness. A file not listed is
# estimated from its tests (`_item_cost`).
FILE_SECONDS = {
    "test_faults.py": 95,
    "test_launch.py": 94,
    "test_target_families.py": 92,
    "test_runtime_e2e.py": 72,
    "test_bench.py": 70,
    "test_bench_layouts.py": 58,
    "test_watchdog.py": 40,
    "test_eval.py": 39,
    "test_target_parallel.py": 38,
    "test_launch_batch.py": 37,
    "test_resume_e2e.py": 32,
    "test_stock_target.py": 28,
    "test_xpress_export.py": 23,
    "test_empty_micro_batches.py": 20,
    "test_packed_target.py": 16,
    "test_regenerate.py": 16,
    "test_transport.py": 16,
    "test_flash_attention.py": 16,
    "test_packing_e2e.py": 16,
    "test_colocated.py": 14,
    "test_regenerate_served.py": 13,
    "test_data_sources.py": 13,
    "test_target_parallel_moe.py": 12,
    "test_dflash2_decoding.py": 12,
    "test_activation_checkpointing.py": 12,
    "test_xpress_e2e.py": 12,
}


def _item_cost(item) -> float:
    """A test's guessed seconds: an end-to-end job (`slow`) about 7, any other test a tenth."""
    return 7.0 if "slow" in item.keywords else 0.1


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """torchrun gives every worker OMP_NUM_THREADS=1; in-process reference runs must reduce in the
    same order to be compared with them bit for bit (thread counts change float summation order)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def stock_qwen3_target() -> Path:
    """A stock-layout Qwen3 directory (Qwen's real vocabulary, no <|MASK|>, tiny random weights)."""
    from tests.stock_qwen3 import ensure_stock_target

    return ensure_stock_target()


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # 3 ranks on 2 cores: no oversubscription
    return env


# Jobs of tests that read no plots draw none (1.5 CPU-seconds a job); test_runtime_e2e's 2+1 job does.
NO_PLOTS = "logger.plots=false"


def run_train(
    run_dir: Path, *overrides: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
    """`python -m dflash_mp.train` as a user runs it (it starts torchrun itself); no plots unless
    `overrides` set logger.plots."""
    plots = () if any(o.startswith("logger.plots=") for o in overrides) else (NO_PLOTS,)
    cmd = [sys.executable, "-m", "dflash_mp.train", f"run_dir={run_dir}", *overrides, *plots]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_tiny_colocated_sweep(
    tmp_path: Path, *overrides: str, timeout: float
) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m dflash_mp.train -m` over `overrides` (comma lists sweep): each point two steps of
    one colocated rank of a shrunk real-target recipe on 16 bundled records, its own torchrun job,
    started by one launcher process. Returns the sweep directory (points/<n>.json) and the process."""
    from dflash_mp.embedded import embedded_path

    train = tmp_path / "train.jsonl"
    train.write_text("".join(embedded_path("data/train.jsonl").read_text().splitlines(True)[:16]))
    recipe = [
        "experiment=custom",  # a real target's recipe, shrunk
        "model.draft_layers=2",
        "model.block_size=4",
        "topology=colocated",
        "topology.drafters=1",  # one rank (on CPU the launcher needs the count)
        "train.max_steps=2",
        f"data.train_files=[{train}]",
        "data.max_length=64",
        "data.num_anchors=4",
        "eval.every=0",
        NO_PLOTS,
    ]
    sweep = tmp_path / "sweep"
    job = subprocess.run(
        [sys.executable, "-m", "dflash_mp.train", "-m", *recipe, *overrides],
        cwd=REPO, env=job_env() | {"DFLASH_SWEEP_DIR": str(sweep)}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return sweep, job


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def pytest_configure(config) -> None:
    from dflash_mp.run import startup

    # --no-loadscope-reorder (pytest-xdist >= 3.8): files go out in pytest_collection_modifyitems'
    # order. Set here rather than in addopts, which older pytest-xdist would refuse.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False

    startup.pause()  # collection imports torch, transformers and every test module


def pytest_collection_finish(session) -> None:
    from dflash_mp.run import startup

    startup.resume()  # frozen: the in-process tests' collections skip the imported stack
