"""The tmsh launcher: the process-tree root (no CUDA). It makes the ``multiprocessing`` queue
(spawn context, as torch.multiprocessing needs for CUDA), starts the producer and the consumers,
answers the workload contract (docs/workload-contract.md) for the whole tree, and prints the
summary. See docs/tmsh.md for the options, the events and what the summary checks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

from ...coordinator import contract
from .. import stacks
from . import consumer, producer
from .segments import VARIANTS


def emit(event: str, **kw) -> None:
    print(json.dumps({"event": event, "role": "launcher", "pid": os.getpid(), **kw}), flush=True)


def parse(argv) -> dict:
    p = argparse.ArgumentParser(prog="python -m cuinterpose.workloads.tmsh", description=__doc__)
    p.add_argument(
        "--procs", type=int, default=2, help="processes: one producer, the rest consumers (>= 2)"
    )
    p.add_argument("--variant", choices=VARIANTS, default="ipc")
    p.add_argument("--steps", type=int, default=60, help="storages sent, numbered 1..S")
    p.add_argument("--storage-bytes", type=int, default=64 << 10)
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--segment-bytes", type=int, default=1 << 20)
    p.add_argument("--hold", type=int, default=2, help="storages a consumer keeps referenced")
    p.add_argument(
        "--max-events", type=int, default=1000, help="live IPC events before syncing instead"
    )
    p.add_argument(
        "--hold-at", type=int, default=0, help="the producer stops after sending H until a quiesce"
    )
    p.add_argument(
        "--consumer-hold-at", type=int, default=0, help="each consumer stops after receiving C"
    )
    p.add_argument("--step-delay-ms", type=float, default=1.0)
    p.add_argument("--consumer-delay-ms", type=float, default=1.0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--peer-timeout-s", type=float, default=300.0)
    p.add_argument("--answer-timeout-s", type=float, default=300.0)
    p.add_argument("--park-timeout-s", type=float, default=600.0)
    a = p.parse_args(argv)
    if a.procs < 2:
        p.error("--procs must be at least 2 (a producer and a consumer)")
    if a.storage_bytes < 64 or a.storage_bytes > a.segment_bytes:
        p.error("--storage-bytes must be at least 64 and at most --segment-bytes")
    return {k.replace("-", "_"): v for k, v in vars(a).items()}


class Ranks:
    """The producer and consumer processes and the launcher's ends of their pipes."""

    def __init__(self, cfg: dict, ctx):
        self.cfg = cfg
        self.queue = q = ctx.Queue()  # kept: its semaphores go when it is collected
        n = cfg["procs"] - 1
        ev = [ctx.Pipe() for _ in range(n)] if cfg["variant"] == "event" else []
        self.conns, self.procs, self.roles = [], [], []
        here, there = ctx.Pipe()
        self._add(
            ctx.Process(target=producer.run, args=(cfg, q, there, [e[0] for e in ev])),
            here,
            "producer",
        )
        for i in range(n):
            here, there = ctx.Pipe()
            args = (cfg, i, q, there, ev[i][1] if ev else None)
            self._add(ctx.Process(target=consumer.run, args=args), here, f"consumer{i}")
        for p in self.procs:
            p.start()
        self.done: dict[str, dict] = {}
        self.failed: list[str] = []

    def _add(self, proc, conn, role):
        self.procs.append(proc)
        self.conns.append(conn)
        self.roles.append(role)

    def active(self):
        return [
            (r, c, p) for r, c, p in zip(self.roles, self.conns, self.procs) if r not in self.done
        ]

    def take(self, role: str, msg: dict) -> dict | None:
        """A rank's message about its end (done or failed): recorded; anything else returned."""
        if "done" in msg:
            self.done[role] = msg["done"]
        elif "failed" in msg:
            self.done[role] = {}
            self.failed.append(msg["failed"])
        else:
            return msg
        return None

    def poll(self) -> None:
        for role, conn, _ in self.active():
            while role not in self.done and conn.poll():
                self.take(role, conn.recv())

    def ask(self, role, conn, proc, msg: dict, want: str) -> dict | None:
        """Send `msg`, wait (answer timeout) for the answer carrying `want`; None when the rank
        ended instead."""
        conn.send(msg)
        deadline = time.monotonic() + self.cfg["answer_timeout_s"]
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                got = self.take(role, conn.recv())
                if got is None:
                    return None
                if want in got:
                    return got
            elif not proc.is_alive() and not conn.poll():
                raise RuntimeError(
                    f"{role} pid {proc.pid} exited (status {proc.exitcode}) before answering {want}"
                )
        raise TimeoutError(
            f"{role} pid {proc.pid} did not answer {msg['op']} within {self.cfg['answer_timeout_s']} s"
        )


def quiesce(ranks: Ranks, ctl: str, root: int, req: dict) -> dict:
    """One quiesce of the contract: park every rank, answer .ready, wait for .resume, resume."""
    parked = {}
    for role, conn, proc in ranks.active():
        got = ranks.ask(role, conn, proc, {"op": "quiesce"}, "parked")
        if got is not None:
            parked[role] = (conn, proc, got)
    sent = sum(p[2]["sent"] for p in parked.values())
    received = sum(p[2]["received"] for p in parked.values())
    ready = {
        "id": req["id"],
        "ranks": [{"pid": p[1].pid, "role": r} for r, p in parked.items()],
        "sent": sent,
    }
    contract.write_atomic(contract.quiesce_path(ctl, root, "ready"), ready)
    emit(
        "quiesced",
        id=req["id"],
        sent=sent,
        received=received,
        in_flight=sent - received,
        ranks=ready["ranks"],
    )
    resume_path = contract.quiesce_path(ctl, root, "resume")
    waited = 0.0
    while True:
        res = contract.read_json(resume_path)
        if res and res.get("id") == req["id"]:
            break
        time.sleep(0.05)
        waited += 0.05  # time spent dumped does not count
        if waited > ranks.cfg["park_timeout_s"]:
            raise TimeoutError(
                f"quiesce {req['id']}: no {resume_path} within {ranks.cfg['park_timeout_s']} s"
            )
    for k in ("request", "ready", "resume"):
        try:
            os.unlink(contract.quiesce_path(ctl, root, k))
        except FileNotFoundError:
            pass
    same = True
    for role, (conn, proc, p) in parked.items():
        got = ranks.ask(
            role, conn, proc, {"op": "resume", "restored": bool(res.get("restored"))}, "resumed"
        )
        same &= got is not None and got["vas"] == p["vas"]
    out = {
        "id": req["id"],
        "restored": bool(res.get("restored")),
        "cancelled": bool(res.get("cancelled")),
    }
    emit("resumed", **out, vas_identical=same)
    return {**out, "vas_identical": same}


def summary(cfg: dict, ranks: Ranks, quiesces: list[dict]) -> dict:
    problems = list(ranks.failed)
    prod = ranks.done.get("producer", {})
    if prod.get("sent") != cfg["steps"]:
        problems.append(f"the producer sent {prod.get('sent')} storages, not {cfg['steps']}")
    got = sorted(s for r, d in ranks.done.items() if r != "producer" for s in d.get("received", []))
    if got != list(range(1, cfg["steps"] + 1)):
        dup = len(got) - len(set(got))
        missing = sorted(set(range(1, cfg["steps"] + 1)) - set(got))[:8]
        problems.append(f"storages received {len(got)} times ({dup} duplicated), missing {missing}")
    failed = sum(d.get("failed", 0) for d in ranks.done.values())
    if failed:
        problems.append(
            f"{failed} payloads wrong: "
            + "; ".join(f for d in ranks.done.values() for f in d.get("failures", []))
        )
    if not all(q["vas_identical"] for q in quiesces):
        problems.append("a VA changed across a quiesce")
    exits = {r: p.exitcode for r, p in zip(ranks.roles, ranks.procs)}
    problems += [f"{r} exited {c}" for r, c in exits.items() if c != 0]
    return {
        "ok": not problems,
        "problems": problems,
        "procs": cfg["procs"],
        "variant": cfg["variant"],
        "steps": cfg["steps"],
        "received_once": got == list(range(1, cfg["steps"] + 1)),
        "failed_payloads": failed,
        "quiesces": quiesces,
        "restores_seen": sum(q["restored"] for q in quiesces),
        "producer": prod,
        "consumers": {
            r: {k: v for k, v in d.items() if k != "received"}
            for r, d in ranks.done.items()
            if r != "producer"
        },
        "rank_exit": exits,
    }


def main(argv=None) -> int:
    cfg = parse(argv)
    stacks.on_signal()
    root = os.getpid()
    ctl = os.environ.get("CUINTERPOSE_CONTROL_DIR") or contract.default_control_dir()
    ranks = Ranks(cfg, mp.get_context("spawn"))
    emit(
        "setup",
        ranks=[{"role": r, "pid": p.pid} for r, p in zip(ranks.roles, ranks.procs)],
        config=cfg,
    )
    quiesces, last_id = [], None
    try:
        while ranks.active():
            ranks.poll()
            req = contract.read_json(contract.quiesce_path(ctl, root, "request"))
            if req and req.get("id") and req["id"] != last_id and ranks.active():
                last_id = req["id"]
                quiesces.append(quiesce(ranks, ctl, root, req))
            time.sleep(0.05)
    except (TimeoutError, RuntimeError) as e:
        emit("failed", message=str(e))
        for p in ranks.procs:
            p.kill()
        ranks.failed.append(str(e))
    for p in ranks.procs:
        p.join()
    s = summary(cfg, ranks, quiesces)
    emit("summary", **s)
    return 0 if s["ok"] else 1
