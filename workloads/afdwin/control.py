"""The rank's side of the launcher channel: messages, barriers, and the quiesce handling
(stop, drain, park, resume) of docs/afdwin.md "Quiesce and the checkpoint cut".

A mixin of :class:`~cuinterpose.workloads.afdwin.rank_base.Rank`. Single-threaded on purpose:
control messages are read between driver calls, so a parked rank is provably not inside CUDA.
"""

from __future__ import annotations

import time

PROGRESS_INTERVAL_S = 0.25


class Abort(RuntimeError):
    """The launcher told this rank to stop (geometry mismatch, another rank failed)."""


class Control:
    """Launcher messages and the park loop; the role subclasses override the hooks
    (``try_stop``, ``pending_at_park``, ``resume_protocol``, ``replied_map``)."""

    # ---- messaging ------------------------------------------------------------------------
    def send(self, msg: dict, fds=()) -> None:
        self.chan.send(msg, fds)

    def emit(self, event: dict) -> None:
        self.send({"type": "event", "event": event})

    def expect(self, mtype: str) -> tuple[dict, list[int]]:
        """Block for the next message; it must be ``mtype`` (or abort/fail, which raise)."""
        msg, fds = self.chan.recv()
        if msg["type"] in ("fail", "abort"):
            raise Abort(msg.get("message", msg["type"]))
        if msg["type"] != mtype:
            raise RuntimeError(f"rank {self.rank}: expected {mtype!r}, got {msg['type']!r}")
        return msg, fds

    def barrier(self, name: str) -> None:
        self.send({"type": "barrier", "name": name})
        self.expect("barrier")

    # ---- control --------------------------------------------------------------------------
    def service_control(self) -> None:
        """Handle every pending launcher message without blocking (except when parking)."""
        while True:
            got = self.chan.recv(timeout=0)
            if got is None:
                return
            self.on_control(got[0])

    def on_control(self, msg: dict) -> None:
        t = msg["type"]
        if t in ("abort", "fail"):
            raise Abort(msg.get("message", t))
        if t == "quiesce":  # attention: stop issuing
            self.quiesce_id = msg["id"]
            self.quiesces += 1
            self.ffn_replied = {
                int(f): {
                    int(a): {int(r): int(v) for r, v in rings.items()} for a, rings in by_a.items()
                }
                for f, by_a in (msg.get("replied") or {}).items()
            }
            if self.state != "finished":
                self.state = "stopping"
                self.stop_pending = True
                self.try_stop()
            else:
                self.send_stopped()
        elif t == "drain":  # ffn: drain to targets, then park
            self.quiesce_id = msg["id"]
            self.quiesces += 1
            self.targets = {int(k): int(v) for k, v in (msg.get("targets") or {}).items()}
            if self.state != "finished" and not msg.get("no_drain"):
                self.state = "draining"
            else:
                self.park()  # --no-drain: park at once, owed replies unissued
        elif t == "park":  # attention: replies are owed now
            self.park()
        elif t == "report":  # launcher gives up: evidence
            ev = self.done_event()
            ev["partial"] = True
            self.emit(ev)
        elif t == "exit":
            raise SystemExit(0 if self.ok() else 1)
        else:
            raise RuntimeError(f"rank {self.rank}: unexpected message {t!r} in state {self.state}")

    def send_stopped(self) -> None:
        self.stop_pending = False
        self.send(
            {
                "type": "stopped",
                "id": self.quiesce_id,
                "rank": self.rank,
                "issued": self.issued_seq(),
            }
        )

    def try_stop(self) -> None:
        self.send_stopped()

    def pending_at_park(self) -> list[dict]:
        """Protocol messages in flight at the cut (read from the device after the sync)."""
        return []

    def park(self) -> None:
        """Synchronize every stream, ack, then wait (no CUDA) for resume + continue."""
        was = self.state
        self.sync_all()
        self.after_sync()
        pending = self.pending_at_park()
        self.rates.close()
        self.state = "parked"
        self.send(
            {
                "type": "parked",
                "id": self.quiesce_id,
                "rank": self.rank,
                "pid": self.pid,
                "role": self.role,
                "last_seq": self.last_seq(),
                "pending": pending,
                "replied": self.replied_map(),
            }
        )
        restored = None
        while True:
            got = self.chan.recv(timeout=PROGRESS_INTERVAL_S)
            if got is None:
                self.progress(force=True)
                continue
            msg = got[0]
            if msg["type"] in ("abort", "fail"):
                raise Abort(msg.get("message", msg["type"]))
            if msg["type"] == "report":
                self.on_control(msg)
            elif msg["type"] == "resume":
                restored = bool(msg.get("restored"))
                self.cut_pending = msg.get("pending") or []
                if restored:
                    self.restores_seen += 1
                    self.emit(self.window_event(after_restore=True))
                self.check_windows()
                self.probe_epoch += 1
                self.write_probe()
                self.barrier(f"probe-{self.probe_epoch}")
                for err in self.read_probes().values():
                    self.record_check(err is None, err or "")
                if self.cfg.multicast:
                    self.multicast_check()
                self.send(
                    {
                        "type": "resumed",
                        "id": self.quiesce_id,
                        "rank": self.rank,
                        "window_checks": {
                            k: v for k, v in self.window_checks.items() if k != "failures"
                        },
                    }
                )
            elif msg["type"] == "continue" and restored is not None:
                break
            else:
                raise RuntimeError(f"rank {self.rank}: unexpected {msg['type']!r} while parked")
        self.rates.open(restored=bool(restored))
        self.after_resume()
        self.resume_protocol()
        self.state = "finished" if was == "finished" else "running"

    def after_resume(self) -> None:
        """Forget deadlines taken from CLOCK_MONOTONIC, which may jump across a restore."""
        self._last_progress = 0.0
        if hasattr(self, "next_issue_at"):
            self.next_issue_at = 0.0

    def resume_protocol(self) -> None:
        """First CUDA work after a resume (attention: enqueue a combine held across the cut)."""

    def replied_map(self) -> dict:
        return {}

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_INTERVAL_S:
            return
        self._last_progress = now
        ev = {
            "event": "progress",
            "rank": self.rank,
            "role": self.role,
            "state": self.state,
            "parked": self.state == "parked",
        }
        ev.update(self.counters())
        ev["last_seq"] = {str(k): v for k, v in self.last_seq().items()}
        self.emit(ev)
