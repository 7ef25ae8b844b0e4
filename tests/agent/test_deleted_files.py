"""Deleted files a tree holds, for CRIU's dump (agent/mech/fds.py ``unlinked_files``,
``ghost_limit_args``; agent/mech/criu_remap.py; docs/criu.md "Deleted files"): an unlinked
mapping over CRIU's 1 MiB ghost limit raises the limit to what the file has allocated; a
deleted name whose inode still has a link (glibc's sem_open) asks for --link-remap; the links
CRIU makes are kept with the images and put back before a restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cuinterpose.agent.mech import criu_remap, fds
from cuinterpose.agent.mech.criu_binary import CriuError

HOLDER = r"""
import mmap, os, sys
d = sys.argv[1]
big = os.path.join(d, "big")
fd = os.open(big, os.O_CREAT | os.O_RDWR, 0o600)
os.posix_fallocate(fd, 0, 3 << 20)
m = mmap.mmap(fd, 3 << 20, mmap.MAP_SHARED)
os.unlink(big)                       # NCCL's SHM buffer: no link left
tmp, name = os.path.join(d, "sem.tmp"), os.path.join(d, "sem.name")
fd2 = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd2, 32)
m2 = mmap.mmap(fd2, 32, mmap.MAP_SHARED)
os.close(fd2)
os.link(tmp, name)                   # glibc's sem_open: linked to its name, then the temporary unlinked
os.unlink(tmp)
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def holder(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    yield p, d
    p.stdin.close()
    p.wait()


def test_unlinked_and_remapped_files_are_found(holder):
    p, d = holder
    files = fds.unlinked_files([p.pid])
    by_name = {os.path.basename(f["path"]): f for f in files if f["path"].startswith(str(d))}
    big, sem = by_name["big"], by_name["sem.tmp"]
    assert (big["bytes"], big["allocated"], big["links"]) == (3 << 20, 3 << 20, 0)
    assert (sem["bytes"], sem["links"]) == (32, 1)
    assert os.stat(d / "sem.name").st_ino == sem["inode"]
    assert fds.ghost_limit_args([big, sem]) == ("--ghost-limit", str(3 << 20), "--link-remap")
    assert fds.ghost_limit_args([sem]) == ("--link-remap",)
    small = dict(big, allocated=4096)
    assert fds.ghost_limit_args([small]) == ()  # under CRIU's default 1 MiB


def test_linked_remaps_kept_with_the_images_and_put_back(holder, tmp_path):
    p, d = holder
    sem = [f for f in fds.unlinked_files([p.pid]) if f["path"].endswith("sem.tmp")]
    os.link(d / "sem.name", d / "link_remap.7")  # what CRIU's create_link_remap makes
    (d / "link_remap.9").write_bytes(b"not ours")  # another inode: left alone
    images = tmp_path / "img"
    images.mkdir()
    (d / "sem.name").write_bytes(b"S" * 32)
    index = criu_remap.collect(images, sem)
    assert [(e["path"], e["file"]) for e in index] == [(str(d / "link_remap.7"), "link-remap/0")]
    assert json.loads((images / criu_remap.INDEX).read_text()) == index
    assert not (d / "link_remap.7").exists() and (d / "link_remap.9").exists()
    assert (images / "link-remap" / "0").read_bytes() == b"S" * 32
    assert criu_remap.put_back(images) == [str(d / "link_remap.7")]  # before a restore
    assert (d / "link_remap.7").read_bytes() == b"S" * 32
    assert criu_remap.put_back(images) == [str(d / "link_remap.7")]  # the same bytes: kept
    (d / "link_remap.7").unlink()
    (d / "link_remap.7").write_bytes(b"other")
    with pytest.raises(
        CriuError, match="link_remap.7 .a linked remap of the dump. is taken by another file"
    ):
        criu_remap.put_back(images)
