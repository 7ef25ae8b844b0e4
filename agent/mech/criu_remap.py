"""The linked-remap files of a CRIU dump, kept with the images (docs/criu.md "Deleted files").

A process may map a file whose name it used is gone while the inode still has another name:
glibc's ``sem_open`` creates a semaphore as a temporary ``/dev/shm/sem.XXXXXX``, links it to the
semaphore's name and unlinks the temporary one, so every ``multiprocessing`` lock or queue of the
spawn start method (what ``torch.multiprocessing`` needs for CUDA) is mapped as
``sem.XXXXXX (deleted)`` with one link left. CRIU cannot dump that as a ghost file (it has a
name) nor by path (not the name it was mapped by): with ``--link-remap`` it hard-links the inode
as ``<its directory>/link_remap.<id>`` and its restore opens that link, then removes it
(criu/files-reg.c, ``create_link_remap``). Left there, the images would restore once, on this
node only, and two dumps on one node could collide on the name. So :func:`collect` copies each
such link into the images directory (``link-remap/<n>``, indexed by ``link-remap.json``: the
image inventory of the snapshot hashes and checks them like any image) and removes it, and
:func:`put_back` puts them in place before every restore.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from cuinterpose.agent.mech.criu_binary import CriuError

INDEX = "link-remap.json"
DIR = "link-remap"
PREFIX = "link_remap."


def collect(images_dir: Path, files: list[dict]) -> list[dict]:
    """After a dump with ``--link-remap``: every ``link_remap.*`` CRIU made for one of ``files``
    (fds.unlinked_files entries with links > 0: same device and inode) is copied under
    ``images_dir/DIR`` and removed; returns the index entries ``{"path", "file", "mode", "uid",
    "gid"}`` (also written to ``images_dir/INDEX``). Raises ``OSError``."""
    inodes = {(f["dev"], f["inode"]) for f in files if f["links"] > 0}
    found = []
    for d in sorted({os.path.dirname(f["path"]) for f in files if f["links"] > 0}):
        try:
            names = sorted(n for n in os.listdir(d) if n.startswith(PREFIX))
        except OSError:
            continue
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if (st.st_dev, st.st_ino) in inodes:
                found.append((p, st))
    if not found:
        return []
    (images_dir / DIR).mkdir(exist_ok=True)
    index = []
    for i, (p, st) in enumerate(found):
        rel = f"{DIR}/{i}"
        shutil.copyfile(p, images_dir / rel)
        index.append(
            {
                "path": p,
                "file": rel,
                "mode": st.st_mode & 0o7777,
                "uid": st.st_uid,
                "gid": st.st_gid,
            }
        )
        os.unlink(p)
    (images_dir / INDEX).write_text(json.dumps(index))
    return index


def put_back(images_dir: Path) -> list[str]:
    """Before a restore: each link of ``images_dir/INDEX`` at its path with its bytes, mode and
    owner (a file already there with the same bytes is kept: a restore that failed before CRIU
    consumed it). Returns the paths. Raises ``CriuError`` naming the path when another file is
    there or it cannot be written; the images are not changed."""
    idx = images_dir / INDEX
    if not idx.exists():
        return []
    try:
        entries = json.loads(idx.read_text())
    except (OSError, ValueError) as e:
        raise CriuError(f"cannot restore: {idx} unreadable: {e}", images_dir=images_dir) from e
    out = []
    for e in entries:
        src, dst = images_dir / e["file"], e["path"]
        data = src.read_bytes()
        try:
            if os.path.lexists(dst):
                with open(dst, "rb") as f:
                    if f.read() != data:
                        raise CriuError(
                            f"cannot restore {images_dir}: {dst} (a linked remap of the dump) is taken by "
                            "another file; remove it if no restore is running",
                            images_dir=images_dir,
                        )
            else:
                fd = os.open(
                    dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chown(dst, e["uid"], e["gid"])
                os.chmod(dst, e["mode"])
        except OSError as err:
            raise CriuError(
                f"cannot restore {images_dir}: cannot put back {dst}: {err}", images_dir=images_dir
            ) from err
        out.append(dst)
    return out
