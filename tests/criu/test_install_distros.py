"""The CRIU installer (agent/mech/criu_install.sh) and what the agent says without a CRIU it
can use (issue 28): Ubuntu's sources are derived like Debian's (suite resolute, universe
added), another distribution is refused naming the manual way, a CRIU older than 4.0 is passed
over by the installer and by the agent, and doctor names `cuinterpose-agent install-criu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from criu_helpers import REPO

from cuinterpose.agent.mech import criu_binary

INSTALLER = REPO / "agent" / "mech" / "criu_install.sh"
MANUAL = "install CRIU >= 4.0 yourself"

UBUNTU_OS_RELEASE = (
    'NAME="Ubuntu"\nVERSION_ID="24.04"\nVERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\n'
    "UBUNTU_CODENAME=noble\n"
)


def installer(*args, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CRIU_", "CUINTERPOSE_"))}
    env["CUINTERPOSE_CRIU_CACHE"] = str(tmp_path / "cache")
    env.update(env_extra)
    return subprocess.run(
        ["bash", str(INSTALLER), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_ubuntu_sources_take_resolute_and_universe(tmp_path):
    (tmp_path / "os-release").write_text(UBUNTU_OS_RELEASE)
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list.d" / "ubuntu.sources").write_text(
        "Types: deb\n"
        "URIs: http://archive.ubuntu.com/ubuntu/\n"
        "Suites: noble noble-updates\n"
        "Components: main restricted\n"
        "Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg\n"
        "\n"
        "Types: deb\n"
        "URIs: https://ppa.example.org/x/ubuntu\n"
        "Suites: noble\n"
        "Components: main\n"
        "Signed-By: /etc/apt/keyrings/ppa.gpg\n"
    )
    (etc / "sources.list").write_text(
        "deb http://ports.example.org/ubuntu-ports noble-security main universe\n"
        "deb http://deb.example.org/debian noble main\n"
    )
    res = installer(
        "--print-sources",
        env_extra={"CRIU_APT_ETC": str(etc), "CRIU_OS_RELEASE": str(tmp_path / "os-release")},
        tmp_path=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    sources, one_line = res.stdout.split("# one-line:\n")
    assert sources.strip() == (
        "Types: deb\n"
        "URIs: http://archive.ubuntu.com/ubuntu/\n"
        "Suites: resolute resolute-updates\n"
        "Components: main restricted universe\n"
        "Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg"
    )
    assert one_line.splitlines() == [
        "deb http://ports.example.org/ubuntu-ports resolute-security main universe"
    ]


def test_another_distribution_is_refused_naming_the_manual_way(tmp_path):
    (tmp_path / "os-release").write_text('NAME="Fedora Linux"\nID=fedora\nVERSION_ID=42\n')
    res = installer(
        env_extra={"CRIU_OS_RELEASE": str(tmp_path / "os-release"), "PATH": "/usr/bin:/bin"},
        tmp_path=tmp_path,
    )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"install-criu: error: this installer knows Debian and Ubuntu, not 'fedora' "
        f"({tmp_path / 'os-release'}); {MANUAL} (your distribution's criu package where it is "
        "4.x, else built from CRIU's source release), then put it on PATH or set "
        "CUINTERPOSE_CRIU=/path/to/criu"
    )
    assert not (tmp_path / "cache" / "bin").exists()


def fake_criu(tmp_path, version: str):
    """A `criu` on a PATH of its own that reports ``version`` and passes `criu check`."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "criu").write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) echo "Version: {version}" ;; check) echo "Looks good." ;; '
        "*) exit 2 ;; esac\n"
    )
    (d / "criu").chmod(0o755)
    return d


def test_installer_passes_over_a_system_criu_older_than_4(tmp_path, criu_ok):
    """Bookworm's 3.17 on PATH, first, is kept but not used; the cached 4.x (the checkout's) is."""
    bin_dir = fake_criu(tmp_path, "3.17.1")
    res = installer(
        env_extra={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "CUINTERPOSE_CRIU_CACHE": str(criu_binary.cache_dir()),
        },
        tmp_path=tmp_path,
    )
    if "system criu works" in res.stderr:
        raise AssertionError(res.stderr)
    lines = res.stderr.splitlines()
    assert lines[0] == (
        "install-criu: system criu is Version: 3.17.1, need >= 4 (kept as is, not used)"
    )
    # the cache's CRIU is used (or, where the checkout's CRIU is the system's, installed)
    assert res.returncode == 0, res.stderr
    assert "works (Version: 4." in lines[-1] or ": Version: 4." in lines[-1], res.stderr


def doctor(env_extra, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUINTERPOSE_CRIU")}
    env.update(env_extra)
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "doctor", "--driver", "fake", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = json.loads(res.stdout)
    assert res.returncode == (0 if out["ok"] else 1)
    return {c["name"]: c for c in out["checks"]}


def test_doctor_names_install_criu_when_criu_is_missing_or_too_old(tmp_path):
    bin_dir = fake_criu(tmp_path, "3.17.1")
    cache = tmp_path / "empty-cache"
    rows = doctor(
        {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUINTERPOSE_CRIU_CACHE": str(cache)}, tmp_path
    )
    assert rows["criu version"]["ok"] is False
    assert rows["criu version"]["detail"].splitlines() == [
        "no working CRIU:",
        "system criu: version 3.17.1 is older than 4.0",
        f"cached criu {cache}/bin/criu: not found",
        f"To install one: run `cuinterpose-agent install-criu` (CRIU 4.x into {cache}, found "
        f"there by the agent); or {MANUAL} (your distribution's criu package where it is 4.x, "
        "else built from CRIU's source release), then put it on PATH or set "
        "CUINTERPOSE_CRIU=/path/to/criu",
    ]
    assert rows["criu check"]["ok"] is False


def test_doctor_names_only_the_manual_way_on_another_distribution(tmp_path):
    (tmp_path / "os-release").write_text("ID=arch\n")
    rows = doctor(
        {
            "PATH": "/usr/bin:/bin",
            "CUINTERPOSE_CRIU_CACHE": str(tmp_path / "c"),
            "CRIU_OS_RELEASE": str(tmp_path / "os-release"),
        },
        tmp_path,
    )
    last = rows["criu version"]["detail"].splitlines()[-1]
    assert last.startswith(f"To install one: {MANUAL} (") and "install-criu" not in last
