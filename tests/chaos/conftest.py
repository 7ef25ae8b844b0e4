"""The chaos suite (issue 11, item 6): faults injected by trigger at every step boundary,
every write and every op; each run records its outcome in ``tally`` and the totals are printed
at the end of the session ("chaos: runs N, outcomes {...}, lost bytes 0")."""

from __future__ import annotations

import pathlib
import shlex
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tally  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture
def enospc(build_c, criu_ok, tmp_path):
    """(library path, CRIU wrapper path)."""
    lib = build_c([HERE / "c" / "enospc.c"], "chaos-enospc.so", extra=("-shared", "-fPIC"))
    wrapper = tmp_path / "criu-enospc"
    head = pathlib.Path(criu_ok[0]).read_text(errors="replace") if criu_ok else ""
    # CRIU counts its writes apart from the agent's (CHAOS_ENOSPC_CRIU_*): its count varies by
    # a few between runs, the agent's does not
    own = "export " + " ".join(
        f'CHAOS_ENOSPC_{v}="$CHAOS_ENOSPC_CRIU_{v}"' for v in ("COUNT", "AT", "LOG")
    )
    if "--inhibit-cache" in head and head.startswith("#!") and "\nexec " in head:
        # scripts/install-criu.sh's wrapper runs CRIU through its own ld.so: preload there
        body = head.replace("--inhibit-cache", f"--inhibit-cache --preload {lib}")
        wrapper.write_text(body.replace("\nexec ", f"\n{own}\nexec ", 1))
    else:
        lp = shlex.quote(str(lib))
        wrapper.write_text(f'#!/bin/sh\n{own}\nLD_PRELOAD={lp} exec {shlex.join(criu_ok)} "$@"\n')
    wrapper.chmod(0o755)
    return lib, wrapper


def pytest_terminal_summary(terminalreporter):
    s = tally.summary()
    if not s["runs"]:
        return
    terminalreporter.section("chaos counts")
    terminalreporter.write_line(
        f"chaos: runs {s['runs']}, outcomes {s['outcomes']}, lost bytes {s['lost_bytes']}"
    )
    for kind, counts in s["by_kind"].items():
        terminalreporter.write_line(f"  {kind}: {counts}")
