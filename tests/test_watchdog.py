"""A rank's own watchdog and the fault hook (DFLASH_MP_FAULT) in real processes: faults fire
once each in order, a hang ends with EXIT_HUNG, and a rank waiting on a stuck or frozen peer names
that peer, also in a job under plain torchrun where no launcher watches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_mp.runtime.watchdog import EXIT_HUNG, FAULT_ENV, FAULT_EXIT_CODE, read_heartbeats
from tests.conftest import REPO, job_env
from tests.test_faults import FAST, last_lines, leftovers, wait_until


def test_several_faults_fire_once_each_in_the_order_given(tmp_path):
    """DFLASH_MP_FAULT="A;B": A fires at its step, then B at its own, each once; another rank's are ignored."""
    script = textwrap.dedent(f"""
        import time
        from dflash_mp.runtime import watchdog
        watchdog.start({str(tmp_path)!r}, rank=1, role="drafter", timeout_s=30.0)
        for step in range(4):
            for phase in ("compute", "optimizer"):
                started = time.monotonic()
                watchdog.beat(phase, step)
                print(step, phase, round(time.monotonic() - started, 1), flush=True)
    """)
    spec = (
        "rank=0,step=0,kind=raise ; rank=1,step=1,phase=compute,kind=stall,seconds=1;rank=1,step=2,kind=raise"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=job_env() | {FAULT_ENV: spec},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[:2] for line in lines] == [
        ["0", "compute"],
        ["0", "optimizer"],
        ["1", "compute"],
        ["1", "optimizer"],
    ]
    assert float(lines[2][2]) >= 1.0 and float(lines[3][2]) < 1.0  # the stall, once
    assert "RuntimeError: injected fault at step 2 in phase 'compute'" in proc.stderr


@pytest.mark.parametrize("kind, code", [("raise", 1), ("exit", FAULT_EXIT_CODE), ("hang", EXIT_HUNG)])
def test_fault_hook_and_in_process_watchdog(tmp_path, kind, code):
    """DFLASH_MP_FAULT fires at the first heartbeat of its step; a hang ends with EXIT_HUNG."""
    script = textwrap.dedent(f"""
        from dflash_mp.runtime import watchdog
        watchdog.start({str(tmp_path)!r}, rank=1, role="target", timeout_s=1.0)
        watchdog.beat("tokenize", 2)
        print("survived step 2", flush=True)
        watchdog.beat("forward", 3)
        print("survived step 3", flush=True)
    """)
    env = job_env() | {FAULT_ENV: f"rank=1,step=3,kind={kind}"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code, proc.stderr
    assert "survived step 2" in proc.stdout and "survived step 3" not in proc.stdout
    if kind == "raise":
        assert "RuntimeError: injected fault at step 3 in phase 'forward'" in proc.stderr
    if kind == "hang":
        assert time.monotonic() - started < 50  # the 1 s watchdog fired, not the 60 s timeout
        log = last_lines(tmp_path, 20)
        assert "watchdog: rank 1 (target) no progress for" in log and "in phase 'forward' at step 3" in log
        assert "in fire" in log  # the main thread's stack shows where it hangs
        assert read_heartbeats(tmp_path)[1]["state"] == "hung"


WAITING_RANK = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from dflash_mp.runtime import watchdog
    watchdog.PEER_GRACE_S = 2.0  # the same rules, sooner
    run_dir, me, my_phase, peer = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    (run_dir / "heartbeats").mkdir(parents=True)
    frozen = peer.pop("frozen")
    beat = dict(host="h", pid=1, state="running", progress_at=time.time(), timeout_s=2.0)
    beat |= dict(stop_requested=None, error=None, blame=None, exited=False) | peer

    def peer_heartbeat():  # a live peer's watchdog thread goes on writing; a frozen one's does not
        while True:
            # Written and renamed, as a real heartbeat is: a half-written file reads as no peer.
            path = run_dir / "heartbeats" / f"rank{peer['rank']}.json"
            path.with_suffix(".tmp").write_text(json.dumps(beat | dict(written_at=time.time())))
            path.with_suffix(".tmp").replace(path)
            if frozen:
                return
            time.sleep(0.5)

    threading.Thread(target=peer_heartbeat, daemon=True).start()
    watchdog.start(run_dir, rank=me["rank"], role=me["role"], timeout_s=2.0)
    watchdog.beat(my_phase, me["step"])
    time.sleep(60)
""")


@pytest.mark.parametrize(
    "me, my_phase, peer",
    [
        # A SIGSTOPped target: the drafter waiting to receive from it must not report itself.
        (
            dict(rank=1, role="drafter", step=3),
            "receive",
            dict(rank=0, role="target", phase="forward", step=15, frozen=True),
        ),
        # A slow evaluation on the first drafter: the second one waits for it in the all-reduce.
        (
            dict(rank=2, role="drafter", step=5),
            "compute",
            dict(rank=1, role="drafter", phase="eval", step=5, frozen=False),
        ),
    ],
    ids=["frozen-target", "drafter-evaluating"],
)
def test_a_rank_waiting_on_a_stuck_peer_names_that_peer(tmp_path, me, my_phase, peer):
    from dflash_mp.launch.outcome import first_failure

    proc = subprocess.run(
        [sys.executable, "-c", WAITING_RANK, str(tmp_path), json.dumps(me), my_phase, json.dumps(peer)],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EXIT_HUNG, proc.stderr
    log = last_lines(tmp_path, 10)
    waiter, stuck = f"rank {me['rank']} ({me['role']})", f"rank {peer['rank']} ({peer['role']})"
    assert (
        f"watchdog: {waiter} waited" in log
        and f"in phase {my_phase!r} at step {me['step']} for {stuck}" in log
    )
    assert f"in phase {peer['phase']!r} at step {peer['step']}" in log, log
    beats = read_heartbeats(tmp_path)
    assert beats[me["rank"]]["state"] == "hung" and beats[me["rank"]]["blame"]["rank"] == peer["rank"]
    outcome = first_failure(beats, vanished={}, errors={}, targets=1)
    assert outcome.exit_code == EXIT_HUNG
    assert outcome.summary.startswith(
        f"{stuck} hung: no progress in phase {peer['phase']!r} at step {peer['step']}"
    )
    assert f"{waiter} waited for it in phase {my_phase!r}" in outcome.summary
    why = "stopped or frozen" if peer["frozen"] else "it has made no progress for"
    assert why in outcome.summary


@pytest.mark.slow
def test_under_plain_torchrun_the_drafter_names_the_stopped_target(tmp_path):
    """No launcher watches: the drafter's own watchdog, waiting to receive, names the frozen target."""
    run = tmp_path / "plain-sigstop"
    env = job_env() | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    # 10 s: short for the test, long enough that a loaded machine's slow first steps are no "hang".
    job = ["topology.targets=1", "topology.drafters=1", "train.max_steps=100000", "watchdog.timeout_s=10"]
    with open(tmp_path / "torchrun.out", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            + [
                "--max-restarts=0",
                "--monitor-interval=0.2",
                "-m",
                "dflash_mp.train",
                f"run_dir={run}",
                *job,
                *FAST,
            ],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            metrics = run / "metrics.jsonl"
            steps = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
            wait_until(lambda: steps() >= 2 or proc.poll() is not None, 120, "step 2")
            assert proc.poll() is None, f"the job ended early:\n{last_lines(run, 30)}"
            target = read_heartbeats(run)[0]
            os.kill(target["pid"], signal.SIGSTOP)
            blamed = lambda: read_heartbeats(run)[1]["blame"] is not None  # noqa: E731
            wait_until(lambda: blamed() or proc.poll() is not None, 120, "the drafter to name the target")
            # Named: the frozen target goes now. torchrun would SIGKILL it only after 30 s (its
            # teardown after a failed worker ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT).
            os.kill(target["pid"], signal.SIGKILL)
            assert proc.wait(timeout=120) != 0
        finally:
            for pid in leftovers(run, proc.pid):
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait()
    log = (run / "logs" / "job.log").read_text()
    assert "watchdog: rank 1 (drafter) waited" in log and "for rank 0 (target), in phase" in log, log[-3000:]
    assert "the process is stopped or frozen" in log
    assert read_heartbeats(run)[1]["blame"]["rank"] == 0
