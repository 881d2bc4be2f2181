"""RoleClock splits wall time into busy (measured around work) and waiting (the rest)."""

import torch

from dflash_mp import clock


def test_busy_is_measured_inside_spans_and_the_rest_is_waiting(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])
    c = clock.RoleClock(torch.device("cpu"))
    now[0] += 2.0  # waiting on the other role
    with c.busy():
        now[0] += 3.0
    now[0] += 1.0
    with c.busy():
        now[0] += 0.5
    assert c.busy_s == 3.5
    assert c.wait_s == 3.0
