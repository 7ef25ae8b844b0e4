"""Test only: ``python tests/chaos/agent_hook.py ARGS`` runs ``cuinterpose-agent ARGS`` with the
test trigger's SIGHUP (``CUINTERPOSE_TEST_SIGNAL_AT=WHEN:STEP=SIGHUP``, agent/mech/signal_at.py)
turned into a signal to another process, ``CHAOS_KILL_PID`` (a rank): ``CHAOS_SIGNAL``
(``SIGKILL``, the default, or ``SIGSTOP``). When the agent reaches the point it signals the
rank, waits until the signal took (SIGKILL: gone or a zombie; SIGSTOP: state T; 120 s
deadline), and goes on. tests/chaos/test_rank_kill.py and test_sigstop.py use it."""

from __future__ import annotations

import os
import signal
import sys
import time

from cuinterpose.agent.mech import signal_at


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except OSError:
        return True


class _Os:
    """``os`` for signal_at, with ``kill(self, SIGHUP)`` killing ``CHAOS_KILL_PID`` instead."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def kill(pid: int, sig: int) -> None:
        if pid != os.getpid() or sig != signal.SIGHUP:
            return os.kill(pid, sig)
        victim = int(os.environ["CHAOS_KILL_PID"])
        name = os.environ.get("CHAOS_SIGNAL", "SIGKILL")
        took = {"SIGKILL": _dead, "SIGSTOP": _stopped}[name]
        try:
            os.kill(victim, getattr(signal, name))
        except ProcessLookupError:
            pass  # the agent already killed the dumped tree
        deadline = time.monotonic() + 120
        while not took(victim):
            if time.monotonic() > deadline:
                raise SystemExit(f"agent_hook: pid {victim}: {name} did not take within 120 s")
            time.sleep(0.002)
        sys.stderr.write(f"agent_hook: sent {name} to pid {victim}\n")
        return None


signal_at.os = _Os()

if __name__ == "__main__":
    from cuinterpose.agent.cli import main

    sys.argv[0] = "cuinterpose-agent"
    main()
