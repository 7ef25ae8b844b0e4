"""The launcher's side of the quiesce contract (docs/workload-contract.md): it watches
``quiesce-<pid>.request``, tells every rank to stop and drain, collects their park replies,
writes ``.ready`` and, once ``.resume`` carries the request's id, lets the ranks continue.

A mixin of :class:`~cuinterpose.workloads.afdwin.launcher.Launcher` (its ``q``, ``phase``,
paths and channels); file names and writes come from :mod:`cuinterpose.coordinator.contract`.
"""

from __future__ import annotations

import time

from cuinterpose.coordinator.contract import read_json, remove_if_id, write_atomic


class RunFailed(Exception):
    """A fatal launcher-level failure; the message is the error event's text."""

    def __init__(self, stage: str, message: str, **extra):
        self.stage, self.extra = stage, extra
        super().__init__(message)


class QuiesceSide:
    def poll_control(self) -> None:
        if self.q is None:
            if self.phase != "running" or self.ignore_quiesce:
                return
            req = read_json(self.req_path)
            if req is None or "id" not in req or str(req["id"]) in self.handled:
                return
            # a .resume of an older id may lie there: it answers another request, which this
            # one's id tells apart; it is never removed here (case 017)
            self.handled.add(str(req["id"]))
            self.quiesces += 1
            self.q = {
                "id": str(req["id"]),
                "stage": "stopping",
                "t0": time.monotonic(),
                "acks": {},
                "issued": {},
                "parked": {},
                "resumed": {},
            }
            self.emit(
                {
                    "event": "quiesce_requested",
                    "id": self.q["id"],
                    "timeout_ms": req.get("timeout_ms"),
                    "drain": not self.cfg.no_drain,
                }
            )
            if self.cfg.no_drain:
                # --no-drain: FFN ranks park at once (no drain); attention ranks stop after
                self.q["stage"] = "ffn_parking"
                self.broadcast(
                    {"type": "drain", "id": self.q["id"], "targets": None, "no_drain": True},
                    self.ffn_ranks(),
                )
            else:
                self.broadcast({"type": "quiesce", "id": self.q["id"]}, self.attn_ranks())
        elif self.q["stage"] == "parked" or self.q["stage"] == "ready":
            res = read_json(self.resume_path)
            if res is None or res.get("id", self.q["id"]) != self.q["id"]:
                return
            self.last_change = time.monotonic()  # CLOCK_MONOTONIC may jump across a restore
            restored = bool(res.get("restored", False))
            cancelled = bool(res.get("cancelled", False))
            # this request's files only, .request last: the agent's next request waits for it
            for p in (self.ready_path, self.resume_path, self.req_path):
                remove_if_id(p, self.q["id"])
            self.q.update(
                stage="resuming", restored=restored, cancelled=cancelled, resume_id=res.get("id")
            )
            if restored:
                self.restores_seen += 1
            pending = [p for r in sorted(self.q["parked"]) for p in self.q["parked"][r]["pending"]]
            self.broadcast(
                {"type": "resume", "id": self.q["id"], "restored": restored, "pending": pending}
            )

    def attn_ranks(self) -> list[int]:
        return list(range(self.cfg.attention))

    def ffn_ranks(self) -> list[int]:
        return list(range(self.cfg.attention, self.cfg.world))

    def on_quiesce_reply(self, rank: int, msg: dict) -> None:
        q = self.q
        if q is None or msg.get("id") != q["id"]:
            raise RunFailed(
                "quiesce",
                f"rank {rank} sent {msg['type']} for id {msg.get('id')!r}"
                f" outside quiesce {q and q['id']!r}",
            )
        t = msg["type"]
        if t == "stopped":
            q["issued"][rank] = int(msg["issued"])
            if len(q["issued"]) == self.cfg.attention and self.cfg.no_drain:
                q["stage"] = "parking"  # no drain: park with replies owed
                self.broadcast({"type": "park", "id": q["id"]}, self.attn_ranks())
            elif len(q["issued"]) == self.cfg.attention:
                q["stage"] = "draining"
                self.broadcast(
                    {
                        "type": "drain",
                        "id": q["id"],
                        "targets": {str(a): s for a, s in q["issued"].items()},
                    },
                    self.ffn_ranks(),
                )
        elif t == "parked":
            q["parked"][rank] = {k: msg[k] for k in ("rank", "pid", "role", "last_seq", "pending")}
            q.setdefault("replied", {})[rank] = msg.get("replied") or {}
            ffn_parked = all(f in q["parked"] for f in self.ffn_ranks())
            if ffn_parked and q["stage"] == "ffn_parking":  # --no-drain
                q["stage"] = "stopping"
                replied = {str(f): q["replied"][f] for f in self.ffn_ranks()}
                self.broadcast(
                    {"type": "quiesce", "id": q["id"], "replied": replied}, self.attn_ranks()
                )
            if ffn_parked and q["stage"] == "draining":
                q["stage"] = "parking"
                self.broadcast({"type": "park", "id": q["id"]}, self.attn_ranks())
            if len(q["parked"]) == self.cfg.world:
                ranks = [q["parked"][i] for i in range(self.cfg.world)]
                ready = {
                    "id": q["id"],
                    "ranks": ranks,
                    "workload": "afdwin",
                    "launcher_pid": self.pid,
                }
                q["stage"] = "parked"
                res = read_json(self.resume_path)
                if res is None or res.get("id", q["id"]) != q["id"]:  # not cancelled meanwhile
                    write_atomic(self.ready_path, ready)
                    q["stage"] = "ready"
                pending = [p for r in ranks for p in r["pending"]]
                kinds = {}
                for p in pending:
                    kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
                self.emit(
                    {
                        "event": "quiesced",
                        "id": q["id"],
                        "ranks": ranks,
                        "drained": not self.cfg.no_drain,
                        "pending": kinds,
                        "quiesce_ms": round((time.monotonic() - q["t0"]) * 1e3, 3),
                    }
                )
        elif t == "resumed":
            q["resumed"][rank] = msg.get("window_checks")
            if len(q["resumed"]) == self.cfg.world:
                self.broadcast({"type": "continue", "id": q["id"]})
                self.emit(
                    {
                        "event": "resumed",
                        "id": q["id"],
                        "restored": q["restored"],
                        "cancelled": q["cancelled"],
                        "window_checks": {str(k): v for k, v in sorted(q["resumed"].items())},
                    }
                )
                self.q = None
                self.last_change = time.monotonic()

    # ---- main loop ------------------------------------------------------------------------
