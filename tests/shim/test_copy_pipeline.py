"""The copy pipeline of SAVE_ALLOCATIONS and LOAD_ALLOCATIONS (ops_copies.c; docs/shim.md "Chunk
files"), read from fakecuda's call log:
- a ring of 8 chunks runs 4 lanes: the first 4 copies go out on 4 different streams with no wait
  between them, then each copy waits for the one that last used its lane (cuStreamSynchronize on
  that stream, oldest first) right before it goes out on the same stream, and the op ends with one
  wait per lane; every copy is waited for exactly once, the 4 streams are destroyed; SAVE and LOAD
  alike, and the bytes come back;
- a ring of one chunk has no slot to spare: each copy is waited for right after it went out;
- LOAD creates each allocation where the app maps the whole of it (read-write for its device):
  its mapping made again at the app's VA before the copies, no staging reservation."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator.protocol import Op, Phase, Status

from .test_chunks import _alloc

MiB = 1 << 20
CB = 64 << 10
COPIES = ("cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2")


def _op(ctl, c, fake_log, op, txn, phase):
    mark = fake_log.mark()
    r = ctl(c).request(op, txn_id=txn, expected_phase=phase)
    assert r.reply.status == Status.OK, r.message
    return fake_log.calls(c.pid, since=mark)


def _lanes(calls, copy):
    """The copies and waits of one op in log order, as (kind, stream): "copy" / "wait"."""
    return [
        ("copy" if fn == copy else "wait", a["stream"])
        for fn, a, _ in calls
        if fn in (copy, "cuStreamSynchronize") and a.get("stream") not in (None, "(nil)")
    ]


def _expected(streams, lanes):
    """The exact order of copies and waits for copies on ``streams`` (in issue order) over
    ``lanes`` lanes (0: each waited for at once)."""
    if not lanes:
        return [x for s in streams for x in (("copy", s), ("wait", s))]
    out = []
    for i, s in enumerate(streams):
        if i >= lanes:
            out.append(("wait", streams[i - lanes]))  # the lane's last copy, before its reuse
        out.append(("copy", s))
    return out + [("wait", s) for s in streams[-lanes:]]


@pytest.mark.parametrize("slots,lanes", [(8, 4), (1, 0)], ids=["8slots-4lanes", "1slot-sync"])
def test_copies_in_flight_wait_only_where_a_lane_is_reused(
    apps, ctl, chunk_files, fake_log, slots, lanes
):
    chunk_files.chunk_bytes, chunk_files.staging_bytes, chunk_files.writers = CB, slots * CB, 2
    c = apps()
    c.ok("init")
    vas = [_alloc(c, 2 * MiB, 41), _alloc(c, 2 * MiB, 42)]  # 2 x 32 chunks
    n = 2 * (2 * MiB // CB)
    for op, txn, phase, copy in (
        (Op.SAVE_ALLOCATIONS, 1, Phase.ACTIVE, COPIES[0]),
        (Op.PREPARE_UNICAST, 2, Phase.SAVED, None),
        (Op.LOAD_ALLOCATIONS, 3, Phase.PREPARED, COPIES[1]),
    ):
        calls = _op(ctl, c, fake_log, op, txn, phase)
        if copy is None:
            continue
        seq = _lanes(calls, copy)
        streams = [s for kind, s in seq if kind == "copy"]
        assert len(streams) == n
        assert len(set(streams)) == max(lanes, 1)
        if lanes:  # taken in turn
            assert streams == [streams[i % lanes] for i in range(n)]
        assert seq == _expected(streams, lanes)
        names = [fn for fn, _, _ in calls]
        assert (names.count("cuStreamCreate"), names.count("cuStreamDestroy_v2")) == (
            max(lanes, 1),
        ) * 2
        if op == Op.LOAD_ALLOCATIONS:  # placed where the app maps them: no staging mapping
            maps = [int(a["ptr"], 16) for fn, a, res in calls if fn == "cuMemMap"]
            assert maps == vas
            assert [fn for fn in names if fn in ("cuMemAddressReserve", "cuMemAddressFree")] == []
            # every chunk to its offset at the app's VA (in the order the readers verified them)
            assert sorted(int(a["dst"], 16) for fn, a, _ in calls if fn == copy) == sorted(
                va + k * CB for va in vas for k in range(n // 2)
            )
    r = ctl(c).request(Op.RESTORE_UNICAST, txn_id=4, expected_phase=Phase.LOADED)
    assert r.reply.status == Status.OK, r.message
    for va, seed in zip(vas, (41, 42)):
        c.ok(f"check {va} {2 * MiB} {seed}")
