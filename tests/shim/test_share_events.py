"""IPC events under the shim (docs/shim.md "IPC events"; issue 24): an interprocess event gets a
virtual CUevent and a virtual IPC handle; a wait in the opener follows the creator's records;
the capture drains and destroys the driver events (fakecuda's native checkpoint refuses live IPC
events: tests/fakecuda/test_fakecuda_share.py), the restore re-creates them in the creator and
re-opens them in the opener, and the application's CUevent values and handles keep working,
also a handle first opened after the cut and an opened event whose creator destroyed its own.
Processes are ``fcshare`` (share_kit.py), plain and under ASan/UBSan."""

from __future__ import annotations

import socket

from cuinterpose.coordinator.protocol import IpcEventHandle, Op, Phase, Status

from .share_kit import IPC_EVENT_FLAGS, checkpoint_cycle, fcshare_shim_exe, share_procs  # noqa: F401


def _pair(share_procs):  # noqa: F811
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = share_procs(sa.fileno()), share_procs(sb.fileno())
    sa.close()
    sb.close()
    c = share_procs(shim=False)  # the native-checkpoint controller
    for p in (a, b, c):
        p.cmd("init 0")
    return a, b, c


def _ordered(a, b, e, eb, s, t, flag, mark, n):
    """a's stream s blocks until flag >= n, then records e; b's stream t waits on eb, then
    writes n into mark: mark stays below n until a releases s."""
    a.cmd(f"waitval {s} {flag} {n}")
    a.cmd(f"evrecord {e} {s}")
    b.cmd(f"evwait {t} {eb}")
    b.cmd(f"writeval {t} {mark} {n}")
    assert b.err(f"query {t}") == "CUDA_ERROR_NOT_READY"
    assert b.err(f"evquery {eb}") == "CUDA_ERROR_NOT_READY"
    assert int(b.cmd(f"read {mark}")[0]) < n
    a.cmd(f"write {flag} {n}")
    b.cmd(f"sync {t}")
    assert b.cmd(f"read {mark}") == [str(n)]


def test_ipc_event_survives_a_checkpoint(share_procs, shim_env, fake_log):  # noqa: F811
    a, b, c = _pair(share_procs)
    e = a.hex(f"evcreate {IPC_EVENT_FLAGS}")
    handle = a.cmd(f"evget {e}")[0]
    h = IpcEventHandle.unpack(bytes.fromhex(handle))  # protocol.h struct cui_ipc_event_handle
    assert (h.creator_pid, h.flags, h.secret != 0) == (a.pid, IPC_EVENT_FLAGS, True)
    assert a.cmd(f"evget {e}")[0] == handle  # the same handle on every call
    created = fake_log.calls(pid=a.pid, fn="cuEventCreate")
    assert len(created) == 1 and created[0][1]["event"] != hex(e)  # the app's value is virtual
    eb = b.hex(f"evopen {handle}")
    s, t = int(a.cmd("stream")[0]), int(b.cmd("stream")[0])
    flag, mark = a.hex("malloc 64"), b.hex("malloc 64")
    a.cmd(f"write {flag} 0")
    b.cmd(f"write {mark} 0")
    _ordered(a, b, e, eb, s, t, flag, mark, 1)
    mark_log = fake_log.mark()
    checkpoint_cycle(shim_env, [a, b], c)  # raises unless every phase succeeded
    # the capture drained and destroyed both driver events; the restore made new ones
    assert [x[2] for x in fake_log.calls(pid=a.pid, fn="cuEventSynchronize", since=mark_log)] == [
        "CUDA_SUCCESS"
    ]
    assert len(fake_log.calls(pid=a.pid, fn="cuEventDestroy_v2", since=mark_log)) == 1
    assert len(fake_log.calls(pid=b.pid, fn="cuEventDestroy_v2", since=mark_log)) == 1
    recreated = fake_log.calls(pid=a.pid, fn="cuEventCreate", since=mark_log)
    assert [x[1]["flags"] for x in recreated] == [str(IPC_EVENT_FLAGS)]
    assert len(fake_log.calls(pid=b.pid, fn="cuIpcOpenEventHandle", since=mark_log)) == 1
    # the same CUevent values order the two processes again
    _ordered(a, b, e, eb, s, t, flag, mark, 2)
    # a handle taken before the cut, first opened after it (a message still queued at the cut)
    eb2 = b.hex(f"evopen {handle}")
    _ordered(a, b, e, eb2, s, t, flag, mark, 3)
    for p, ev in ((b, eb), (b, eb2), (a, e)):
        p.cmd(f"evdestroy {ev}")
    assert b.err(f"evquery {eb}") == "CUDA_ERROR_INVALID_HANDLE"


def test_opened_event_whose_creator_destroyed_it(share_procs, shim_env, fake_log):  # noqa: F811
    """PyTorch's consumer keeps the event it opened; the producer destroys its own once the
    block is released. After a restore a completed local event stands in for it."""
    a, b, c = _pair(share_procs)
    e = a.hex(f"evcreate {IPC_EVENT_FLAGS}")
    eb = b.hex(f"evopen {a.cmd(f'evget {e}')[0]}")
    a.cmd(f"evdestroy {e}")
    mark_log = fake_log.mark()
    checkpoint_cycle(shim_env, [a, b], c)  # raises unless every phase succeeded
    stand_in = fake_log.calls(pid=b.pid, fn="cuEventCreate", since=mark_log)
    assert [x[1]["flags"] for x in stand_in] == ["2"]  # CU_EVENT_DISABLE_TIMING
    b.cmd(f"evquery {eb}")
    t = int(b.cmd("stream")[0])
    b.cmd(f"evwait {t} {eb}")  # a wait on it returns at once
    b.cmd(f"sync {t}")
    b.cmd(f"evdestroy {eb}")


def test_plain_events_pass_through(share_procs, fake_log):  # noqa: F811
    a = share_procs()
    a.cmd("init 0")
    e = a.hex("evcreate 2")  # no CU_EVENT_INTERPROCESS: the driver's own event
    assert fake_log.calls(pid=a.pid, fn="cuEventCreate")[0][1]["event"] == hex(e)
    assert a.err(f"evget {e}") == "CUDA_ERROR_INVALID_HANDLE"  # the driver's answer


def test_foreign_ipc_event_refused_at_inspect(share_procs, ctl):  # noqa: F811
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    creator, opener = share_procs(sa.fileno(), shim=False), share_procs(sb.fileno())
    sa.close()
    sb.close()
    creator.cmd("init 0")
    opener.cmd("init 0")
    e = creator.hex(f"evcreate {IPC_EVENT_FLAGS}")
    head = creator.cmd(f"evget {e}")[0][:16]
    creator.cmd(f"evsend {e}")
    eb = opener.hex("evrecv")
    r = ctl(opener.pid).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.REFUSED_STATE
    assert r.message == (
        f"INSPECT: pid {opener.pid} opened a driver CUDA IPC event handle {head}... (event {hex(eb)}; not a "
        "cuinterpose handle: its creator does not run under the shim); native checkpoint cannot carry IPC "
        "events: destroy the event, or run its creator under the shim"
    )
    opener.cmd(f"evdestroy {eb}")
    r = ctl(opener.pid).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.OK, r.message
