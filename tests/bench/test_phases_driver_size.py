"""bench/phases.py --driver real without --size takes the driver's minimum granularity (the H200's
2 MiB; 64 KiB would be refused, docs/gpu-validation.md finding 3). Here fakecuda stands in for
"the libcuda.so.1 the loader finds", through LD_LIBRARY_PATH (and LIBRARY_PATH for the link)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_real_driver_default_size_is_its_granularity(fakecuda_dir):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env |= {"LD_LIBRARY_PATH": str(fakecuda_dir), "LIBRARY_PATH": str(fakecuda_dir)}
    res = subprocess.run(
        [sys.executable, str(REPO / "bench" / "phases.py"), "--driver", "real", "--k", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("driver=real size=2097152 B per allocation"), res.stdout[:300]
    saved = [
        ln for ln in res.stdout.splitlines() if re.match(r"\s+2 capture\s+SAVE_ALLOCATIONS", ln)
    ]
    assert len(saved) == 1 and saved[0].split()[6] == str(2 * 2097152)  # carrier bytes: K x size
