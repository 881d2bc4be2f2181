"""The collector's pause while an entry point imports its stack (dflash_mp.run.startup)."""

from __future__ import annotations

import gc
import subprocess
import sys

from dflash_mp.run import startup
from tests.conftest import REPO


def test_pause_then_resume_restores_the_thresholds_and_freezes_what_exists() -> None:
    before = gc.get_threshold()
    startup.pause()
    try:
        assert gc.get_threshold() == (startup.STARTUP_THRESHOLD, *before[1:])
        startup.pause()  # a second pause keeps the first one's thresholds to restore
        assert gc.isenabled()  # collections still run, rarely: nothing leaks if resume never comes
    finally:
        frozen = gc.get_freeze_count()
        created = [[n] for n in range(10)]  # objects the collector tracks, made since any freeze
        startup.resume()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() >= frozen + len(created)
    startup.resume()  # not paused: nothing changes
    assert gc.get_threshold() == before


def test_importing_an_entry_point_leaves_the_importer_s_collector_alone() -> None:
    """Only a module run as the program pauses: a test or a tool that imports dflash_mp.train (the
    launcher's agent does) keeps Python's thresholds."""
    probe = "import gc; t = gc.get_threshold(); import dflash_mp.train, dflash_mp.launch.__main__; print(gc.get_threshold() == t)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
