"""What restore trusts of ``chunks`` and ``DIR/chunks/`` (agent/snapshot/chunks.py;
docs/snapshot-format.md): a good snapshot passes; every other case refuses naming the file or
field, and nothing under the snapshot changes."""

from __future__ import annotations

import hashlib
import os

import pytest

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.snapshot import chunks
from cuinterpose.coordinator.protocol import cui_checksum64

CB = 64 << 10
AID = "9f3c" + "11" * 14


def _snapshot(tmp_path):
    data = os.urandom(CB) + bytes(CB) + os.urandom(100)  # dense, zero, short last chunk
    sums = [
        hashlib.blake2b(data[i * CB : (i + 1) * CB], digest_size=32).hexdigest() for i in (0, 2)
    ]
    checksums = [sums[0], None, sums[1]]
    (tmp_path / "chunks").mkdir()
    f = tmp_path / "chunks" / f"shared-4119-{AID}.bin"
    f.write_bytes(data)
    stream = {
        "file": f"chunks/shared-4119-{AID}.bin",
        "kind": "shared",
        "pid": 4119,
        "alloc_id": AID,
        "bytes": len(data),
        "zero": [1],
        "checksums": checksums,
    }
    digest = b"".join(bytes(32) if c is None else bytes.fromhex(c) for c in checksums)
    carrier = {
        "pid": 4119,
        "alloc_id": AID,
        "bytes": len(data),
        "checksum": f"{cui_checksum64(digest):016x}",
    }
    m = {"chunks": {"chunk_bytes": CB, "checksum": "blake2b-256", "streams": [stream]}}
    return m, [carrier], f


def _files(tmp_path):
    return {p.name: p.read_bytes() for p in (tmp_path / "chunks").iterdir() if p.is_file()}


def test_good_snapshot_passes(tmp_path):
    m, carriers, _ = _snapshot(tmp_path)
    chunks.check(tmp_path, m, carriers)


@pytest.mark.parametrize(
    "case, message",
    [
        ("unlisted", "chunks/stray.bin is not listed in the manifest's chunks.streams"),
        ("symlink", "chunks/link.bin is not a regular file"),
        ("missing", "listed in the manifest is missing"),
        ("size", "bytes, the manifest says"),
        ("name", "is not chunks/shared-4119-"),
        ("carrier", "disagrees with the carrier record of pid 4119"),
        ("zero", "field zero differs from the null checksums"),
        ("count", "3 checksums expected"),
        ("absent", "the capture carries 1 allocations but the manifest has no field chunks"),
        (
            "checksum",
            'field chunks must be {"chunk_bytes", "checksum": "blake2b-256" or "sha256", ...}',
        ),
    ],
)
def test_refusals_name_the_file_and_change_nothing(tmp_path, case, message):
    m, carriers, f = _snapshot(tmp_path)
    s = m["chunks"]["streams"][0]
    if case == "unlisted":
        (tmp_path / "chunks" / "stray.bin").write_bytes(b"x")
    elif case == "symlink":
        os.symlink(f, tmp_path / "chunks" / "link.bin")
    elif case == "missing":
        f.unlink()
    elif case == "size":
        with open(f, "ab") as fh:
            fh.write(b"!")
    elif case == "name":
        s["file"] = "chunks/other.bin"
    elif case == "carrier":
        carriers[0]["checksum"] = "0" * 16
    elif case == "zero":
        s["zero"] = []
    elif case == "count":
        s["checksums"] = s["checksums"][:2]
    elif case == "absent":
        del m["chunks"]
    elif case == "checksum":
        m["chunks"]["checksum"] = "md5"
    before = _files(tmp_path)
    with pytest.raises(SnapshotError) as ei:
        chunks.check(tmp_path, m, carriers)
    assert message in str(ei.value)
    assert str(ei.value).endswith("restore refused, snapshot untouched")
    assert _files(tmp_path) == before


def test_normalize_lifts_the_capture_chunks(tmp_path):
    cap = {
        "chunks": {
            "chunk_bytes": CB,
            "checksum": "blake2b-256",
            "streams": [],
            "directory": "/x",
            "private": True,
        }
    }
    m = {"capture": cap}
    chunks.normalize(m)
    assert m["chunks"] == {"chunk_bytes": CB, "checksum": "blake2b-256", "streams": []}
    assert m["capture"]["chunks"] == m["chunks"]


def test_bad_chunk_where_names_the_file_and_the_byte_range(tmp_path):
    """Every refusal of a damaged chunk names the file (chunk file, or chunk store pack) and
    the byte range: the shim's checksum, short-file and read-failure messages alike, for a
    chunk of the stream's own file and for a chunk a store snapshot refers to."""
    from cuinterpose.agent.run.carriers import bad_chunk_where
    from cuinterpose.coordinator.carrierfiles import CarrierFiles

    aid, other = "ab" * 16, "cd" * 16
    m = {
        "chunks": {
            "chunk_bytes": 65536,
            "streams": [
                {"pid": 7, "alloc_id": other, "file": f"chunks/shared-7-{other}.bin"},
                {
                    "pid": 7,
                    "alloc_id": aid,
                    "file": f"chunks/shared-7-{aid}.bin",
                    "bytes": 3 * 65536 + 10,
                },
            ],
        }
    }
    plain = CarrierFiles(tmp_path / "chunks", chunk_bytes=65536)
    plain.names[(7, aid)] = f"shared-7-{aid}.bin"
    own = f"{tmp_path}/chunks/shared-7-{aid}.bin"
    msg = f"allocation {aid}: chunk 3 of its chunk file has checksum sha256 00, recorded 11"
    assert bad_chunk_where(msg, plain, 7, m) == f"; the chunk is bytes 196608..196617 of {own}"
    assert bad_chunk_where(msg.replace("chunk 3", "chunk 1"), plain, 7, m) == (
        f"; the chunk is bytes 65536..131071 of {own}"
    )
    short = (
        f"allocation {aid}: its chunk file ends inside chunk 2 (shorter than the 10 bytes saved)"
    )
    assert bad_chunk_where(short, plain, 7, m) == f"; the chunk is bytes 131072..196607 of {own}"
    # a store snapshot: chunk 2 refers to bytes of an older pack, chunk 0 is in its own pack
    packs = CarrierFiles(tmp_path / "packs", chunk_bytes=65536, store="../s/packs")
    packs.names[(7, aid)] = "p2-shared.bin"
    packs.refs[(7, aid)] = {2: ("p1-shared.bin", 5 * 65536)}
    ref = f"allocation {aid}: chunk 2 of chunk store source 0 at offset 327680 has checksum x"
    assert bad_chunk_where(ref, packs, 7, m) == (
        f"; the chunk is bytes 327680..393215 of {tmp_path}/packs/p1-shared.bin"
    )
    read = (
        f"allocation {aid}: reading chunk 0 of its chunk file failed: Input/output error (errno 5)"
    )
    assert bad_chunk_where(read, packs, 7, m) == (
        f"; the chunk is bytes 0..65535 of {tmp_path}/packs/p2-shared.bin"
    )
    # other messages, or no carriers: nothing
    assert bad_chunk_where("LOAD_ALLOCATIONS: pid 7: out of memory", plain, 7, m) == ""
    assert bad_chunk_where(msg, None, 7, m) == ""
