"""The launcher's stall timer and ``--hold-at`` (issue 11, case 014): a held rank is not
stalled. The time every attention rank spends held (its "hold" event, no step past it since)
is not counted; the clock starts again at the release, and a rank that then stops is a stall.
The launcher's clock is driven here (``time.monotonic`` and ``check_stall(now)``), so the
test asserts the decision at exact instants, on any machine speed."""

from __future__ import annotations

import pytest

from cuinterpose.workloads.afdwin import launcher as launcher_mod
from cuinterpose.workloads.afdwin.config import Config
from cuinterpose.workloads.afdwin.cut import RunFailed

T = 60.0  # the default --stall-timeout-s


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def run(monkeypatch, capsys):
    """A launcher of 2 attention + 2 FFN ranks held at step 10, in its running phase."""
    clock = Clock()
    monkeypatch.setattr(launcher_mod.time, "monotonic", clock)
    la = launcher_mod.Launcher(
        Config(world=4, attention=2, steps=100, hold_at=(10,)), {}, "auto", T
    )
    la.phase, la.last_change = "running", clock.now
    return la, clock


def progress(la, rank, n):
    la.on_event(rank, {"event": "progress", "rank": rank, "sent": n, "received": n, "replied": n})


def hold(la, rank, replied=20):
    la.on_event(rank, {"event": "hold", "rank": rank, "step": 10, "quiesce": 1, "replied": replied})


def stalled(la, now) -> str | None:
    try:
        la.check_stall(now)
    except RunFailed as e:
        assert e.stage == "stall"
        return str(e)
    return None


def test_time_held_is_not_counted(run):
    la, clock = run
    progress(la, 0, 20)
    progress(la, 1, 20)
    hold(la, 0)
    # one attention rank held, the other not yet: the clock runs
    assert stalled(la, clock.now + T + 1) == "no progress for 60 s (running)"
    hold(la, 1)
    # a progress event sent before the hold, arriving after it, does not end the hold
    progress(la, 1, 19)
    progress(la, 1, 20)
    for later in (T + 1, 10 * T, 1000 * T):
        assert stalled(la, clock.now + later) is None
    held_until = clock.now + 1000 * T
    # released (a SIGUSR1 or a quiesce): steps past the hold end it and the clock restarts
    clock.now = held_until + 1
    progress(la, 0, 22)
    progress(la, 1, 22)
    assert la.held == {}
    assert stalled(la, clock.now + T) is None
    assert stalled(la, clock.now + T + 0.5) == "no progress for 60 s (running)"


def test_a_rank_that_stops_after_its_release_is_a_stall(run):
    la, clock = run
    hold(la, 0)
    hold(la, 1)
    assert stalled(la, clock.now + 5 * T) is None
    clock.now += 5 * T
    # rank 0 sends step 11 (sent 22 > 20 at the hold) and its replies never come
    la.on_event(0, {"event": "progress", "rank": 0, "sent": 22, "received": 20, "replied": 20})
    assert sorted(la.held) == [1]
    assert stalled(la, clock.now + T) is None
    assert stalled(la, clock.now + T + 1) == "no progress for 60 s (running)"


def test_without_hold_events_nothing_changes(run):
    la, clock = run
    progress(la, 0, 5)
    assert stalled(la, clock.now + T) is None
    assert stalled(la, clock.now + T + 1) == "no progress for 60 s (running)"
