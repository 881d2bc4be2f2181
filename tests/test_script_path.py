"""A module of the package run by its file, as `torchrun dflash_mp/train.py` runs it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_running_a_module_by_its_file_does_not_shadow_top_level_modules() -> None:
    """Python puts the script's folder first on sys.path; there dflash_mp/kernels was found as
    transformers' optional `kernels` package and the first model load raised ImportError."""
    probe = (
        "import sys, importlib.util as u; sys.path.insert(0, sys.argv[1]); import dflash_mp; "
        "print([(u.find_spec(n) and u.find_spec(n).origin) for n in ('kernels', 'data', 'config')])"
    )
    for folder in (REPO / "dflash_mp", REPO / "dflash_mp" / "launch"):
        out = subprocess.run(
            [sys.executable, "-c", probe, str(folder)], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        assert str(REPO / "dflash_mp") not in out, out
