"""One streamed request of the agent's gRPC service (agent/rpc/service.py): :class:`Stream`
runs the request's work in a thread and turns its Reporter events into ``cuinterpose.v1.Event``
messages (:func:`progress_dict`: a Progress row; a final Result), logs the request's start and
outcome, and stops the work when the client cancels the call (D73)."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from typing import Callable, Iterator, Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run import interrupt
from cuinterpose.agent.run.report import Phase, Reporter
from cuinterpose.agent.snapshot import pb

log = logging.getLogger("cuinterpose.service")
#: the daemon's request numbers (its log's ``request N``)
_request_ids = itertools.count(1)
#: what a cancelled call's run is stopped by (its error's "interrupted by ...")
CLIENT_CANCELLED = "the client's cancellation"
#: what a run cancelled before it started left (its refusal's words)
CHECKPOINT_LEFT = "nothing was torn down, the workload keeps running"
RESTORE_LEFT = "nothing was changed, the snapshot is untouched"


# -- events ------------------------------------------------------------------------------------


def progress_dict(event: str, ph: Optional[Phase] = None, text: str = "", **extra) -> dict:
    """A Progress row as a dict (the fields of ``cuinterpose.v1.Progress``). ``event``:
    start, progress, end, note. A ``progress`` row (a phase moving bytes, while it runs):
    ``bytes`` done so far, ``elapsed_ns`` since the phase started, ``detail`` "D of T (P%),
    R/s, ETA E" (``Phase.progress_text``), and total/rate/ETA in their own fields where the
    schema has them (:func:`_progress_fields`)."""
    d = {
        "event": event,
        "phase": "",
        "status": "",
        "node": "",
        "pid": 0,
        "bytes": 0,
        "elapsed_ns": 0,
        "detail": "",
        "group_phase": "",
        "text": text,
    }
    if ph is not None:
        d.update(
            phase=ph.name,
            status=ph.status,
            bytes=int(ph.bytes),
            elapsed_ns=int(ph.elapsed_ns),
            detail=ph.detail,
        )
        if event == "progress":
            import time

            d.update(
                elapsed_ns=max(0, time.monotonic_ns() - ph.start_ns) if ph.start_ns else 0,
                detail=ph.progress_text(),
            )
            d.update(
                total_bytes=int(ph.total_bytes),
                rate_bytes_per_s=float(ph.rate_bps),
                eta_ns=int(ph.eta_ns),
            )
    d.update({k: v for k, v in extra.items() if v is not None})
    return d


def error_dict(e: AgentError) -> dict:
    d = e.to_dict()
    d["node"] = getattr(e, "node", "") or ""
    return d


class Stream:
    """Runs ``work(reporter, emit)`` in a thread and turns what it reports into ``Event``s.

    ``work`` returns ``(json_object, manifest_or_None)``; an ``AgentError`` becomes a failed
    Result. ``emit(progress_dict)`` lets group code forward rows from other agents. Rows also
    feed ``on_row`` (metrics). Iterating yields ``agent_pb2.Event`` messages.

    The daemon's log gets one line when the request starts and one with its outcome
    (``request N: KIND WHAT: ...``). ``context`` (the RPC's ``grpc.ServicerContext``): when
    the call ends before the work did (the client cancelled it, or went away), a line says so
    and ``cancel`` (agent/run/interrupt.py ``Cancel``, given to the run) stops the run at the
    end of its running phase, as a signal stops a one-shot run; without ``cancel`` the work
    runs to its end."""

    def __init__(
        self,
        work: Callable,
        on_row: Optional[Callable[[dict], None]] = None,
        on_done: Optional[Callable[[bool], None]] = None,
        active: Optional[set] = None,
        *,
        kind: str = "",
        what: str = "",
        context=None,
        cancel: Optional[interrupt.Cancel] = None,
    ):
        self.active = active  # the service's set of running work threads
        self.rid = next(_request_ids)
        self.kind, self.what = kind, what
        self.cancel = cancel
        self.peer = context.peer() if context is not None else ""
        self.finished = False  # the work ended (its result is queued)
        if context is not None:
            context.add_callback(self._call_ended)
        self.q: queue.Queue = queue.Queue()
        self.work = work
        self.on_row = on_row
        self.on_done = on_done
        self.rep = Reporter([self._sink])

    def _sink(self, event, obj):
        if event == "note":
            self.emit(progress_dict("note", text=str(obj)))
        else:
            self.emit(progress_dict(event, obj))

    def emit(self, row: dict) -> None:
        # rows forwarded from group members (node set) are counted by those members' agents
        if self.on_row is not None and row.get("event") == "end" and not row.get("node"):
            try:
                self.on_row(row)
            except Exception:
                pass
        self.q.put(("progress", row))

    def _run(self):
        try:
            self._work()
        finally:
            if self.active is not None:
                self.active.discard(threading.current_thread())

    def _label(self) -> str:
        return f"request {self.rid}: {self.kind}" + (f" {self.what}" if self.what else "")

    def _call_ended(self):
        """gRPC: the call ended (its result sent, or cancelled by the client)."""
        if self.finished:
            return
        running = self.rep.phases[-1].name if self.rep.phases else "start"
        log.warning(
            "%s: the client cancelled the call (or went away) during %s; %s",
            self._label(),
            running,
            "the run stops at the end of that phase (refused before the capture, rolled back "
            "until the manifest, finished after it)"
            if self.cancel is not None
            else "it runs to its end",
        )
        if self.cancel is not None:
            self.cancel.set(CLIENT_CANCELLED)

    def _work(self):
        log.info("%s: started (client %s)", self._label(), self.peer or "-")
        try:
            obj, manifest = self.work(self.rep, self.emit)
            out = {"ok": True, "json": obj, "manifest": manifest}
            log.info(
                "%s: ok%s",
                self._label(),
                f" (snapshot {obj['snapshot_id']})" if obj.get("snapshot_id") else "",
            )
        except AgentError as e:
            out = {"ok": False, "error": error_dict(e)}
            log.warning("%s: %s: %s", self._label(), e.outcome, e)
        except BaseException as e:  # a bug in the service: still end the stream with a result
            phase = self.rep.phases[-1].name if self.rep.phases else "agent"
            err = AgentError(phase, f"unexpected {type(e).__name__}: {e}", outcome="failed")
            out = {"ok": False, "error": error_dict(err)}
            log.error("%s: failed: %s", self._label(), err)
        self.finished = True
        self.q.put(("result", out))

    def __iter__(self) -> Iterator:
        apb, _, _ = pb.modules()
        # the work runs to its end even if the client goes away (a phase never stops
        # half-way); the daemon waits for it before exiting
        t = threading.Thread(target=self._run, name="cuinterpose-request", daemon=True)
        if self.active is not None:
            self.active.add(t)
        t.start()
        seq = 0
        while True:
            kind, obj = self.q.get()
            seq += 1
            if kind == "progress":
                yield apb.Event(seq=seq, progress=apb.Progress(**obj))
                continue
            yield apb.Event(seq=seq, result=self._result(obj))
            if self.on_done is not None:
                try:
                    self.on_done(obj["ok"])
                except Exception:
                    pass
            t.join()
            return

    def _result(self, obj: dict):
        apb, _, mpb = pb.modules()
        res = apb.Result(ok=obj["ok"])
        res.phases.extend(mpb.PhaseTiming(**p) for p in self.rep.to_list())
        if obj["ok"]:
            out = dict(obj["json"])
            res.json = json.dumps(out, sort_keys=True, default=str)
            if obj.get("manifest"):
                try:
                    res.manifest.CopyFrom(pb.manifest_to_proto(obj["manifest"]))
                except Exception as e:  # the snapshot is on disk; say why the copy is absent
                    self.rep.note(f"manifest not carried in the result: {e}")
        else:
            e = obj["error"]
            res.error.CopyFrom(
                apb.Error(
                    phase=e["phase"] or "",
                    pid=int(e["pid"] or 0),
                    has_pid=e["pid"] is not None,
                    reason=e["reason"] or "",
                    outcome=e["outcome"] or "",
                    message=e["message"] or "",
                    node=e.get("node") or "",
                )
            )
            res.json = json.dumps(
                {"ok": False, "error": e, "phases": self.rep.to_list()}, sort_keys=True, default=str
            )
        return res
