"""Local launcher: one torchrun job per config, with its run directory and job log first.

`python -m dflash_mp.train [overrides]` outside torchrun comes here (so do `make train` and
every job of a Hydra sweep): the run directory and logs/job.log exist before torchrun
starts, torchrun's output is copied into the job log, and the log ends with the outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from dflash_mp.logs import append_job_log, job_log_path


def job_environment(run_dir: Path) -> dict[str, str]:
    """Environment for the workers: compile caches private to this job, never shared by accident."""
    env = dict(os.environ)
    cache = run_dir / "cache"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "-m",
        "dflash_mp.train",
        *overrides,
        f"run_dir={run_dir}",
    ]


def run_job(nproc: int, overrides: list[str], run_dir: Path) -> int:
    """Run one torchrun job in the foreground, its output teed into the job log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = job_log_path(run_dir)
    append_job_log(run_dir, f"launching {nproc} process(es): {' '.join(overrides)}")
    print(f"RUN_DIR={run_dir}\nJOB_LOG={log_path}", flush=True)
    command = torchrun_command(nproc, overrides, run_dir)
    started = time.time()
    with open(log_path, "ab") as job_log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_environment(run_dir)
        )
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            job_log.write(line)
            job_log.flush()
        code = process.wait()
    outcome = "succeeded" if code == 0 else "FAILED"
    append_job_log(run_dir, f"job {outcome}: exit code {code} after {time.time() - started:.1f}s")
    return code


def launch_from_hydra(dict_cfg: DictConfig) -> int:
    """Turn the current Hydra job (a single run or one job of a sweep) into a torchrun job."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("run_dir=")]
    if dict_cfg.run_dir:
        run_dir = Path(dict_cfg.run_dir)
    elif hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        run_dir = Path(hydra_cfg.sweep.dir) / str(hydra_cfg.sweep.subdir)
    else:
        run_dir = Path("runs") / f"{dict_cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    nproc = int(dict_cfg.topology.targets) + int(dict_cfg.topology.drafters)
    code = run_job(nproc, overrides, run_dir.resolve())
    if code != 0:
        raise SystemExit(code)
    return code
