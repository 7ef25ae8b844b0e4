"""The shim's C cui_checksum64 equals the protocol.h definition as mirrored in Python, on
lengths around every word boundary."""

from __future__ import annotations

import random
import subprocess

from cuinterpose.coordinator.protocol import cui_checksum64

from .conftest import C_DIR, SHIM_SRC


def test_c_checksum_matches_python(build_c, tmp_path):
    exe = build_c(
        [C_DIR / "checksum_probe.c", SHIM_SRC / "src" / "checksum.c"],
        "shim_checksum_probe",
        extra=(f"-I{SHIM_SRC / 'src'}", f"-I{SHIM_SRC / 'include'}"),
    )
    rng = random.Random(1234)
    blobs = [b"", b"\x01", bytes(7), bytes(8), b"abcdefghi", bytes(range(256)) * 5 + b"xyz"]
    blobs += [rng.randbytes(n) for n in (15, 16, 17, 4099)]
    paths = []
    for k, b in enumerate(blobs):
        p = tmp_path / f"blob{k}"
        p.write_bytes(b)
        paths.append(str(p))
    out = subprocess.run(
        [str(exe), *paths], capture_output=True, text=True, check=True
    ).stdout.split()
    assert [int(x, 16) for x in out] == [cui_checksum64(b) for b in blobs]
    # fixed vector: the empty input (h0 = golden ^ 0, finalised)
    assert int(out[0], 16) == cui_checksum64(b"")
