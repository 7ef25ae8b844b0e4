"""A two-process tree whose stdout is a pipe to a reader outside it, for the placement tests.

Usage: python pipe_tree.py INFO_JSON   (started with setsid; stdout a pipe)

The root forks one child; each writes "<who> <n>\\n" lines (who: "root" or "child", n = 0, 1,
...) to fd 1 every 10 ms with one write(2) each (shorter than PIPE_BUF: never torn). The root
writes INFO_JSON ({"root", "child"}) once both run. A failed write (EPIPE: no reader) ends the
process.
"""

from __future__ import annotations

import json
import os
import sys
import time


def loop(who: str) -> None:
    n = 0
    while True:
        os.write(1, f"{who} {n}\n".encode())
        n += 1
        time.sleep(0.01)


def main() -> None:
    child = os.fork()
    if child == 0:
        loop("child")
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"root": os.getpid(), "child": child}, f)
    os.rename(tmp, sys.argv[1])
    loop("root")


if __name__ == "__main__":
    main()
