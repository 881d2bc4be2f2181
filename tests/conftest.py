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
    # Files with the most end-to-end jobs first: xdist hands out whole files (--dist loadfile,
    # so a module's shared jobs run once), and the long ones must not be left for the end.
    slow_per_file: dict[str, int] = {}
    for item in items:
        slow_per_file[str(item.path)] = slow_per_file.get(str(item.path), 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: -slow_per_file[str(item.path)])


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


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def pytest_configure(config) -> None:
    from dflash_mp.run import startup

    startup.pause()  # collection imports torch, transformers and every test module


def pytest_collection_finish(session) -> None:
    from dflash_mp.run import startup

    startup.resume()  # frozen: the in-process tests' collections skip the imported stack
