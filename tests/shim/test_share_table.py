"""docs/shim.md section 11 "What real stacks share" stays true: its one table (between the
``share-table`` markers) has the five columns, a row per mechanism, and every row names a test,
``path::function``, that exists (the file is there and defines the function)."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def rows() -> list[list[str]]:
    text = (REPO / "docs" / "shim.md").read_text()
    table = text.split("<!-- share-table -->", 1)[1].split("<!-- /share-table -->", 1)[0]
    lines = [ln for ln in table.strip().splitlines() if ln.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "Mechanism",
        "Stacks",
        "Default",
        "What cuinterpose does",
        "Test",
    ]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_every_row_names_a_test_that_exists():
    got = rows()
    assert len(got) >= 15
    missing = []
    for row in got:
        assert len(row) == 5 and all(row), row
        m = re.fullmatch(r"`(tests/[\w/]+\.py)::(test_\w+)`", row[4])
        assert m, f"{row[0]}: the test column must be `tests/...py::test_name`, not {row[4]!r}"
        path = REPO / m.group(1)
        if not path.is_file() or not re.search(rf"^def {m.group(2)}\(", path.read_text(), re.M):
            missing.append(f"{row[0]}: {row[4]}")
    assert missing == []
