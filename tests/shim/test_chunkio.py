"""The shim's BLAKE2b-256 (interposer/src/blake2b.c, RFC 7693) equals hashlib byte for byte, and
the staging ring (chunkio.c) writes chunk files in the issue 12 chunk format and reads them
back verified, built plain and under ASan/UBSan (c/chunkio_probe.c):
- every chunk at offset i * chunk_bytes, the last one short, all-zero chunks not written (the
  file stays sparse there), one digest per non-zero chunk equal to hashlib's;
- a read returns the bytes; a flipped byte is refused naming the chunk and the digest found;
- a write to a full device (/dev/full) stops every writer with ENOSPC naming the chunk;
- direct I/O: a file given to cui_cio_direct gets every aligned chunk with O_DIRECT (counted; its
  pages are not left in the page cache), a short last chunk falls back to the page cache, the
  bytes are the same either way and the descriptor's flags are put back; /dev/full refuses
  O_DIRECT and still fails with ENOSPC."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import subprocess

import pytest

from .conftest import C_DIR, SHIM_SRC

CHUNK = 64 << 10
KIND_WRITE, KIND_CHECKSUM = 1, 4


def _probe(build_c, sanitize):
    return build_c(
        [C_DIR / "chunkio_probe.c"]
        + [SHIM_SRC / "src" / f for f in ("chunkio.c", "blake2b.c", "sha256.c")],
        "shim_chunkio_probe",
        sanitize=sanitize,
        extra=(f"-I{SHIM_SRC / 'src'}", f"-I{SHIM_SRC / 'include'}"),
    )


def b2(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _blobs(tmp_path) -> tuple[list[bytes], list[str]]:
    """Random inputs at every padding edge of both hashes (64- and 128-byte blocks) and chunk
    sizes, and two constant ones; written to files."""
    rng = random.Random(7)
    lengths = [0, 1, 2, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 255, 256, 257, 1000, 4096]
    lengths += [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 1 << 20]
    blobs = [rng.randbytes(n) for n in lengths] + [bytes(128), b"\xff" * 129]
    paths = []
    for k, b in enumerate(blobs):
        p = tmp_path / f"blob{k}"
        p.write_bytes(b)
        paths.append(str(p))
    return blobs, paths


def test_blake2b_matches_hashlib(build_c, tmp_path):
    exe = _probe(build_c, False)
    blobs, paths = _blobs(tmp_path)
    out = subprocess.run(
        [str(exe), "hash", *paths], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [b2(b) for b in blobs]
    # RFC 7693 appendix A's input "abc" (its BLAKE2b-512 vector; here the 256-bit digest)
    (tmp_path / "abc").write_bytes(b"abc")
    got = subprocess.run(
        [str(exe), "hash", str(tmp_path / "abc")], capture_output=True, text=True, check=True
    ).stdout.split()
    assert got == ["bddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319"]


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_sha256_matches_hashlib_both_compressions(build_c, tmp_path, sanitize):
    exe = _probe(build_c, sanitize)
    blobs, paths = _blobs(tmp_path)
    want = [hashlib.sha256(b).hexdigest() for b in blobs]
    for mode in ("sha256", "sha256-portable"):
        out = subprocess.run(
            [str(exe), mode, *paths], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == want, mode
    # FIPS 180-2 appendix B.1's "abc"
    (tmp_path / "abc").write_bytes(b"abc")
    got = subprocess.run(
        [str(exe), "sha256", str(tmp_path / "abc")], capture_output=True, text=True, check=True
    )
    assert got.stdout.split() == [
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    ]
    # the accelerated compression is the one in use exactly when the CPU reports SHA-NI
    accel = subprocess.run(
        [str(exe), "accelerated"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with open("/proc/cpuinfo") as f:
        flags = {w for ln in f if ln.startswith("flags") for w in ln.split(":", 1)[1].split()}
    assert accel == ("1" if {"sha_ni", "ssse3", "sse4_1"} <= flags else "0")


def _data() -> tuple[bytes, list[int]]:
    """20 chunks and a short one: chunks 3, 4 and 10..17 all zero (10 of 21), the rest random."""
    rng = random.Random(99)
    zero = [3, 4, *range(10, 18)]
    parts = [bytes(CHUNK) if i in zero else rng.randbytes(CHUNK) for i in range(20)]
    parts.append(rng.randbytes(1234))
    return b"".join(parts), zero


@pytest.mark.parametrize("algo", ["blake2b-256", "sha256"])
@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_ring_writes_and_reads_chunk_files(build_c, tmp_path, sanitize, algo):
    exe = _probe(build_c, sanitize)
    env = dict(os.environ, **({"PROBE_SHA256": "1"} if algo == "sha256" else {}))

    def b2(data: bytes) -> str:  # the chunk digest of this run's algorithm
        return (
            hashlib.sha256(data).hexdigest()
            if algo == "sha256"
            else hashlib.blake2b(data, digest_size=32).hexdigest()
        )

    data, zero = _data()
    out = tmp_path / "stream.bin"
    w = subprocess.run(
        [str(exe), "write", str(out), str(CHUNK), str(2 * CHUNK), "3"],
        input=data,
        capture_output=True,
        check=True,
        env=env,
    )
    lines = w.stdout.decode().split("\n")[:-1]
    n = -(-len(data) // CHUNK)
    want = ["zero" if i in zero else b2(data[i * CHUNK : (i + 1) * CHUNK]) for i in range(n)]
    assert lines[:n] == want
    assert lines[n] == f"written {len(data) - len(zero) * CHUNK} direct 0 flags same"
    assert out.read_bytes() == data
    st = os.stat(out)
    assert st.st_size == len(data)
    # the zero chunks are holes: fewer blocks than the bytes (tmpfs and ext4 both punch them)
    assert st.st_blocks * 512 <= len(data) - len(zero) * CHUNK + 16 * 4096

    digests = "\n".join(lines[:n]).encode() + b"\n"
    r = subprocess.run(
        [str(exe), "read", str(out), str(CHUNK), str(2 * CHUNK), "3"],
        input=digests,
        capture_output=True,
        check=True,
        env=env,
    )
    assert r.stdout == data

    # one flipped byte in chunk 7: refused, naming chunk 7 and the digest of what was read
    bad = bytearray(data)
    bad[7 * CHUNK + 100] ^= 0x40
    out.write_bytes(bytes(bad))
    r = subprocess.run(
        [str(exe), "read", str(out), str(CHUNK), str(2 * CHUNK), "3"],
        input=digests,
        capture_output=True,
        env=env,
    )
    assert r.returncode == 1 and r.stdout == b""
    found = b2(bytes(bad[7 * CHUNK : 8 * CHUNK]))
    assert r.stderr.decode().split() == ["error", str(KIND_CHECKSUM), "7", "0", found]


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_ring_write_error_stops_the_writers(build_c, sanitize):
    exe = _probe(build_c, sanitize)
    data, _ = _data()
    w = subprocess.run(
        [str(exe), "write", "/dev/full", str(CHUNK), str(4 * CHUNK), "4"],
        input=data,
        capture_output=True,
    )
    kind, chunk, err = w.stdout.decode().split()[1:]
    assert (w.returncode, int(kind), int(err)) == (1, KIND_WRITE, 28)  # ENOSPC
    assert int(chunk) not in (3, 4, *range(10, 18))  # a zero chunk is never written


def _resident(path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) of a shared read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _is_tmpfs(path) -> bool:
    """tmpfs keeps every file in the page cache, O_DIRECT or not (statfs f_type TMPFS_MAGIC)."""
    out = subprocess.run(
        ["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout, 16) == 0x01021994


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_ring_writes_direct_and_falls_back_for_a_short_chunk(build_c, tmp_path, sanitize):
    exe = _probe(build_c, sanitize)
    data, zero = _data()
    aligned = data[: 20 * CHUNK]  # whole chunks only
    nonzero = (20 - len(zero)) * CHUNK
    out = tmp_path / "direct.bin"
    w = subprocess.run(
        [str(exe), "write", str(out), str(CHUNK), str(2 * CHUNK), "3", "direct"],
        input=aligned,
        capture_output=True,
        check=True,
    )
    assert w.stdout.decode().split("\n")[20] == f"written {nonzero} direct {nonzero} flags same"
    # O_DIRECT bypassed the page cache: none of the file's pages are there (on a disk; tmpfs
    # is the page cache), while a buffered write leaves them all
    if not _is_tmpfs(tmp_path):
        assert _resident(out) == 0
        plain = tmp_path / "plain.bin"
        subprocess.run(
            [str(exe), "write", str(plain), str(CHUNK), str(2 * CHUNK), "3"],
            input=aligned,
            capture_output=True,
            check=True,
        )
        assert _resident(plain) == nonzero // mmap.PAGESIZE
    assert out.read_bytes() == aligned
    # one writer thread: the chunks go in order, the short last one turns O_DIRECT off
    tail = tmp_path / "tail.bin"
    w = subprocess.run(
        [str(exe), "write", str(tail), str(CHUNK), str(2 * CHUNK), "1", "direct"],
        input=data,
        capture_output=True,
        check=True,
    )
    written = len(data) - len(zero) * CHUNK
    assert (
        w.stdout.decode().split("\n")[21] == f"written {written} direct {written - 1234} flags same"
    )
    assert tail.read_bytes() == data and os.path.getsize(tail) == len(data)
    # a device that refuses O_DIRECT: buffered, and the error is the same
    w = subprocess.run(
        [str(exe), "write", "/dev/full", str(CHUNK), str(4 * CHUNK), "2", "direct"],
        input=data,
        capture_output=True,
    )
    kind, _, err = w.stdout.decode().split()[1:]
    assert (w.returncode, int(kind), int(err)) == (1, KIND_WRITE, 28)


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_device_that_refuses_direct_writes_gets_them_buffered_and_none_counted(
    build_c, tmp_path, sanitize
):
    """Every O_DIRECT write fails with EINVAL (c/einval_pwrite.c, a device wanting a larger
    alignment): each writer redoes its chunk through the page cache, the first failure turns
    the flag off for all, and no write counts as direct, however the four writers interleave."""
    exe = build_c(
        [C_DIR / "chunkio_probe.c", C_DIR / "einval_pwrite.c"]
        + [SHIM_SRC / "src" / f for f in ("chunkio.c", "blake2b.c", "sha256.c")],
        "shim_chunkio_probe_einval",
        sanitize=sanitize,
        extra=(
            f"-I{SHIM_SRC / 'src'}",
            f"-I{SHIM_SRC / 'include'}",
            f"-I{C_DIR}",
            "-include",
            "einval_pwrite.h",
            "-Dpwrite=einval_pwrite",
        ),
    )
    data, zero = _data()
    aligned = data[: 20 * CHUNK]
    out = tmp_path / "einval.bin"
    w = subprocess.run(
        [str(exe), "write", str(out), str(CHUNK), str(4 * CHUNK), "4", "direct"],
        input=aligned,
        capture_output=True,
        check=True,
    )
    assert (
        w.stdout.decode().split("\n")[20]
        == f"written {(20 - len(zero)) * CHUNK} direct 0 flags same"
    )
    assert out.read_bytes() == aligned
