"""The chunk store on the wire (protocol.h "Chunk store"; decisions D34), on fakecuda:
- a SAVE_ALLOCATIONS with the known-digest table writes only the chunks whose digest is not
  in it (bytes written counted by the reply and by the file's st_blocks), and its chunk table
  still lists every digest;
- a LOAD_ALLOCATIONS with sources reads the other chunks from the older pack at the refs'
  offsets, and the device holds exactly the saved bytes;
- a source chunk whose bytes differ refuses the load naming pid, allocation, chunk, source and
  offset, and nothing is loaded; after the pack is repaired the same load works;
- a ref outside its source refuses before any allocation is created."""

from __future__ import annotations

import hashlib
import os

from cuinterpose.coordinator.carrierfiles import CarrierFiles, carried_streams
from cuinterpose.coordinator.protocol import Op, Phase, Status

from .conftest import GRAN
from .test_chunks import _alloc, _records

CB = 64 << 10


def _request(ctl, c, files, op, txn, phase):
    """``op``, with ``files``' carriers when it is SAVE/LOAD_ALLOCATIONS."""
    if op not in (Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS):
        return ctl(c).request(op, txn_id=txn, expected_phase=phase), None
    recs = _records(ctl, c) if op == Op.SAVE_ALLOCATIONS else None
    streams = carried_streams(recs) if recs is not None else files.streams_seen
    req = files.request(op, c.pid, streams)
    try:
        return ctl(c).request(op, txn_id=txn, expected_phase=phase, carriers=req), streams
    finally:
        CarrierFiles.close(req)


def _save(ctl, c, files, txn):
    r, streams = _request(ctl, c, files, Op.SAVE_ALLOCATIONS, txn, Phase.ACTIVE)
    assert r.reply.status == Status.OK, r.message
    from cuinterpose.coordinator.protocol import parse_chunk_table

    files.saved(c.pid, parse_chunk_table(r.chunk_table, files.chunk_bytes))
    files.streams_seen = streams
    return r


def test_second_save_writes_only_the_changed_chunk_and_load_reads_the_rest(apps, ctl, tmp_path):
    size = 2 * GRAN  # 4 MiB: 64 chunks of 64 KiB
    packs = tmp_path / "packs"
    c = apps()
    c.ok("init")
    va = _alloc(c, size, 3)
    first = CarrierFiles(
        packs, chunk_bytes=CB, staging_bytes=4 * CB, store="s", prefix="a-", known={}
    )
    r = _save(ctl, c, first, 1)
    assert r.reply.reserved[2] == size  # every byte written
    r = ctl(c).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    [(aid, _)] = first.streams_seen
    (t1,) = first.tables.values()
    old_pack = first.name(c.pid, aid)
    known = {d: (old_pack, i * CB) for i, d in enumerate(t1.checksums)}

    c.ok(f"fill {va + size - CB} {CB} 9")  # the last chunk changes
    second = CarrierFiles(
        packs, chunk_bytes=CB, staging_bytes=4 * CB, store="s", prefix="b-", known=known
    )
    r = _save(ctl, c, second, 3)
    assert r.reply.reserved[2] == CB  # only the changed chunk was written
    (t2,) = second.tables.values()
    assert t2.checksums[:-1] == t1.checksums[:-1] and t2.checksums[-1] != t1.checksums[-1]
    new_path = second.path(c.pid, aid)
    with open(new_path, "rb") as f:
        data = f.read()
    assert len(data) == size and data[: size - CB] == bytes(size - CB)  # holes
    assert hashlib.blake2b(data[size - CB :], digest_size=32).digest() == t2.checksums[-1]
    assert os.stat(new_path).st_blocks * 512 <= 2 * CB
    refs = second.refs[(c.pid, aid.hex())]
    assert refs == {i: (old_pack, i * CB) for i in range(size // CB - 1)}
    assert second.streams_json()[0]["refs"][:2] == [[0, old_pack, 0], [1, old_pack, CB]]

    r = ctl(c).request(Op.PREPARE_UNICAST, txn_id=4, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    # a corrupt chunk in the old pack refuses the load: nothing loaded, still PREPARED
    old_path = packs / old_pack
    with open(old_path, "r+b") as f:
        f.seek(2 * CB + 7)
        good = f.read(1)
        f.seek(2 * CB + 7)
        f.write(bytes([good[0] ^ 0xFF]))
    r, _ = _request(ctl, c, second, Op.LOAD_ALLOCATIONS, 5, Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    assert r.message.startswith(
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {aid.hex()}: chunk 2 of chunk store source 0 "
        f"at offset {2 * CB} has checksum blake2b-256 "
    )
    assert r.message.endswith(f"pid {c.pid} stays PREPARED")
    with open(old_path, "r+b") as f:
        f.seek(2 * CB + 7)
        f.write(good)
    for k, (op, exp) in enumerate(
        ((Op.LOAD_ALLOCATIONS, Phase.PREPARED), (Op.RESTORE_UNICAST, Phase.LOADED)), 6
    ):
        r, _ = _request(ctl, c, second, op, k, exp)
        assert r.reply.status == Status.OK, r.message
    assert r.reply.phase == Phase.ACTIVE
    c.ok(f"check {va} {size - CB} 3")
    c.ok(f"check {va + size - CB} {CB} 9")


def test_ref_outside_its_source_refuses_before_anything_is_created(apps, ctl, tmp_path):
    size = GRAN
    packs = tmp_path / "packs"
    c = apps()
    c.ok("init")
    va = _alloc(c, size, 5)
    files = CarrierFiles(packs, chunk_bytes=CB, staging_bytes=4 * CB, store="s", known={})
    _save(ctl, c, files, 1)
    [(aid, _)] = files.streams_seen
    r = ctl(c).request(Op.PREPARE_UNICAST, txn_id=2, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    own = files.name(c.pid, aid)
    files.refs[(c.pid, aid.hex())] = {3: (own, size - CB + 1)}  # one byte past the end
    r, _ = _request(ctl, c, files, Op.LOAD_ALLOCATIONS, 3, Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {aid.hex()}: the ref of chunk 3 (source 0, "
        f"offset {size - CB + 1}) lies outside the allocation ({size // CB} chunks) or its source "
        f"({size} bytes); nothing was changed and pid {c.pid} stays PREPARED"
    )
    files.refs[(c.pid, aid.hex())] = {3: (own, 3 * CB)}  # a ref to its own place works
    for k, (op, exp) in enumerate(
        ((Op.LOAD_ALLOCATIONS, Phase.PREPARED), (Op.RESTORE_UNICAST, Phase.LOADED)), 4
    ):
        r, _ = _request(ctl, c, files, op, k, exp)
        assert r.reply.status == Status.OK, r.message
    c.ok(f"check {va} {size} 5")
