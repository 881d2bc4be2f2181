"""Local launcher: one torchrun job per run directory; no silent failure, no zombie, no orphan.

    python -m dflash_mp.launch run    [key=value ...]   # foreground, like python -m dflash_mp.train
    python -m dflash_mp.launch start  [key=value ...]   # detached: outlives the terminal/ssh session
    python -m dflash_mp.launch status RUN_DIR
    python -m dflash_mp.launch stop   RUN_DIR [--timeout S]
    python -m dflash_mp.launch doctor [--nnodes N] [--nproc-per-node P] [--port P] [key=value ...]

The run directory is locked for the job's whole life (a second job on it is refused at once, naming
the holder); it and logs/job.log exist, and their paths are printed, before anything can fail; the
preflight checks of dflash_mp.launch.doctor pass before torchrun starts; torchrun and every rank write
into job.log; a supervisor watches the ranks' heartbeats and ends job.log with the outcome: exit
code, the first failing rank with its role, and its traceback (from the error file torchrun's
`@record` wrote for it).

Exit codes of a job (`run`, the supervisor of `start`, `python -m dflash_mp.train`):
    0  succeeded: every rank finished and exited by itself
    1  failed: a rank raised or died, also one killed by a signal after it had finished its work
       (job.log names the first one and ends with its traceback)
    2  preflight failed: bad config or environment, the run directory holds an earlier run or is
       in use by another job; no worker was started
    3  hung: a rank made no progress for watchdog.timeout_s (or was stopped/frozen)
   75  preempted: stopped from outside before any rank failed, with a checkpoint at a step
       boundary; requeue with train.resume=true
  130  interrupted by SIGINT before a checkpoint
  143  stopped by SIGTERM before a checkpoint could be written
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from dflash_mp.launch import doctor
from dflash_mp.launch.detached import STOP_TIMEOUT_S, status, stop
from dflash_mp.launch.launcher import (
    announce,
    default_run_dir,
    holding_run_dir,
    launch,
    preflight_failure,
)
from dflash_mp.launch.outcome import (
    EXIT_PREFLIGHT,
    EXIT_SUCCEEDED,
    StopRequest,
    error_files,
    judge,
    write_outcome,
)
from dflash_mp.launch.supervisor import supervise
from dflash_mp.run.rundir import CONFIG_NAME, adopt_lock


def _override(overrides: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


def _compose(overrides: list[str]) -> DictConfig:
    from dflash_mp.config.schema import compose_config

    return compose_config(overrides)


def _targets_of_run(run_dir: Path) -> int | None:
    """topology.targets from the config the ranks wrote (0: colocated; None when they never got that far)."""
    from omegaconf import OmegaConf

    try:
        return int(OmegaConf.load(run_dir / CONFIG_NAME).topology.targets)
    except Exception:  # no config.yaml yet, or not ours: roles are then named from heartbeats only
        return None


def judge_ended_job(args: argparse.Namespace) -> int:
    """The outcome of a job run by plain torchrun (the SLURM script), written like the supervisor's."""
    stop_request = None
    if args.stop_signal:
        stop_request = StopRequest(signal.Signals[args.stop_signal], args.stop_at or time.time())
    # Local ranks of several nodes share one log directory: error files name no global rank there.
    errors = error_files(args.log_dir) if args.log_dir and args.nnodes == 1 else {}
    outcome = judge(
        args.run_dir,
        args.code,
        nproc=args.world_size,
        targets=_targets_of_run(args.run_dir),
        errors=errors,
        vanished=None,
        stop=stop_request,
    )
    write_outcome(args.run_dir, outcome, args.elapsed)
    print(json.dumps({"state": outcome.state, "exit_code": outcome.exit_code, "summary": outcome.summary}))
    return outcome.exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,start,status,stop,doctor}")
    overrides_help = "Hydra overrides key=value; run_dir=PATH chooses the run directory"
    for name, text in (("run", "run a job in the foreground"), ("start", "start a job detached")):
        command = commands.add_parser(name, help=text)
        command.add_argument("overrides", nargs="*", help=overrides_help)
    command = commands.add_parser("status", help="state, exit code, last step, heartbeats, last log lines")
    command.add_argument("run_dir", type=Path)
    command = commands.add_parser("stop", help="SIGTERM the job's process group, SIGKILL after --timeout")
    command.add_argument("run_dir", type=Path)
    command.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S)
    command = commands.add_parser("doctor", help="preflight checks only")
    command.add_argument("--nnodes", type=int, default=1)
    command.add_argument("--nproc-per-node", type=int, default=None, help="default: the whole topology")
    command.add_argument("--port", type=int, default=None, help="a rendezvous port that must be free here")
    command.add_argument("overrides", nargs="*", help=overrides_help)
    command = commands.add_parser("_supervise")  # what `start` runs detached
    command.add_argument("run_dir", type=Path)
    command.add_argument("--nproc", type=int, required=True)
    command.add_argument("--targets", type=int, required=True)
    command.add_argument("--lock-fd", type=int, required=True)
    command.add_argument("overrides", nargs="*")
    command = commands.add_parser("_judge")  # the SLURM script's verdict on a plain torchrun job
    command.add_argument("run_dir", type=Path)
    command.add_argument("--code", type=int, required=True, help="srun's / torchrun's exit code")
    command.add_argument("--world-size", type=int, required=True)
    command.add_argument("--nnodes", type=int, default=1)
    command.add_argument("--log-dir", type=Path, default=None)
    command.add_argument("--stop-signal", default=None, help="a stop signal from outside, e.g. SIGUSR1")
    command.add_argument("--stop-at", type=float, default=None, help="when it came (seconds since the epoch)")
    command.add_argument("--elapsed", type=float, default=0.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "status":
        return status(args.run_dir.resolve())
    if args.command == "stop":
        return stop(args.run_dir.resolve(), args.timeout)
    if args.command == "_supervise":
        lock = adopt_lock(args.run_dir, args.lock_fd)
        return supervise(args.run_dir, args.nproc, args.targets, args.overrides, echo=False, lock=lock)
    if args.command == "_judge":
        return judge_ended_job(args)

    overrides = [o for o in args.overrides if not o.startswith("run_dir=")]
    run_dir = Path(
        _override(args.overrides, "run_dir") or default_run_dir(_override(args.overrides, "name") or "dflash")
    )
    run_dir = run_dir.resolve()
    if args.command == "doctor":
        try:
            dict_cfg = _compose(args.overrides)
        except Exception as e:  # an unknown key, a wrong type or group option, named by Hydra
            print(doctor.format_checks([doctor.Check("config", False, str(e))]))
            return EXIT_PREFLIGHT
        checks = doctor.preflight(dict_cfg, run_dir, args.nnodes, args.nproc_per_node, args.port)
        print(doctor.format_checks(checks))
        print(doctor.count_line(checks))
        return EXIT_PREFLIGHT if doctor.failed(checks) else EXIT_SUCCEEDED
    started = time.monotonic()
    try:
        dict_cfg = _compose(args.overrides)
    except Exception as e:  # an unknown key or a value of the wrong type, named by Hydra
        error = e

        def report(lock: object) -> int:
            announce(run_dir)
            return preflight_failure(run_dir, [f"config: {error}"], started)

        return holding_run_dir(run_dir, report)
    return launch(dict_cfg, overrides, run_dir, detach=args.command == "start")


if __name__ == "__main__":
    from dflash_mp.run import startup

    startup.pause()  # resumed after the preflight, or by the supervisor
    sys.exit(main())
