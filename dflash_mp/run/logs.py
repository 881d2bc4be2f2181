"""Per-rank log files with rank and role in every line, plus the job's shared log.

Deliberately free of heavy imports (no torch), so a log exists before anything that can
take long or crash is imported.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

LOGGER_NAME = "dflash_mp"


def job_log_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs" / "job.log"


def append_job_log(run_dir: str | Path, message: str) -> None:
    """One line to the job log, written with O_APPEND so lines from many ranks never interleave."""
    path = job_log_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def setup_rank_logging(run_dir: str | Path, rank: int, role: str, console: bool) -> logging.Logger:
    """Log to run_dir/logs/rank{rank}-{role}.log (and stderr when `console`)."""
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank} {role}] %(levelname)s %(message)s", "%H:%M:%S")
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    file_handler = logging.FileHandler(log_dir / f"rank{rank}-{role}.log")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        logger.addHandler(stream)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
