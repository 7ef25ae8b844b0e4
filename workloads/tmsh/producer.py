"""The tmsh producer: a pool of segments split into storages, each storage written, shared and
put on the queue, and reused only once its reference counter is back to 0
(``CudaIPCSentDataLimbo::collect``), as a process sending CUDA tensors with
``torch.multiprocessing`` does. See docs/tmsh.md."""

from __future__ import annotations

import time
from collections import deque

from cuda.bindings import driver as cu

from ..afdwin.cudrv import call
from .rank import Rank
from .reductions import SharedEvent, Sharer
from .segments import Segments, dptr, payload


def run(cfg: dict, q, conn, event_conns) -> None:
    Rank(cfg, "producer", conn).main(lambda rank: _produce(rank, cfg, q, event_conns))


def _produce(rank: Rank, cfg: dict, q, event_conns) -> dict:
    stream = rank.stream
    segs = Segments(cfg["variant"], rank.device, cfg["segments"], cfg["segment_bytes"])
    per_seg = segs.seg_bytes // cfg["storage_bytes"]
    slots = [(i, k * cfg["storage_bytes"]) for i in range(cfg["segments"]) for k in range(per_seg)]
    handles = [segs.handle(i) for i in range(cfg["segments"])]
    sharer = Sharer(rank.device, stream, cfg["max_events"])
    pev = None
    if (
        cfg["variant"] == "event"
    ):  # a torch.cuda.Event(interprocess=True) sent to each consumer once
        pev = SharedEvent(rank.device)
        for c in event_conns:
            c.send(pev)
    rank.vas_fn = lambda: {f"segment {i}": va for i, va in enumerate(segs.va)}
    rank.emit("vas", after_restore=False, vas=rank.vas_fn())
    free, sent, hostbufs = deque(range(len(slots))), {}, {}
    reuses = max_live = 0

    def collect() -> None:
        for slot, s in list(sent.items()):
            if s.counter() == 0:
                sharer.retire(s)
                del sent[slot]
                free.append(slot)

    seq = 0
    while seq < cfg["steps"]:
        if not rank.ready(seq, cfg["hold_at"]):
            continue
        collect()
        if not free:
            rank.wait_a_little("a free storage (every one is referenced by a consumer)")
            continue
        slot = free.popleft()
        seg, off = slots[slot]
        reuses += slot in hostbufs
        seq += 1
        data = hostbufs[slot] = payload(seq, cfg["storage_bytes"])  # alive until the slot's reuse
        call(cu.cuMemcpyHtoDAsync, dptr(segs.va[seg] + off), data, len(data), stream)
        if pev is not None:
            call(cu.cuEventRecord, pev.event, stream)
        msg, s = sharer.share(seq, slot, handles[seg], off, cfg["storage_bytes"])
        q.put(msg)
        sent[slot] = s
        max_live = max(max_live, sharer.live_events)
        rank.sent = seq
        rank.progressed()
        time.sleep(cfg["step_delay_ms"] / 1000)
    for _ in range(cfg["procs"] - 1):
        q.put(None)  # one end-of-stream per consumer
    while sent:
        rank.serve()
        before = len(sent)
        collect()
        if len(sent) < before:
            rank.progressed()
        elif sent:
            rank.wait_a_little("the consumers to drop their last storages")
    call(cu.cuStreamSynchronize, stream)
    if pev is not None:
        call(cu.cuEventDestroy, pev.event)
    segs.free()
    for f in sharer.files:
        f.unlink()
    return {
        "sent": seq,
        "storages": len(slots),
        "reuses": reuses,
        "synced_instead_of_event": sharer.synced,
        "max_live_events": max_live,
        "live_events_at_end": sharer.live_events,
        "counter_files": len(sharer.files),
    }
