"""A tmsh consumer: takes storages off the queue (rebuilt on unpickling: the IPC event opened and
waited on, the segment opened), reads and checks each payload on its stream, holds the last
``hold`` storages and drops the older ones (its counter decremented), as a data loader or an
RL weight receiver holding CUDA tensors from ``torch.multiprocessing`` does. See docs/tmsh.md."""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.reduction import ForkingPickler

from cuda.bindings import driver as cu

from ..afdwin.cudrv import call
from . import reductions
from .rank import Rank
from .segments import check_payload, dptr


def run(cfg: dict, index: int, q, conn, event_conn) -> None:
    Rank(cfg, f"consumer{index}", conn).main(lambda rank: _consume(rank, cfg, q, event_conn))


def _consume(rank: Rank, cfg: dict, q, event_conn) -> dict:
    r = reductions.RECEIVER = reductions.Receiver(rank.device, rank.stream)
    pev = event_conn.recv() if event_conn is not None else None  # rebuild_event: opened, kept
    rank.vas_fn = r.opened.vas
    held: deque = deque()
    got, failures = [], []
    while True:
        raw = rank.next_item(q, len(got), cfg["consumer_hold_at"])
        if raw is None:
            break
        st = ForkingPickler.loads(
            raw
        )  # rebuild_storage: event opened and waited on, segment opened
        if pev is not None:
            call(cu.cuStreamWaitEvent, r.stream, pev, 0)
        buf = bytearray(st.size)
        call(cu.cuMemcpyDtoHAsync, buf, dptr(st.va), st.size, r.stream)
        call(cu.cuStreamSynchronize, r.stream)
        why = check_payload(bytes(buf), st.seq)
        if why:
            failures.append(f"storage {st.seq} at {st.va:#x}: {why}")
        got.append(st.seq)
        rank.received = len(got)
        rank.progressed()
        held.append(st)
        while len(held) > cfg["hold"]:
            r.drop(held.popleft())
        time.sleep(cfg["consumer_delay_ms"] / 1000)
    while held:
        r.drop(held.popleft())
    return {
        "received": got,
        "failures": failures[:8],
        "failed": len(failures),
        "segment_opens": r.opened.opens,
        "events_opened": len(r.events),
        "cache_hits": r.cache_hits,
    }
