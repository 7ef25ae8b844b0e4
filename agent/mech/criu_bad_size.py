"""Why CRIU refused a restore over a regular file whose size changed since the dump, in words
an operator can act on: which file, which fds of the tree hold it, what was handed for it
(``--inherit-fd``) and what to do. CRIU's log lines read here: criu/files.c
(``inherit_fd_lookup_id``: "Found id KEY (fd N) in inherit fd list") and its "File fd/N has
bad size S (expect E)" check.
"""

from __future__ import annotations

import pathlib
import re
from typing import Optional

from cuinterpose.agent.mech import inherit


def handed_files(opts: "Optional[inherit.RestoreOptions]") -> dict[str, list[dict]]:
    """The external files of one tree handed to CRIU (``--inherit-fd fd[N]:KEY``), by CRIU's
    key ``file[MNT_ID:INODE]``: ``{KEY: [their records in opts.files]}``."""
    if opts is None:
        return {}
    out: dict[str, list[dict]] = {}
    for f in opts.files:
        out.setdefault(inherit.external_file_key(f), []).append(f)
    return out


_LOG_TASK = re.compile(r"^\(\s*[\d.]+\)\s+(\d+): ")
_FOUND_INHERITED = re.compile(r"Found id (\S+) \(fd (\d+)\) in inherit fd list")
_BAD_SIZE_FD = re.compile(r"File fd/(\d+) has bad size (\d+) \(expect (\d+)\)")


def inherited_bad_size_keys(log_text: str) -> dict[tuple[int, int, int], str]:
    """CRIU names a file it reopened from an inherited fd ``fd/N`` in "File fd/N has bad
    size S (expect E)", N being a copy of that fd it just took, which its log names right
    before: "Found id KEY (fd N) in inherit fd list" (CRIU's criu/files.c,
    ``inherit_fd_lookup_id``). ``{(N, S, E): KEY}``, matched per restored task."""
    last: dict[tuple[str, int], str] = {}
    out = {}
    for ln in log_text.splitlines():
        m = _LOG_TASK.match(ln)
        task = m.group(1) if m else ""
        m = _FOUND_INHERITED.search(ln)
        if m:
            last[(task, int(m.group(2)))] = m.group(1)
            continue
        m = _BAD_SIZE_FD.search(ln)
        if m and (task, int(m.group(1))) in last:
            out[(int(m.group(1)), int(m.group(2)), int(m.group(3)))] = last[(task, int(m.group(1)))]
    return out


def reason(
    root: int, images_dir, bad: list[dict], err, files: Optional[dict[int, list[dict]]] = None
) -> str:
    """The reason of a CRIU restore refused for files whose size changed since the dump.

    ``files`` (:func:`handed_files`): the external files handed to CRIU, by key. CRIU names
    such a file ``fd/N`` (it reopens ``/proc/self/fd/N``, N a copy of the fd handed; the key
    is read from its log, :func:`inherited_bad_size_keys`, or is the only handed file CRIU
    size-checks): that row names the file, the tree's fds on it and what was handed, without
    the advice about the workload's ``O_APPEND``, which is not the cause there."""
    files = files or {}
    keys: dict[tuple[int, int, int], str] = {}
    log_path = getattr(err, "log_path", None)
    if files and log_path:
        try:
            keys = inherited_bad_size_keys(pathlib.Path(log_path).read_text(errors="replace"))
        except OSError:
            keys = {}
    checked = [
        k for k, us in files.items() if any(not inherit.appends(int(u["flags"])) for u in us)
    ]
    ext, plain = [], []
    for b in bad:
        n = b["path"][len("/fd/") :] if b["path"].startswith("/fd/") else ""
        uses = None
        if n.isdigit() and files:
            key = keys.get((int(n), b["size"], b["expected"]))
            if key is None and len(checked) == 1:
                key = checked[0]
            uses = files.get(key) if key else None
        (ext if uses else plain).append((b, uses))
    log = getattr(err, "log_path", None)
    tail = f" (CRIU log: {log})" if log else ""
    plain_files = "; ".join(
        f"{b['path']} is {b['size']} bytes, the snapshot expects {b['expected']}" for b, _ in plain
    )
    plain_advice = (
        "The workload (or a restored run of it) wrote to it through a "
        "descriptor opened without O_APPEND, so this snapshot is restorable only "
        "while the file keeps its dumped size (truncate it back to that size to "
        "restore it again, losing what was written after the checkpoint); open it "
        "with O_APPEND / `>>` so that later snapshots restore any number of times"
    )
    if not ext:
        return (
            f"tree {root} from {images_dir}: CRIU refuses a regular file whose size changed "
            f"since the dump: {plain_files}. {plain_advice}{tail}"
        )
    parts = []
    for b, uses in ext:
        u0 = uses[0]
        held = [u for u in uses if not inherit.appends(int(u["flags"]))]
        held_s = ", ".join(
            f"pid {u['pid']} fd {u['fd']} {inherit.flag_names(int(u['flags']))}"
            for u in held or uses
        )
        if u0.get("placement_fd") is None:
            fix = (
                f"{u0['path']} here is not the size it had at the dump (a restored run of "
                "the tree wrote to it, or it is another file): this snapshot restores only "
                f"while it has {b['expected']} bytes (truncate it back to that size to "
                "restore it again, losing what was written after the checkpoint)"
            )
        else:
            fix = (
                f"the placement's fd {u0['placement_fd']} is another file than the tree's: "
                f"restore into a placeholder whose fd {u0['placement_fd']} is not a regular "
                f"file, so that {u0['path']} is reopened"
            )
        parts.append(
            f"{u0['path']} (opened outside the tree's mount namespace; held by "
            f"{held_s}) was handed {u0['handed']}, which is {b['size']} bytes, the "
            f"snapshot expects {b['expected']}: {fix}"
        )
    reason = (
        f"tree {root} from {images_dir}: CRIU refuses a file opened outside the tree's "
        "mount namespace whose size is not its size at the dump (CRIU reopens every fd "
        "of such a file on the one fd handed for it, and checks the size of each fd the "
        "tree did not hold O_WRONLY|O_APPEND): " + "; ".join(parts)
    )
    if plain:
        reason += (
            f". It also refuses a regular file whose size changed since the dump: "
            f"{plain_files}. {plain_advice}"
        )
    return reason + tail
