"""A tree in a mount namespace of its own (a container's) with real CRIU: the dump runs CRIU
inside the tree's mount namespace, the restore inside the placeholder's (agent/mntns.py).

The "container" is ``unshare --mount`` with a private bind mount of a host directory (its data
volume) at a path that is an empty directory in the agent's mount namespace; it appends a
counter to ``DATA/log`` through an fd it keeps open. The placeholder (tests/conftest.py
``placeholder``, ``mount=True``) is another ``unshare --mount`` with the same volume bound at
the same path (same image, same volumes); its net/uts/ipc namespaces are not joined here. CRIU
run from the agent's mount namespace images the tree's whole mount namespace, and cannot restore
the tree there (its paths do not exist in the agent's namespace); run inside the tree's and the
placeholder's, the images hold no mount namespace, and the restored process lives in the
placeholder's mount namespace and keeps appending to the very same file.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from criu_helpers import alive, stop_job, wait_until

from cuinterpose.agent.mech import criu, criu_run, mntns
from cuinterpose.agent.mech.inherit import restore_options
from cuinterpose.agent.mech.placement import Placement
from cuinterpose.agent.options import CheckpointOptions

# appends 1, 2, 3 ... to DATA/log every 20 ms through fd 4, opened inside the namespace; its
# /dev/shm is a tmpfs of its own, as a container's is: a dump that images the namespace's tmpfs
# contents must not read the host's, which other processes change meanwhile (case 014)
LOOP = (
    "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
    "mount --bind {vol} {mnt} && cd / && exec </dev/null >/dev/null 2>&1 4>>{mnt}/log && "
    "i=0; while :; do i=$((i+1)); echo $i >&4; sleep 0.02; done"
)


def _unshared(script: str) -> subprocess.Popen:
    """The job: ``script`` in a mount namespace of its own."""
    return subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _numbers(path) -> list[int]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    return [int(x) for x in lines[:-1]]  # the last one may be half written


@pytest.fixture
def volume(tmp_path):
    """(host directory = the volume, mount point: an empty directory outside it)."""
    vol = tmp_path / "volume"
    mnt = tmp_path / "mnt"
    vol.mkdir()
    mnt.mkdir()
    return vol, mnt


def test_rewrite_reaches_criu_and_our_paths_through_the_root_fd(criu_ok):
    cmd = mntns.rewrite(
        criu.criu_command(),
        [
            "restore",
            "--images-dir",
            "/snap/x",
            "--work-dir",
            "/w",
            "--log-file",
            "restore.log",
            "--join-ns",
            "net:/proc/42/ns/net",
            "--pidfile",
            "/w/restore.pid",
            "--tree",
            "7",
        ],
        9,
    )
    i = cmd.index("restore")
    loader, args = cmd[:i], cmd[i:]
    assert [a for a in loader if a.startswith("/")] and all(
        a.startswith("/proc/self/fd/9/") for a in loader if a.startswith("/")
    )
    lib = loader[loader.index("--library-path") + 1] if "--library-path" in loader else ""
    assert all(d.startswith("/proc/self/fd/9/") for d in lib.split(":") if d)
    assert args == [
        "restore",
        "--images-dir",
        "/proc/self/fd/9/snap/x",
        "--work-dir",
        "/proc/self/fd/9/w",
        "--log-file",
        "restore.log",
        "--join-ns",
        "net:/proc/self/fd/9/proc/42/ns/net",
        "--pidfile",
        "/proc/self/fd/9/w/restore.pid",
        "--tree",
        "7",
    ]


def test_tree_in_its_own_mount_namespace_dumps_and_restores_into_the_placeholders(
    tmp_path, volume, placeholder, criu_ok
):
    vol, mnt = volume
    log = vol / "log"
    job = _unshared(LOOP.format(vol=vol, mnt=mnt))
    restored = None
    try:
        wait_until(lambda: len(_numbers(log)) >= 10, "the job to write 10 numbers", 30)
        assert mntns.is_foreign(job.pid)
        assert not (mnt / "log").exists()  # the volume is not mounted in our namespace
        ns = criu.tree_namespaces(job.pid)
        assert ns["enter"] == ["mnt"]

        # CRIU run from our mount namespace images the job's whole mount namespace (every
        # mount, the contents of its tmpfs mounts), which a restore can only rebuild with
        # --root and every host bind mount declared external
        plain = tmp_path / "plain"
        plain.mkdir()
        criu_run.run(
            "dump",
            [
                "--tree",
                str(job.pid),
                *criu_run.common_args(plain, plain, "d.log"),
                "--leave-running",
            ],
            images_dir=plain,
            log_path=plain / "d.log",
            timeout_s=CheckpointOptions().criu_timeout_s,  # the run's default
        )
        assert [p.name for p in plain.glob("mountpoints-*.img")]
        assert alive(job.pid)

        images = tmp_path / "images"
        criu.dump(job.pid, images)  # CRIU inside the job's mount namespace
        assert job.wait(30) == -signal.SIGKILL
        dumped = _numbers(log)
        assert dumped == list(range(1, len(dumped) + 1))
        before = sorted(p.name for p in images.iterdir())
        # run inside it, CRIU has nothing of the mount namespace to image
        assert not [n for n in before if n.startswith(("mountpoints-", "tmpfs-dev-"))]

        # without a placement CRIU restores in our mount namespace, where DATA/log is missing
        with pytest.raises(criu.CriuError) as e:
            criu.restore(images)
        assert f"Can't open file {str(mnt / 'log').lstrip('/')} on restore" in str(e.value)
        assert sorted(p.name for p in images.iterdir()) == before
        assert _numbers(log) == dumped

        # the placeholder: the same volume bound at the same path in a mount namespace of its own
        holder = placeholder(
            "cui-mnt", mount=True, stdout=False, prepare=f"mount --bind {vol} {mnt} && cd /"
        )
        pl = Placement.of_pid(holder.pid, namespaces=())
        assert pl.mnt is not None and pl.mnt.inode == os.stat(f"/proc/{holder.pid}/ns/mnt").st_ino
        opts = restore_options(pl)
        try:
            restored = criu.restore(images, **opts.kwargs())
        finally:
            opts.close()
        assert restored == job.pid  # CRIU keeps the pid
        assert os.stat(f"/proc/{restored}/ns/mnt").st_ino == pl.mnt.inode
        assert pl.mismatches(restored) == []
        wait_until(
            lambda: len(_numbers(log)) >= len(dumped) + 10,
            "the restored job to write 10 more numbers",
            30,
        )
        after = _numbers(log)
        # the same file, continued: no number lost, none written twice
        assert after == list(range(1, len(after) + 1))
        assert after[: len(dumped)] == dumped
    finally:
        stop_job(job, restored)  # the shell and its sleep: one group
