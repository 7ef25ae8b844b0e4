"""Every driver call the agent makes about another process has a deadline (issue 11 item 2):
``native._call`` bounds each by ``CUINTERPOSE_DRIVER_CALL_TIMEOUT_S`` (60 s default), a lock by
its own timeout plus that, and a lock "with no timeout" (``--lock-timeout-ms 0``) hands the
driver the call deadline as its timeout, so the driver gives up itself."""

from __future__ import annotations

import pytest

from cuinterpose.agent.mech import native


class _LockArgs:
    timeoutMs = None


class _Driver:
    CUcheckpointLockArgs = _LockArgs


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(native, "_driver", _Driver)
    monkeypatch.setattr(
        native,
        "_call",
        lambda action, pid, *args, deadline_s=-1.0: seen.append(
            (action, pid, [getattr(a, "timeoutMs", a) for a in args], deadline_s)
        ),
    )
    return seen


def test_a_lock_with_a_timeout_waits_that_plus_the_call_deadline(calls, monkeypatch):
    monkeypatch.delenv(native.CALL_DEADLINE_ENV, raising=False)
    native.lock(4121, 10_000)
    assert calls == [("lock", 4121, [10_000], 10.0 + 60.0)]


def test_a_lock_without_timeout_gets_the_call_deadline_as_the_drivers(calls, monkeypatch):
    monkeypatch.setenv(native.CALL_DEADLINE_ENV, "2.5")
    native.lock(4121, 0)
    assert calls == [("lock", 4121, [2500], 2.5 + 2.5)]


@pytest.mark.parametrize("value,want", [("7", 7.0), ("0", 60.0), ("nan", 60.0), ("x", 60.0)])
def test_the_call_deadline_comes_from_the_environment(monkeypatch, value, want):
    monkeypatch.setenv(native.CALL_DEADLINE_ENV, value)
    assert native.call_deadline_s() == want


def test_checkpoint_restore_unlock_and_get_state_use_the_call_deadline(calls):
    native.checkpoint(1)
    native.restore(2)
    native.unlock(3)
    assert calls == [
        ("checkpoint", 1, [None], -1.0),
        ("restore", 2, [None], -1.0),
        ("unlock", 3, [None], -1.0),
    ]
