"""Per-pair delivery evidence and rate statistics (pure Python).

``PairEvidence`` records every sequence number a receiver accepted from one sender; its
``summary()`` is what a ``done`` event carries. ``Rates`` splits throughput into segments
separated by quiesce/resume so that parked time is never counted.
"""

from __future__ import annotations

import time


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, -(-len(v) * q // 100) - 1))
    return v[int(k)]


class PairEvidence:
    """Sequence numbers one receiver got from one sender.

    ``add(seq)`` records an intact message, ``torn(kind)`` one that failed validation (bad
    magic, version, routing, checksum, payload), ``out_of_order()`` a seq that was not the
    exactly-next one on its ring.
    """

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.count = 0
        self.seen: set[int] = set()
        self.first: int | None = None
        self.last: int | None = None
        self.torn_count = 0
        self.torn_kinds: dict[str, int] = {}
        self.out_of_order_count = 0

    def add(self, seq: int) -> None:
        self.count += 1
        self.seen.add(seq)
        self.first = seq if self.first is None else min(self.first, seq)
        self.last = seq if self.last is None else max(self.last, seq)

    def torn(self, kind: str) -> None:
        self.torn_count += 1
        self.torn_kinds[kind] = self.torn_kinds.get(kind, 0) + 1

    def out_of_order(self) -> None:
        self.out_of_order_count += 1

    def gaps(self) -> int:
        """Seqs in [1, last] never received."""
        return (
            0
            if self.last is None
            else sum(1 for s in range(1, self.last + 1) if s not in self.seen)
        )

    def lost(self, steps: int) -> int:
        """Seqs in [1, steps] never received."""
        return sum(1 for s in range(1, steps + 1) if s not in self.seen)

    def summary(self) -> dict:
        return {
            "src": self.src,
            "dst": self.dst,
            "count": self.count,
            "distinct": len(self.seen),
            "first": self.first,
            "last": self.last,
            "gaps": self.gaps(),
            "duplicates": self.count - len(self.seen),
            "torn": self.torn_count,
            "torn_kinds": dict(self.torn_kinds),
            "out_of_order": self.out_of_order_count,
        }

    def exact(self, steps: int) -> bool:
        """True when seqs are exactly 1..steps, once each, nothing torn or out of order."""
        s = self.summary()
        return (
            s["count"] == steps
            and s["distinct"] == steps
            and s["gaps"] == 0
            and s["duplicates"] == 0
            and s["torn"] == 0
            and s["out_of_order"] == 0
            and (steps == 0 or (s["first"] == 1 and s["last"] == steps))
        )


class Rates:
    """Message and byte counts per active segment. Segment 0 runs from the first message to
    the first park; each resume opens a new segment, marked ``restored`` when the resume
    followed a restore. Times are ``time.monotonic()`` seconds."""

    def __init__(self):
        self.segments: list[dict] = []
        self.open(restored=False)

    def open(self, restored: bool) -> None:
        self.segments.append(
            {"restored": restored, "t0": None, "t1": None, "msgs": 0, "payload_bytes": 0, "rtt": []}
        )

    def close(self) -> None:
        """End the current segment's clock (a park)."""
        seg = self.segments[-1]
        if seg["t0"] is not None:
            seg["t1"] = time.monotonic()

    def start_clock(self) -> None:
        seg = self.segments[-1]
        if seg["t0"] is None:
            seg["t0"] = time.monotonic()

    def record(self, msgs: int, payload_bytes: int, rtt_s: float | None = None) -> None:
        seg = self.segments[-1]
        self.start_clock()
        seg["msgs"] += msgs
        seg["payload_bytes"] += payload_bytes
        seg["t1"] = time.monotonic()
        if rtt_s is not None:
            seg["rtt"].append(rtt_s * 1e6)

    @staticmethod
    def _report(segs: list[dict]) -> dict:
        msgs = sum(s["msgs"] for s in segs)
        nbytes = sum(s["payload_bytes"] for s in segs)
        secs = sum((s["t1"] - s["t0"]) for s in segs if s["t0"] is not None and s["t1"] is not None)
        rtt = [round(x, 1) for s in segs for x in s["rtt"]]
        return {
            "msgs": msgs,
            "payload_bytes": nbytes,
            "seconds": round(secs, 6),
            "msgs_per_s": round(msgs / secs, 3) if secs > 0 else None,
            "gb_per_s": round(nbytes / secs / 1e9, 6) if secs > 0 else None,
            "rtt_us_p50": percentile(rtt, 50),
            "rtt_us_p99": percentile(rtt, 99),
            "rtt_us_max": max(rtt) if rtt else None,
        }

    def report(self) -> dict:
        """``{"total", "pre_checkpoint", "post_restore", "segments"}``; post_restore covers the
        segments after the first restore (None when no restore happened)."""
        first_restored = next((i for i, s in enumerate(self.segments) if s["restored"]), None)
        post = None if first_restored is None else self._report(self.segments[first_restored:])
        return {
            "total": self._report(self.segments),
            "pre_checkpoint": self._report(self.segments[:1]),
            "post_restore": post,
            "segments": [dict(self._report([s]), restored=s["restored"]) for s in self.segments],
        }
