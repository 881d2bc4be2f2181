"""The Triton kernels on a machine without a GPU: their tests (marked `triton`) in one pytest of their
own under Triton's interpreter (TRITON_INTERPRET=1; Triton is in the dev extras).

Triton reads TRITON_INTERPRET when it decorates a kernel, at import, so the variable is set for that
process alone: the suite's other processes keep Triton as it is (their kernels run on CUDA only),
and the interpreter's exit messages stay in that pytest's output. With a GPU the marked tests run
the compiled kernels in place and this test is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

KERNEL_TESTS = (
    "test_fused_ce.py",
    "test_fused_dspark.py",
    "test_streaming_adamw.py",
    "test_grouped_conv.py",
    "test_row_statistics.py",
    "test_top_k.py",
    "test_weighted_rows.py",
    "test_xpress_fused.py",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels run in their own tests")
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (pip install -e '.[dev]')"
)
def test_the_triton_kernels_pass_their_tests_under_the_interpreter() -> None:
    files = [str(REPO / "tests" / name) for name in KERNEL_TESTS]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-m", "triton", *files],
        cwd=REPO,
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line), "")
    assert proc.returncode == 0 and re.search(r"\d+ passed", summary), (
        proc.stdout[-6000:] + proc.stderr[-2000:]
    )
    assert "skipped" not in summary and "deselected" in summary, summary  # every marked test ran
