#!/usr/bin/env python3
"""Which of our Python dependencies this interpreter lacks, and their install from the kit.

    python3 scripts/gpu_check_deps.py WHEELS_DIR TARGET_DIR RESULT_JSON

For every wheel in WHEELS_DIR (``NAME-VERSION-…whl``, as ``scripts/gpu-check.sh pack``
downloads them at the versions this project's .venv runs), looks up the distribution this
interpreter already has (``importlib.metadata``, TARGET_DIR not on the path). Kept: the same
version. Installed into TARGET_DIR (``pip install --no-index --no-deps --target``): a missing
or different one, so that the checks run with the versions the suite ran with. TARGET_DIR
goes first on ``PYTHONPATH`` afterwards (gpu-check.sh).

Writes RESULT_JSON (a setup result of gpu_check.py: ``{"name": "deps", "status", "reason",
"keys", "detail": {"kept": {name: version}, "installed": {name: [had, version]}}}``) and
prints its ``gpu-check: deps …`` line. Exit status 0 when every wheel is usable, 1 if pip
failed (its last line is the reason).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import time

WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-.*\.whl$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def have(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    wheels, target, result_path = (pathlib.Path(a) for a in argv)
    t0 = time.monotonic()
    kept, install, files = {}, {}, []
    for whl in sorted(wheels.glob("*.whl")):
        m = WHEEL.match(whl.name)
        if not m:
            continue
        name, version = canonical(m["name"]), m["version"]
        had = have(name)
        if had == version:
            kept[name] = version
        else:
            install[name] = [had, version]
            files.append(str(whl))
    status, reason = "PASS", ""
    if files:
        target.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--upgrade",
            "--target",
            str(target),
            *files,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            status = "FAIL"
            reason = f"pip: {(res.stderr.strip().splitlines() or ['exit %d' % res.returncode])[-1]}"
    keys = {
        "kept": len(kept),
        "installed": len(install),
        "from_kit": ",".join(f"{n}={v[1]}" for n, v in install.items()) or "none",
    }
    result = {
        "name": "deps",
        "status": status,
        "reason": reason,
        "keys": keys,
        "detail": {"kept": kept, "installed": install, "python": sys.version},
        "seconds": round(time.monotonic() - t0, 1),
    }
    result_path.write_text(json.dumps(result))
    parts = [f"gpu-check: deps {status}"] + ([f"({reason})"] if reason else [])
    parts += [f"{k}={v}" for k, v in keys.items()] + [f"t={result['seconds']}s"]
    print(" ".join(parts), flush=True)
    return 0 if status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
