"""The tmsh launcher: the process-tree root (no CUDA). It makes the ``multiprocessing`` queue
(spawn context, as torch.multiprocessing needs for CUDA), starts the producer and the consumers,
answers the workload contract (docs/workload-contract.md) for the whole tree, and prints the
summary. See docs/tmsh.md for the options, the events and what the summary checks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

from .. import mpcontract, stacks
from . import consumer, producer
from .segments import VARIANTS


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


def summary(cfg: dict, ranks: mpcontract.Ranks, quiesces: list[dict]) -> dict:
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
    exits = ranks.exits()
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


def start(cfg: dict, ctx) -> tuple[mpcontract.Ranks, object]:
    """The producer and the consumers, in that order, and the queue between them (kept by the
    caller: its semaphores go when it is collected)."""
    q = ctx.Queue()
    n = cfg["procs"] - 1
    ev = [ctx.Pipe() for _ in range(n)] if cfg["variant"] == "event" else []
    specs = [
        (
            "producer",
            lambda conn: ctx.Process(target=producer.run, args=(cfg, q, conn, [e[0] for e in ev])),
        )
    ]
    for i in range(n):
        specs.append(
            (
                f"consumer{i}",
                lambda conn, i=i: ctx.Process(
                    target=consumer.run, args=(cfg, i, q, conn, ev[i][1] if ev else None)
                ),
            )
        )
    return mpcontract.Ranks(cfg, ctx, specs), q


def main(argv=None) -> int:
    cfg = parse(argv)
    stacks.on_signal()
    ranks, _queue = start(cfg, mp.get_context("spawn"))
    emit(
        "setup",
        ranks=[{"role": r, "pid": p.pid} for r, p in zip(ranks.roles, ranks.procs)],
        config=cfg,
    )
    quiesces = mpcontract.serve(ranks)
    s = summary(cfg, ranks, quiesces)
    emit("summary", **s)
    return 0 if s["ok"] else 1


def emit(event: str, **kw) -> None:
    mpcontract.emit("launcher", event, **kw)
