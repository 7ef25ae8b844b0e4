"""Chaos kind 6: a seeded, bounded fuzz of the shim's control decoder under ASan/UBSan.

tests/chaos/c/fuzz_control.c runs as a fakecuda app under the shim, all three built with
ASan/UBSan (the shim and fakecuda as tests/shim/test_sanitize.py builds them), and sends
``N`` seeded random or mutated requests (random bytes, a flipped byte, truncated, oversized,
wrong version, unknown op) to its own control socket; every reply must be well-formed or the
connection closed; then INSPECT and a full SAVE -> PREPARE -> LOAD -> RESTORE cycle must work
with the allocation's bytes intact. The seed is printed (and reproduces the run).
"""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys

import pytest
import tally

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from shim.conftest import link_fakecuda  # noqa: E402
from shim.test_sanitize import asan_build, libasan, sanitized_env  # noqa: E402, F401

HERE = pathlib.Path(__file__).resolve().parent
N = 3000
SEED = int(os.environ.get("CUINTERPOSE_CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))


@pytest.mark.parametrize("seed", [SEED, 1])
def test_fuzz_control_decoder(asan_build, fake_env, build_c, seed):  # noqa: F811
    drv = build_c(
        [HERE / "c" / "fuzz_control.c"],
        "chaos_fuzz_control",
        sanitize=True,
        libs=link_fakecuda(asan_build[1]),
    )
    print(f"chaos fuzz seed {seed} (CUINTERPOSE_CHAOS_SEED={seed} reproduces it)")
    try:
        res = subprocess.run(
            [str(drv), str(seed), str(N)],
            env=sanitized_env(asan_build, fake_env),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        tally.record(f"fuzz seed {seed}", "hang")
        raise
    ok = res.returncode == 0 and "ERROR: AddressSanitizer" not in res.stderr
    tally.record(f"fuzz seed {seed}", "rolled_back" if ok else "lost")
    assert ok, f"seed {seed}: exit {res.returncode}\n{res.stderr[-4000:]}"
    assert "runtime error" not in res.stderr, res.stderr[-4000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("fuzz:")]
    words = line.split()
    assert (words[2], words[4]) == (str(seed), str(N)), line
    assert int(words[6]) + int(words[8]) == N, line
