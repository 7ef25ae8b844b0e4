"""The ``stream`` job: a producer puts ``(seq, tensor)`` on a ``torch.multiprocessing`` queue,
``seq`` = 1..steps, each tensor new from the caching allocator and dropped by the producer once
sent (PyTorch keeps its block until every consumer released it: ``CudaIPCSentDataLimbo``); each
consumer takes tensors off the queue (the storage rebuilt from its IPC handle or cuMem FD, the
producer's IPC event waited on), compares each with the payload computed again on its own
device, keeps the last ``hold`` referenced and drops the older ones.

Payload of ``seq``: ``int64[elems]``, element ``i`` = (seq * 1000003 + i * 7919) mod (2^31 - 1),
element 0 = seq. A consumer acknowledges its end on the ``acks`` queue; the producer stays
alive until every consumer did (a CUDA tensor's producer must outlive its consumers' use).
"""

from __future__ import annotations

import time
from collections import deque

from .rank import Rank

MOD = 2**31 - 1


def payload(torch, seq: int, elems: int, dev):
    t = (torch.arange(elems, dtype=torch.int64, device=dev) * 7919 + seq * 1000003) % MOD
    t[0] = seq
    return t


def produce(cfg: dict, q, acks, conn) -> None:
    Rank(cfg, "producer", conn).main(lambda rank: _produce(rank, cfg, q, acks))


def _produce(rank: Rank, cfg: dict, q, acks) -> dict:
    torch, seq = rank.torch, 0
    while seq < cfg["steps"]:
        if not rank.ready(seq, cfg["hold_at"]):
            continue
        seq += 1
        q.put((seq, payload(torch, seq, cfg["elems"], rank.dev)))
        rank.sent = seq
        rank.progressed()
        time.sleep(cfg["step_delay_ms"] / 1000)
    for _ in range(cfg["consumers"]):
        q.put(None)  # one end-of-stream per consumer
    rank.await_ends(acks, cfg["consumers"], "the consumers to end")
    rank.synchronize()
    return {"sent": seq}


def consume(cfg: dict, index: int, q, acks, conn) -> None:
    Rank(cfg, f"consumer{index}", conn).main(lambda rank: _consume(rank, cfg, q, acks))


def _consume(rank: Rank, cfg: dict, q, acks) -> dict:
    torch = rank.torch
    held: deque = deque()
    rank.vas_fn = lambda: {f"storage {s}": t.data_ptr() for s, t in held}
    got, failures = [], []
    while True:
        item = rank.next_item(q, len(got), cfg["consumer_hold_at"], "the producer's next tensor")
        if item is None:
            break
        seq, t = item
        if t.device.type != rank.dev.type:
            failures.append(f"storage {seq} arrived on {t.device}, not {rank.dev.type}")
        elif not torch.equal(t, payload(torch, seq, cfg["elems"], rank.dev)):
            bad = int((t != payload(torch, seq, cfg["elems"], rank.dev)).sum())
            failures.append(
                f"storage {seq} at {t.data_ptr():#x}: {bad} of {t.numel()} elements wrong"
            )
        got.append(seq)
        rank.received = len(got)
        rank.progressed()
        held.append((seq, t))
        while len(held) > cfg["hold"]:
            held.popleft()
        del t, item  # only ``held`` keeps a tensor of the producer's
    held.clear()
    rank.synchronize()
    acks.put(rank.role)
    return {"received": got, "failures": failures[:8], "failed": len(failures)}
