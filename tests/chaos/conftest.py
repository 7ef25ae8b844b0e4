"""The chaos suite (issue 11, item 6): faults injected by trigger at every step boundary,
every write and every op; each run records its outcome in ``tally`` and the totals are printed
at the end of the session ("chaos: runs N, outcomes {...}, lost bytes 0")."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tally  # noqa: E402


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
