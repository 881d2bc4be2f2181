"""RoleClock splits wall time into busy (measured around work) and waiting (the rest)."""

import torch

from dflash_mp.runtime import clock


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


def test_a_pause_inside_a_busy_span_counts_as_waiting(monkeypatch):
    # A drafter receives the next micro-batch inside its optimizer step (roles.run_drafter).
    now = [0.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])
    c = clock.RoleClock(torch.device("cpu"))
    with c.busy():
        now[0] += 3.0
        with c.paused():
            now[0] += 5.0
        now[0] += 1.0
    with c.paused():  # outside a busy span: waiting anyway
        now[0] += 2.0
    assert c.busy_s == 4.0
    assert c.wait_s == 7.0
