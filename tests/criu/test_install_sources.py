"""install-criu.sh derives its trixie sources from the machine's, changing only the suite."""

from __future__ import annotations

import os
import subprocess

from criu_helpers import REPO

SCRIPT = REPO / "scripts" / "install-criu.sh"


def codename() -> str:
    out = subprocess.run(
        ["sh", "-c", ". /etc/os-release && echo $VERSION_CODENAME"], capture_output=True, text=True
    ).stdout.strip()
    return out


def test_print_sources_changes_only_the_suite(tmp_path):
    cn = codename()
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list.d" / "debian.sources").write_text(
        "Types: deb deb-src\n"
        "# http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
        "URIs: http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
        f"Suites: {cn} {cn}-updates\n"
        "Components: main contrib\n"
        "Check-Valid-Until: no\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        "\n"
        "Types: deb\n"
        "URIs: http://deb.debian.org/debian\n"
        f"Suites: {cn}-backports\n"
        "Components: main\n"
        "Enabled: no\n"
    )
    (etc / "sources.list.d" / "docker.sources").write_text(
        f"Types: deb\nURIs: https://download.docker.com/linux/debian\nSuites: {cn}\n"
        "Components: stable\nSigned-By: /etc/apt/keyrings/docker.asc\n"
    )
    (etc / "sources.list").write_text(
        f"deb http://mirror.example.org/debian {cn} main non-free-firmware\n"
        f"deb-src http://mirror.example.org/debian {cn} main\n"
        f"deb [arch=amd64] http://security.example.org/debian-security {cn}-security main\n"
        "deb [signed-by=/etc/apt/keyrings/x.gpg] http://example.com/debian stable main\n"
    )
    env = dict(os.environ, CRIU_APT_ETC=str(etc), CRIU_SUITE="trixie")
    res = subprocess.run(
        ["bash", str(SCRIPT), "--print-sources"], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    sources, one_line = res.stdout.split("# one-line:\n")
    assert sources.strip() == (
        "Types: deb\n"
        "URIs: http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
        "Suites: trixie trixie-updates\n"
        "Components: main contrib\n"
        "Check-Valid-Until: no\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
    )
    assert one_line.splitlines() == [
        "deb http://mirror.example.org/debian trixie main non-free-firmware",
        "deb [arch=amd64] http://security.example.org/debian-security trixie-security main",
    ]


def test_print_sources_refuses_without_debian_entries(tmp_path):
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    env = dict(os.environ, CRIU_APT_ETC=str(etc))
    res = subprocess.run(
        ["bash", str(SCRIPT), "--print-sources"], env=env, capture_output=True, text=True
    )
    assert res.returncode != 0 and "CRIU_APT_SOURCES" in res.stderr
