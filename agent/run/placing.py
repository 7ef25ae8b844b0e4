"""The notes a restore's "placement" phase prints about where the restored trees' outside ends
go (agent/run/restore.py ``Restore.place``): text only, computed from the manifest and the
resolved placement; nothing here changes the node."""

from __future__ import annotations

from cuinterpose.agent.snapshot import manifest as manifest_mod


def unplaced_notes(m: dict) -> list[str]:
    """Without a placement (no ``--into-pid``): what comes back without its outside end (the
    external pipes of ``m``) and which trees reopen files in the agent's mount namespace."""
    out = []
    ext = m.get("external_pipes", [])
    if ext:
        out.append(
            "without a placement (--into-pid) these pipe fds come back with no "
            "process at their other end (a writer gets EPIPE): "
            + ", ".join(
                f"pid {p['pid']} fd {p['fd']} ({p['direction']}s pipe:[{p['inode']}])" for p in ext
            )
        )
    foreign = [r for r in m["roots"] if manifest_mod.tree_namespaces(m, r).get("foreign_mnt")]
    if foreign:
        out.append(
            "tree(s) " + ", ".join(map(str, foreign)) + " were checkpointed in a mount "
            "namespace other than the agent's (a container's); without a placement "
            "(--into-pid) CRIU runs in the agent's mount namespace and reopens their "
            "files by the paths that namespace showed, so those paths must exist here "
            "(restore into the placeholder container with --into-pid to get the "
            "container's view)"
        )
    return out


def placed_notes(m: dict, placement, files: list[dict], fixups: list[dict]) -> list[str]:
    """After the placement phase: each file handed over from outside a mount namespace
    (``files``: ``{"root", "pid", "fd", "path", "handed"}``), each regular-file fixup
    (``fixups``: ``{"root", "pid", "fd", "target"}``), and a snapshot too old to record
    external pipes."""
    out = [
        f"tree {f['root']}: pid {f['pid']} fd {f['fd']} ({f['path']}, opened "
        f"outside its mount namespace) gets {f['handed']}"
        for f in files
    ]
    out += [
        f"tree {fx['root']}: pid {fx['pid']} fd {fx['fd']} gets the "
        f"placement's regular file {fx['target']}, set O_APPEND before the "
        "tree runs (CRIU reopens it at offset 0)"
        for fx in fixups
    ]
    if placement is not None and "external_pipes" not in m:
        out.append(
            "the snapshot predates external-pipe records: its trees' pipes to "
            "outside them, if any, come back without their outside end"
        )
    return out


def external_warnings(root: int, pipes: list[dict], files: list[dict], comms: dict) -> list[dict]:
    """The checkpoint's warnings (``{"pid", "comm", "fd", "path", "message"}``, manifest
    ``warnings``) for tree ``root``'s external pipes (``pipes``: ``{"root", "pid", "fd",
    "inode", "direction"}``) and files opened outside its mount namespace (``files``:
    ``{"root", "pid", "fd", "path", "mnt_id"}``): what a restore does with each, with and
    without a placement. ``comms``: pid -> command name."""
    out = []
    for p in pipes:
        if p["root"] != root:
            continue
        comm = comms.get(p["pid"], "?")
        out.append(
            {
                "pid": p["pid"],
                "comm": comm,
                "fd": p["fd"],
                "path": f"pipe:[{p['inode']}]",
                "message": (
                    f"pid {p['pid']} ({comm}) fd {p['fd']} {p['direction']}s pipe:[{p['inode']}], "
                    "whose other end is outside the checkpointed tree (a container's stdio, a "
                    "pipe to a logger): a restore into a placement (--into-pid) hands it the "
                    "placement's stdio; a restore without a placement brings it back with nothing "
                    "at the other end (a writer gets EPIPE/SIGPIPE at its next write, a reader "
                    "end-of-file)"
                ),
            }
        )
    for f in files:
        if f["root"] != root:
            continue
        comm = comms.get(f["pid"], "?")
        out.append(
            {
                "pid": f["pid"],
                "comm": comm,
                "fd": f["fd"],
                "path": f["path"],
                "message": (
                    f"pid {f['pid']} ({comm}) fd {f['fd']} holds {f['path']}, opened outside the "
                    f"tree's mount namespace (mount {f['mnt_id']} is not in it): CRIU records it "
                    "as external, and a restore hands it the placement's fd "
                    f"{f['fd']} when that is the same kind of file, else reopens {f['path']} in "
                    "the agent's mount namespace (a restore without a placement always does); it "
                    "is refused when that path does not exist there"
                ),
            }
        )
    return out
