"""Every socket wait has a deadline (issue 11 item 2): a streaming call to a daemon that never
answers ends with the default deadline ``$CUINTERPOSE_RPC_TIMEOUT_S`` (DEADLINE_EXCEEDED,
outcome "unreachable", the address and method named), and a bad value of the variable is
refused by name before anything is sent. The silent daemon is a listening socket that
accepts and never speaks HTTP/2."""

from __future__ import annotations

import socket

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb


def test_a_silent_daemon_ends_the_call_at_the_default_deadline(monkeypatch):
    monkeypatch.setenv(client.RPC_TIMEOUT_ENV, "0.5")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        addr = f"127.0.0.1:{srv.getsockname()[1]}"
        apb, _, _ = pb.modules()
        with pytest.raises(AgentError) as ei:
            client.call(addr, "Inspect", apb.InspectRequest())
    assert ei.value.outcome == "unreachable"
    assert ei.value.reason.startswith(f"{addr}: Inspect: DEADLINE_EXCEEDED")


@pytest.mark.parametrize("raw", ["0", "-3", "nan", "inf", "later"])
def test_a_bad_rpc_deadline_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(client.RPC_TIMEOUT_ENV, raw)
    with pytest.raises(AgentError) as ei:
        client.rpc_timeout_s()
    assert ei.value.outcome == "refused"
    assert f"CUINTERPOSE_RPC_TIMEOUT_S={raw!r}: must be a finite number of seconds above 0" in str(
        ei.value
    )


def test_the_default_rpc_deadline(monkeypatch):
    monkeypatch.delenv(client.RPC_TIMEOUT_ENV, raising=False)
    assert client.rpc_timeout_s() == 7200.0
