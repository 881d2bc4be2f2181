"""On a machine without a GPU the launcher's agent forks the ranks after its imports
(dflash_mp.launch.agent); a forked rank must end like a fresh interpreter would. The process facts of a live job: test_launch's
assert_ranks_forked_from_the_agent; ranks started as fresh interpreters when asked, training as
forked ones do: test_runtime_e2e.py::test_ranks_start_as_fresh_interpreters_when_asked."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, job_env

RANK_EXIT = """
import atexit, os, sys
from pathlib import Path
from dflash_mp.launch import agent, rank as rank_program

out = Path(sys.argv[1])
atexit.register(lambda: (out / "agent-exit-handler-ran").touch())  # the agent's, not the rank's

def rank():
    how = sys.argv[1]
    atexit.register(lambda: (out / f"rank-exit-handler-ran-{how}").touch())
    (out / f"session-{how}").write_text(f"{os.getsid(0)} {os.getpid()} {sys.argv[1:]}")
    if how == "interrupt":
        raise KeyboardInterrupt
    sys.exit(int(how))

rank_program.main = rank
for how in sys.argv[2:]:  # one rank after the other, each forked from this (unchanged) agent
    pid = os.fork()  # as torchrun's fork start method does; the child then runs the rank
    if pid == 0:
        code = 0
        try:
            agent._rank_main(how)
        except SystemExit as e:  # what multiprocessing's child bootstrap does, then os._exit
            code = e.code
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(how, os.waitstatus_to_exitcode(status))
os._exit(0)
"""


def _run_forked_ranks(tmp_path, *hows: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", RANK_EXIT, str(tmp_path), *hows],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {how: int(code) for how, code in (line.split() for line in proc.stdout.splitlines())}


def test_a_forked_rank_ends_as_a_fresh_interpreter_would(tmp_path):
    """Its own exit handlers run and the agent's do not; it leads its own session; an uncaught
    Ctrl-C ends it by SIGINT (multiprocessing alone would report exit 0); sys.exit codes pass."""
    codes = _run_forked_ranks(tmp_path, "interrupt", "3")
    assert codes == {"interrupt": -signal.SIGINT, "3": 3}
    for how in codes:
        sid, pid, argv = (tmp_path / f"session-{how}").read_text().split(" ", 2)
        assert sid == pid and argv == f"[{how!r}]"
        assert (tmp_path / f"rank-exit-handler-ran-{how}").exists()
    assert not (tmp_path / "agent-exit-handler-ran").exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_with_a_gpu_visible_the_ranks_start_as_fresh_interpreters_and_train(tmp_path):
    """Forked ranks could not use CUDA (torch's agent may initialise it before it forks: seen on an
    H200), so with a GPU visible the agent is plain torchrun; a colocated job (one rank per visible
    GPU) trains and compiles on the GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run = tmp_path / "gpu"
    cmd = [
        sys.executable,
        "-m",
        "dflash_mp.train",
        f"run_dir={run}",
        "topology=colocated",
        "train.max_steps=3",
        "eval.every=0",
        "train.export=false",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    log = (run / "logs" / "job.log").read_text()
    assert proc.returncode == 0, log[-5000:]
    assert "rank(s) as fresh interpreters" in log and "job succeeded" in log, log[-5000:]
    # The target's forward runs from CUDA graphs (train.cuda_graphs=auto), captured once per shape.
    rank_log = "".join(path.read_text() for path in (run / "logs").glob("rank*.log"))
    assert "CUDA graphs: one per input shape" in rank_log, rank_log[-3000:]
    assert "captured the target forward for input shape" in rank_log, rank_log[-3000:]
    assert "CUDA graphs off" not in rank_log


def test_the_agent_refuses_a_job_it_was_not_built_for():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mp.launch.agent", "--nproc-per-node=1", "-m", "other.module"],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "runs `--standalone ... -m dflash_mp.train` jobs only" in proc.stderr


def test_a_failed_rank_ends_the_agent_in_one_line_and_the_outcome_once(capsys, tmp_path):
    """A rank's error is printed once, as the launcher's root cause: the agent says which rank(s)
    failed in one line (not torchrun's summary repeating the traceback), and an error in the user's
    data or config is given by its message alone (it names the file and the fix)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dflash_mp.launch import agent, outcome
    from dflash_mp.launch.outcome import first_failure

    def failing() -> None:
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "none.json"))
        raise ChildFailedError("_rank_main", {0: failure})

    with pytest.raises(SystemExit) as caught:
        agent._ending_on_a_signal_in_one_line(failing)
    assert caught.value.code == 1
    err = capsys.readouterr().err
    assert err == "dflash_mp agent: rank 0 exitcode: 1 (pid: 1); the root cause follows below\n"
    assert outcome._TORCHRUN_EXITCODE.findall(err) == [("1", "1")]  # the exit code the launcher reads

    stack = "Traceback (most recent call last):\n  File ...\n"
    data_error = "DataError: d.jsonl: 200 of the 2000 records are bad (10.0%)"
    for message, traceback_kept in ((data_error, False), ("RuntimeError: boom", True)):
        errors = {0: {"message": message, "traceback": stack + message, "timestamp": 1.0}}
        outcome = first_failure({}, vanished={}, errors=errors, targets=1)
        assert outcome.summary == f"first failure: rank 0 (target) raised {message}"
        assert bool(outcome.details) == traceback_kept, message
