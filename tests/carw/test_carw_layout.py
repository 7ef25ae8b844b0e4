"""carw's pure parts: the buffer layout, the values and sums, and the evidence verdict."""

from __future__ import annotations

from array import array

from cuinterpose.workloads.carw import evidence
from cuinterpose.workloads.carw import layout as L


def test_slot_sizes_and_offsets():
    assert (L.slot_bytes(4), L.data_bytes(4)) == (48, 96)
    assert [L.slot_offset(s, 4) for s in (1, 2, 3, 4)] == [48, 0, 48, 0]


def test_slot_roundtrip_and_checksum_names_rank_and_step():
    raw = L.encode_slot(2, 7, 5)
    assert len(raw) == L.slot_bytes(5)
    seq, check, vals = L.decode_slot(raw, 5)
    assert seq == 7 and vals == L.contribution(2, 7, 5)
    assert check == L.checksum(vals, 7, 2)
    assert check != L.checksum(vals, 7, 1) and check != L.checksum(vals, 6, 2)


def test_contributions_differ_by_rank_and_step_and_stay_32_bit():
    c = {(r, s): L.contribution(r, s, 64) for r in range(4) for s in (1, 2)}
    assert len({v.tobytes() for v in c.values()}) == 8
    assert max(max(v) for v in c.values()) <= L.MASK32


def test_expected_sum_is_the_elementwise_sum():
    want = array("Q", (sum(L.contribution(r, 3, 8)[i] for r in range(4)) for i in range(8)))
    assert L.expected_sum(4, 3, 8) == want
    # a peer read at the wrong VA (rank 1's buffer twice, rank 2's never) gives another sum
    wrong = array("Q", (sum(L.contribution(r, 3, 8)[i] for r in (0, 1, 1, 3)) for i in range(8)))
    assert wrong != want


def test_table_and_signal_roundtrip():
    rows = [(0x7F0000200000, 0x7F0000400000), (0x7F0000600000, 0x7F0000800000)]
    raw = L.encode_table(rows)
    assert len(raw) == 2 * L.ROW_BYTES and L.decode_table(raw) == rows
    sig = L.encode_signal(41)
    assert len(sig) == L.SIGNAL_BYTES and L.decode_signal(sig) == 41


def _done(rank, steps, **kw):
    log = evidence.StepLog(rank)
    for s in steps:
        log.step(s, True)
    log.table(True)
    rep = log.report()
    rep.update(kw)
    return rep


def _vas(rank, after, table=((1, 2), (3, 4))):
    return {
        "rank": rank,
        "pid": 100 + rank,
        "after_restore": after,
        "data_va": 10 + rank,
        "signal_va": 20 + rank,
        "table_va": 30 + rank,
        "table": [list(r) for r in table],
    }


def test_summary_ok_with_one_restore():
    done = [_done(0, range(1, 6)), _done(1, range(1, 6))]
    vas = [_vas(0, False), _vas(1, False), _vas(0, True), _vas(1, True)]
    s = evidence.summarize(2, 5, done, vas)
    assert (s["ok"], s["restores_seen"], s["va_tables_identical"], s["sums_exact"]) == (
        True,
        1,
        True,
        10,
    ), s["problems"]


def test_summary_names_a_duplicate_a_gap_and_a_moved_table():
    done = [_done(0, [1, 2, 2, 4, 5]), _done(1, range(1, 6))]
    vas = [_vas(0, False), _vas(1, False), _vas(0, True), _vas(1, True, table=((1, 2), (3, 5)))]
    s = evidence.summarize(2, 5, done, vas)
    assert s["ok"] is False
    assert s["problems"] == [
        "rank 0: steps distinct=4, expected 5",
        "rank 0: steps gaps=1, expected 0",
        "rank 0: steps duplicates=1, expected 0",
        "rank 0: steps in_order=False, expected True",
        "VAs or pointer table changed across a restore on ranks [1]",
    ]
    assert s["va_tables_identical"] is False


def test_steplog_counts_every_failure_and_keeps_the_first():
    log = evidence.StepLog(3)
    for i in range(evidence.MAX_FAILURES + 2):
        log.fail(f"f{i}")
    log.table(False, "moved")
    r = log.report()
    assert (r["failed"], r["table_changed"], len(r["failures"])) == (
        evidence.MAX_FAILURES + 3,
        1,
        evidence.MAX_FAILURES,
    )
    assert r["failures"][0] == "f0"
