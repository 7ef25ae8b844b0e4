"""Every driver call the agent makes about another process has a deadline (issue 11 item 2):
``native._call`` bounds each by ``CUINTERPOSE_DRIVER_CALL_TIMEOUT_S`` (60 s default), a lock by
its own timeout plus that, and a lock "with no timeout" (``--lock-timeout-ms 0``) hands the
driver the call deadline as its timeout, so the driver gives up itself."""

from __future__ import annotations

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import native
from cuinterpose.agent.options import DriverOptions


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
    native.lock(4121, 10_000)  # outside a run: the option's default, 60 s
    assert calls == [("lock", 4121, [10_000], 10.0 + 60.0)]


def test_a_lock_without_timeout_gets_the_call_deadline_as_the_drivers(calls, monkeypatch):
    with native.using(DriverOptions(driver_call_timeout_s=2.5)):
        native.lock(4121, 0)
    assert calls == [("lock", 4121, [2500], 2.5 + 2.5)]


def test_the_call_deadline_is_the_runs_option_and_its_environment_variable_sets_it():
    assert native.call_deadline_s() == 60.0
    opts = DriverOptions.from_environ({"CUINTERPOSE_DRIVER_CALL_TIMEOUT_S": "7"})
    with native.using(opts):
        assert native.call_deadline_s() == 7.0
    assert native.call_deadline_s() == 60.0  # only within the run


@pytest.mark.parametrize("value", ["0", "nan", "x", "90000"])
def test_a_bad_call_deadline_is_refused_naming_the_variable(value):
    with pytest.raises(AgentError) as e:
        DriverOptions.from_environ({"CUINTERPOSE_DRIVER_CALL_TIMEOUT_S": value})
    assert (e.value.phase, e.value.outcome) == ("request", "refused")
    assert e.value.reason.startswith(f"$CUINTERPOSE_DRIVER_CALL_TIMEOUT_S={value!r}: must be")


def test_checkpoint_restore_unlock_and_get_state_use_the_call_deadline(calls):
    native.checkpoint(1)
    native.restore(2)
    native.unlock(3)
    assert calls == [
        ("checkpoint", 1, [None], -1.0),
        ("restore", 2, [None], -1.0),
        ("unlock", 3, [None], -1.0),
    ]
