"""interrupt.Guard and interrupt.shielded: signals deferred to phase boundaries, and helpers
(CRIU) that a terminal's Ctrl-C cannot kill half-way."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from cuinterpose.agent.run import interrupt


def test_shielded_helper_inherits_the_blocked_signals_and_the_guard_sees_them_after():
    with interrupt.Guard("checkpoint") as g:
        with interrupt.shielded():
            out = subprocess.run(
                ["sh", "-c", "exec grep SigBlk /proc/self/status"], capture_output=True, text=True
            ).stdout
            # Ctrl-C while the helper runs, to this thread: a thread another test left behind (a
            # driver call that hit its deadline) would otherwise take a process-directed signal
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert g.pending() is None  # held back, not lost
        assert g.pending() == "SIGINT"
    blocked = int(out.split()[1], 16)
    want = (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    assert blocked & want == want
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()


def test_guard_keeps_signals_that_were_ignored_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with interrupt.Guard() as g:
            os.kill(os.getpid(), signal.SIGHUP)
            assert g.pending() is None
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
