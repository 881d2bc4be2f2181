"""Counting dynamo (re)compilations and their reasons, and where compile time went."""

from __future__ import annotations

import logging
import os
from contextlib import suppress

import torch


class RecompileLog(logging.Handler):
    """Collects dynamo's recompile reasons (the `recompiles` log artifact)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with suppress(Exception):  # a log record must never break a step
            self.messages.append(record.getMessage()[:600])


_RECOMPILE_LOG: RecompileLog | None = None


def install_recompile_log() -> None:
    """Route dynamo's recompile reasons to RecompileLog (and to stderr, unless TORCH_LOGS is set)."""
    global _RECOMPILE_LOG
    if _RECOMPILE_LOG is not None:
        return
    _RECOMPILE_LOG = RecompileLog()
    try:
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(_RECOMPILE_LOG)
    except Exception:  # older/newer torch: the frame counter below still counts
        pass


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class CompileWatch:
    """Frames dynamo (re)compiles between `start()` and `result()`: 0 after warm-up means no recompiles."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.frames0 = _frames_compiled()
        self.reasons0 = len(_RECOMPILE_LOG.messages) if _RECOMPILE_LOG else 0

    def result(self) -> dict:
        reasons = _RECOMPILE_LOG.messages[self.reasons0 :] if _RECOMPILE_LOG else []
        return {"recompiles": _frames_compiled() - self.frames0, "recompile_reasons": reasons[:5]}


def frames_compiled_total() -> int:
    return _frames_compiled()


def compile_seconds() -> dict[str, list[float]]:
    """Seconds per compilation phase so far (dynamo's `dynamo_timed` metrics), one entry per frame/graph.

    Where a cold start goes: tracing (`_compile.compile_inner`), the forward and backward inductor
    builds (`compile_fx.<locals>.fw_compiler_base`, `...bw_compiler`), waiting on Triton workers.
    """
    from torch._dynamo.utils import compilation_time_metrics

    return {name: [round(t, 2) for t in times] for name, times in compilation_time_metrics.items()}
