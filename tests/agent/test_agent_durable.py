"""The checkpoint's ``sync`` phase (every file and directory of the snapshot on stable storage
before the manifest, and the manifest before any kill), each CRIU image hashed once, restore's
``verify`` phase, rows that tile the run, and the progress of the phases that move bytes
(agent/run/durable.py, agent/run/report.py)."""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import pathlib
import sys

import pytest
from agent_world import PIDS, ROOT, answer_quiesce

from cuinterpose.agent.errors import AgentError, CheckpointFailed
from cuinterpose.agent.mech import quiesce
from cuinterpose.agent.run import checkpoint as cp_mod
from cuinterpose.agent.run import durable
from cuinterpose.agent.run import restore as rs_mod
from cuinterpose.agent.run.report import Phase, Reporter
from cuinterpose.agent.snapshot import durability, snapdir
from cuinterpose.agent.snapshot import manifest as manifest_mod

CHUNK = 65536
ALLOC = "0f" * 16  # 32 hex digits


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _files_written_by_the_dump(world, monkeypatch):
    """The fake CRIU dump also writes a multi-block page image and a nested file, and the
    capture a sparse chunk file (chunk 1 of 3 all zero: never written), as the chunk format's
    writers would."""
    coord = cp_mod._coordinator_module().Coordinator
    capture = coord.capture
    fake_criu = sys.modules["cuinterpose.agent.mech.criu"]
    dump = fake_criu.dump
    pages = bytes(range(256)) * (3 * durability.HASH_BLOCK // 256 + 17)

    def capture_writing_chunks(self):
        cap = capture(self)
        d = world.images_dir / snapdir.CHUNKS
        d.mkdir()
        with open(d / f"shared-{PIDS[0]}-{ALLOC}.bin", "wb") as f:
            f.truncate(3 * CHUNK)
            os.pwrite(f.fileno(), b"\x01" * CHUNK, 0)
            os.pwrite(f.fileno(), b"\x02" * CHUNK, 2 * CHUNK)
        return cap

    def dump_more(root, d, **kw):
        dump(root, d, **kw)
        (d / "pages-1.img").write_bytes(pages)
        (d / "sub").mkdir()
        (d / "sub" / "inventory.img").write_bytes(b"inv")

    monkeypatch.setattr(coord, "capture", capture_writing_chunks)
    monkeypatch.setattr(fake_criu, "dump", dump_more)
    return pages


def _record_fsyncs(world, monkeypatch, fail_on=None):
    real = durability._fsync

    def fsync(fd):
        path = _fd_path(fd)
        world.log.append(("fsync", path))
        if fail_on is not None and path.endswith(fail_on):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(durability, "_fsync", fsync)


def test_every_file_and_directory_is_synced_before_the_manifest_and_the_first_kill(
    world, tmp_path, monkeypatch
):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    world.images_dir = tmp_path / "snap"
    pages = _files_written_by_the_dump(world, monkeypatch)
    _record_fsyncs(world, monkeypatch)
    hashed = collections.Counter()
    rep = Reporter()
    sha256_fd = durability.sha256_fd

    def counting(fd, on_bytes=None):
        hashed[(_fd_path(fd), rep.phases[-1].name)] += 1
        return sha256_fd(fd, on_bytes)

    monkeypatch.setattr(durability, "sha256_fd", counting)
    written = []
    write = manifest_mod.write
    monkeypatch.setattr(
        manifest_mod,
        "write",
        lambda d, m: written.append(len(world.log)) or write(d, m),
    )
    m = cp_mod.Checkpoint([ROOT], world.images_dir, control_dir=world.ctl, reporter=rep).run()

    snap = world.images_dir
    files = {str(p) for p in snap.rglob("*") if p.is_file()} - {str(snap / "manifest.json")}
    dirs = {str(p) for p in snap.rglob("*") if p.is_dir()} | {str(snap), str(tmp_path)}
    synced = [e[1] for e in world.log if e[0] == "fsync"]
    assert set(synced) == files | dirs and len(synced) == len(files | dirs)
    assert len(files) == 4  # core.img, pages-1.img, sub/inventory.img, the chunk file
    # directories after every file, children before their parents, the snapshot's parent last
    order = [p for p in synced if p in dirs]
    assert synced[-len(dirs) :] == order
    assert order.index(str(snap / "criu" / str(ROOT) / "sub")) < order.index(
        str(snap / "criu" / str(ROOT))
    )
    assert order[-2:] == [str(snap), str(tmp_path)]
    last_sync = max(i for i, e in enumerate(world.log) if e[0] == "fsync")
    kill = world.log.index(("signal", "SIGKILL", ROOT))
    assert written[0] > last_sync  # the manifest after every sync ...
    assert kill > last_sync and kill >= written[0]  # ... and every kill after the manifest
    # each CRIU image hashed exactly once, inside the sync phase; the chunk file never
    images = sorted(p for p in files if "/criu/" in p)
    assert sorted(hashed) == [(p, "sync") for p in images]
    assert set(hashed.values()) == {1}
    criu = m["criu"]["files"]
    assert criu == {
        str(pathlib.Path(p).relative_to(snap)): {
            "sha256": hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest(),
            "bytes": pathlib.Path(p).stat().st_size,
        }
        for p in images
    }
    assert criu[f"criu/{ROOT}/pages-1.img"]["bytes"] == len(pages)
    assert m["totals"]["image_bytes"] == sum(f["bytes"] for f in criu.values())
    [sync] = [p for p in rep.phases if p.name == "sync"]
    assert sync.status == "ok" and sync.bytes == len(pages) + 1 + 3 + 2 * CHUNK
    assert sync.detail == "4 files, 6 directories fsynced; 3 CRIU images hashed (sha256)"


def test_a_failed_fsync_rolls_back_like_a_failed_dump(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    world.images_dir = tmp_path / "snap"
    _files_written_by_the_dump(world, monkeypatch)
    _record_fsyncs(world, monkeypatch, fail_on="pages-1.img")
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], world.images_dir, control_dir=world.ctl).run()
    e = ei.value
    img = world.images_dir / "criu" / str(ROOT) / "pages-1.img"
    assert (e.phase, e.outcome) == ("sync", "rolled_back")
    assert e.reason.startswith(
        f"fsync of {img} failed: Input/output error (errno 5); the snapshot in "
        f"{world.images_dir} is not on stable storage, so the checkpoint fails and rolls back"
    )
    assert ("signal", "SIGKILL", ROOT) not in world.log
    assert world.log[-6:] == [
        ("signal", "SIGCONT", ROOT),
        ("native", "restore", 201),
        ("native", "unlock", 201),
        ("native", "restore", 202),
        ("native", "unlock", 202),
        ("coord", "rollback", None),
    ]
    assert world.state == {201: "RUNNING", 202: "RUNNING"}
    assert not (world.images_dir / "manifest.json").exists()
    assert not (world.images_dir / "criu").exists()


def test_the_rows_tile_the_checkpoint_and_its_wall_is_their_sum(world, tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    cp = cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep)
    m = cp.run()
    rows = rep.phases
    assert rows[0].start_ns == cp.t0_ns
    assert [r.start_ns for r in rows[1:]] == [r.start_ns + r.elapsed_ns for r in rows[:-1]]
    assert cp.t_end_ns == rows[-1].start_ns + rows[-1].elapsed_ns
    assert rep.covered_ns() == cp.t_end_ns - cp.t0_ns == rep.wall_ns()
    on_disk = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    # the final rewrite holds every row, and the wall time is their sum (ms, 3 decimals)
    assert on_disk["phases"] == m["phases"] == rep.to_list()
    assert on_disk["totals"]["wall_ms"] == round(sum(p["elapsed_ns"] for p in m["phases"]) / 1e6, 3)
    assert [p["name"] for p in on_disk["phases"]][-3:] == ["sync", "manifest", "kill dumped"]


def test_the_rows_tile_a_restore_with_coordinator_rows(tmp_path, monkeypatch):
    """Rows timed elsewhere (the coordinator's) start where the previous row ended too."""
    rep = Reporter()

    def step(name, coordinator=()):
        def run(self):
            if name == "manifest":
                self.m = {"roots": [100], "snapshot_id": "s", "cuda_pids": [], "participants": []}
            with self.r.phase(name):
                pass
            for c in coordinator:
                self.r.record(c, 5, 4096, "ok", "")

        return run

    for meth, name, coord in (
        ("read_manifest", "manifest", ()),
        ("verify_images", "verify", ()),
        ("load_driver", "driver", ()),
        ("remove_stale", "stale sockets", ()),
        ("criu_restore", "criu restore", ()),
        ("native_restore", "native restore", ()),
        ("restore_shared", "restore shared", ("INSPECT", "LOAD_ALLOCATIONS", "INSPECT")),
        ("resume", "resume", ()),
    ):
        monkeypatch.setattr(rs_mod.Restore, meth, step(name, coord))
    rs = rs_mod.Restore(tmp_path, reporter=rep)
    out = rs.run()
    rows = rep.phases
    assert [r.name for r in rows][-5:] == [
        "restore shared",
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "INSPECT",
        "resume",
    ]
    assert rows[0].start_ns == rs.t0_ns
    assert [r.start_ns for r in rows[1:]] == [r.start_ns + r.elapsed_ns for r in rows[:-1]]
    assert out["totals"]["wall_ms"] == round(rep.covered_ns() / 1e6, 3)
    assert [r.bytes for r in rows if r.name == "LOAD_ALLOCATIONS"] == [4096]


def test_progress_rows_count_bytes_up_to_the_total():
    events = []
    rep = Reporter([lambda ev, ph: events.append((ev, ph.bytes, ph.total_bytes, ph.eta_ns))])
    rep.PROGRESS_EVERY_NS = 0
    with rep.phase("sync") as ph:
        for done in (0, 4096, 4096, 12288):
            rep.progress(ph, done, 16384)
        rep.progress(ph, 2048, 16384)  # never backwards
        rep.progress(ph, 16384, 16384, final=True)
    prog = [e for e in events if e[0] == "progress"]
    assert [b for _, b, _, _ in prog] == [0, 4096, 4096, 12288, 12288, 16384]
    assert {t for _, _, t, _ in prog} == {16384}
    assert prog[0][3] == -1 and all(eta >= 0 for *_, eta in prog[1:]) and prog[-1][3] == 0
    assert events[0][0] == "start" and events[-1][0] == "end"
    assert ph.progress_text().startswith("16.0 KiB of 16.0 KiB (100%), ")


def test_sync_progress_is_monotone_and_ends_at_the_total(tmp_path):
    snap = tmp_path / "snap"
    img = snap / "criu" / "7"
    img.mkdir(parents=True)
    sizes = {"a.img": 3 * durability.HASH_BLOCK + 5, "b.img": 10, "c.img": 0}
    for n, size in sizes.items():
        (img / n).write_bytes(os.urandom(size))
    seen = []
    res = snapdir.SnapshotDir(snap).sync(progress=lambda d, t: seen.append((d, t)), threads=3)
    total = sum(sizes.values())
    assert res.bytes == total and {t for _, t in seen} == {total}
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # counted under one lock
    assert seen[-1] == (total, total) and max(d for d, _ in seen) == total
    assert res.images == {
        f"criu/7/{n}": {"sha256": hashlib.sha256((img / n).read_bytes()).hexdigest(), "bytes": s}
        for n, s in sizes.items()
    }


def test_the_chunk_poller_reports_written_bytes_of_the_streams(tmp_path):
    events = []
    rep = Reporter([lambda ev, ph: events.append((ev, ph.name, ph.bytes, ph.total_bytes))])
    rep.PROGRESS_EVERY_NS = 0
    poller = durable.ChunkProgress(rep, "SAVE_ALLOCATIONS", tmp_path)
    assert poller.poll() is None  # no chunks/ yet: nothing to say
    d = tmp_path / "chunks"
    d.mkdir()
    f = open(d / f"shared-1-{ALLOC}.bin", "wb")
    f.truncate(4 * CHUNK)
    g = open(d / "gpu-1-0.bin", "wb")
    g.truncate(CHUNK + 100)  # a short last chunk
    assert poller.poll() == (0, 5 * CHUNK + 100)
    os.pwrite(f.fileno(), b"\x07" * CHUNK, 0)
    f.flush()
    first = poller.poll()
    os.pwrite(f.fileno(), b"\x07" * CHUNK, 3 * CHUNK)
    os.pwrite(g.fileno(), b"\x09" * (CHUNK + 100), 0)
    second = poller.poll()
    f.close()
    g.close()
    poller.close(ok=True)  # chunks 1 and 2 are zero: skipped, so the phase is done
    prog = [e for e in events if e[0] == "progress"]
    assert [e[1] for e in prog] == ["SAVE_ALLOCATIONS"] * 4
    done = [e[2] for e in prog]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 5 * CHUNK + 100
    assert CHUNK <= first[0] < second[0] <= 5 * CHUNK + 100
    assert {e[3] for e in prog} == {5 * CHUNK + 100}
    assert poller.row.transient and poller.row.status == "ok" and rep.phases == []


def test_the_chunk_poller_of_a_store_checkpoint_counts_only_its_own_packs(tmp_path):
    """Incremental (chunk store): the streams are the packs of this checkpoint's prefix; an
    older snapshot's pack in the same directory and DIR/chunks/ are not counted."""
    packs = tmp_path / ".cuinterpose-store" / "packs"
    packs.mkdir(parents=True)
    snap = tmp_path / "s"
    mine, older = "a" * 16 + "-", "b" * 16 + "-"
    with open(packs / f"{mine}shared-1-{ALLOC}.bin", "wb") as f:
        f.truncate(4 * CHUNK)
        os.pwrite(f.fileno(), b"\x07" * CHUNK, 0)
    (packs / f"{older}shared-1-{ALLOC}.bin").write_bytes(b"\x05" * 3 * CHUNK)
    (snap / "chunks").mkdir(parents=True)
    (snap / "chunks" / f"shared-1-{ALLOC}.bin").write_bytes(b"\x01" * CHUNK)
    poller = durable.ChunkProgress(Reporter(), "SAVE_ALLOCATIONS", snap, packs=mine)
    done, total = poller.measure()
    assert total == 4 * CHUNK and CHUNK <= done < 2 * CHUNK
    # restore: the named packs (its own, the others it refers to are read but not listed)
    poller = durable.ChunkProgress(
        Reporter(),
        "LOAD_ALLOCATIONS",
        snap,
        mode="read",
        packs={f"{older}shared-1-{ALLOC}.bin"},
    )
    assert poller.measure() == (0, 3 * CHUNK)


def test_the_chunk_poller_in_read_mode_counts_what_the_processes_read(tmp_path):
    d = tmp_path / "chunks"
    d.mkdir()
    data = os.urandom(2 * CHUNK)
    (d / "gpu-9-0.bin").write_bytes(data)
    rep = Reporter()
    poller = durable.ChunkProgress(
        rep, "LOAD_ALLOCATIONS", tmp_path, mode="read", pids=[os.getpid()]
    )
    before = poller.measure()
    assert before[1] == 2 * CHUNK and before[0] < CHUNK  # (this test's own small reads)
    assert (d / "gpu-9-0.bin").read_bytes() == data
    assert poller.measure() == (2 * CHUNK, 2 * CHUNK)  # capped at the allocated bytes


def test_a_running_row_of_the_polled_name_gets_the_progress(tmp_path):
    rep = Reporter()
    (tmp_path / "chunks").mkdir()
    with open(tmp_path / "chunks" / "gpu-3-0.bin", "wb") as f:
        f.truncate(CHUNK)
    with rep.phase("native checkpoint") as ph:
        poller = durable.ChunkProgress(rep, "native checkpoint", tmp_path)
        poller.poll()
        poller.close(ok=True)
    assert poller.row is ph and (ph.bytes, ph.total_bytes) == (CHUNK, CHUNK)


def test_the_poller_counts_only_its_steps_streams_and_gives_way_to_the_real_row(tmp_path):
    """Helper review, stop 21: a step shorter than one poll showed its row twice (the
    coordinator's SAVE_ALLOCATIONS row, then the poller's transient one from its last poll),
    and "native checkpoint" got the shim carriers' bytes. Each poller counts its own prefix
    (its step row's ``poll``) and reports into the real row once the reporter has one."""
    d = tmp_path / "chunks"
    d.mkdir()
    (d / f"shared-1-{ALLOC}.bin").write_bytes(b"\x07" * CHUNK)
    rep = Reporter()
    events = []
    rep.sinks.append(lambda ev, ph: events.append((ev, ph.name, id(ph))))
    native = durable.ChunkProgress(rep, "native checkpoint", tmp_path, prefix="gpu-")
    assert native.measure() == (0, 0)  # the carriers' file is SAVE's, not the native step's
    save = durable.ChunkProgress(rep, "SAVE_ALLOCATIONS", tmp_path, prefix="shared-")
    rep.record("INSPECT", 1000)
    real = rep.record("SAVE_ALLOCATIONS", 2000, CHUNK)  # the coordinator's row, at its end
    save.close(ok=True)
    assert save.row is real and (real.bytes, real.total_bytes) == (CHUNK, CHUNK)
    assert [p.name for p in rep.phases] == ["INSPECT", "SAVE_ALLOCATIONS"]
    assert {i for ev, n, i in events if n == "SAVE_ALLOCATIONS"} == {id(real)}
    polls = {s.name: s.poll for s in cp_mod.Checkpoint.STEPS if s.poll}
    assert polls == {
        "capture": ("SAVE_ALLOCATIONS", "write", "shared-"),
        "native checkpoint": ("native checkpoint", "write", "gpu-"),
    }
    polls = {s.name: s.poll for s in rs_mod.Restore.STEPS if s.poll}
    assert polls == {
        "native restore": ("native restore", "read", "gpu-"),
        "restore shared": ("LOAD_ALLOCATIONS", "read", "shared-"),
    }


def test_restore_verify_is_its_own_phase_with_progress(tmp_path):
    snap = tmp_path / "snap"
    d = snapdir.SnapshotDir(snap).criu_dir(5)
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(os.urandom(2 * durability.HASH_BLOCK + 1))
    (d / "core.img").write_bytes(b"c")
    rep = Reporter()
    rep.PROGRESS_EVERY_NS = 0
    rs = rs_mod.Restore(snap, reporter=rep)
    rs.m = {"criu": {"files": manifest_mod.image_files(snap)}, "roots": [5]}
    got = []
    rep.sinks.append(lambda ev, ph: ev == "progress" and got.append((ph.bytes, ph.total_bytes)))
    rs.verify_images()
    total = 2 * durability.HASH_BLOCK + 2
    assert [(p.name, p.status, p.bytes) for p in rep.phases] == [("verify", "ok", total)]
    assert got[-1] == (total, total) and [b for b, _ in got] == sorted(b for b, _ in got)
    assert rep.phases[0].detail == "2 CRIU images, sha256 as in the manifest"


def test_an_unreadable_file_fails_the_sync_naming_it(tmp_path, monkeypatch):
    snap = tmp_path / "snap"
    (snap / "criu" / "1").mkdir(parents=True)
    (snap / "criu" / "1" / "core.img").write_bytes(b"x")

    def enospc(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durability, "_fsync", enospc)
    with pytest.raises(AgentError) as ei:
        snapdir.SnapshotDir(snap).sync()
    assert ei.value.phase == "sync"
    assert ei.value.reason.startswith(
        f"fsync of {snap / 'criu' / '1' / 'core.img'} failed: No space left on device (errno 28)"
    )


def test_phase_rows_without_begin_time_their_own_block():
    rep = Reporter()
    with rep.phase("a") as a:
        pass
    ph = rep.record("b", 1234)
    assert rep.cursor_ns is None and isinstance(a, Phase)
    assert ph.elapsed_ns == 1234  # timed elsewhere: kept as given


def test_the_capture_step_reports_the_chunk_files_progress(world, tmp_path, monkeypatch):
    """The step runner polls DIR/chunks/ around ``capture``: whatever the poller thread saw
    meanwhile, the step's end gives the last event, the streams' total (chunk 1 is zero)."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    world.images_dir = tmp_path / "snap"
    _files_written_by_the_dump(world, monkeypatch)
    seen = []
    rep = Reporter(
        [lambda ev, ph: ev == "progress" and seen.append((ph.name, ph.bytes, ph.total_bytes))]
    )
    cp_mod.Checkpoint([ROOT], world.images_dir, control_dir=world.ctl, reporter=rep).run()
    polled = [s for s in seen if s[0] == "SAVE_ALLOCATIONS"]
    assert polled[-1] == ("SAVE_ALLOCATIONS", 3 * CHUNK, 3 * CHUNK)
    assert [b for _, b, _ in polled] == sorted(b for _, b, _ in polled)
    assert {t for *_, t in polled} == {3 * CHUNK}
    assert "SAVE_ALLOCATIONS" not in [p.name for p in rep.phases]  # transient: no manifest row
    sync = [s for s in seen if s[0] == "sync"]
    assert (
        sync[-1][1] == sync[-1][2] == rep.phases[[p.name for p in rep.phases].index("sync")].bytes
    )


def test_a_snapshot_that_cannot_be_listed_fails_the_sync_naming_it(tmp_path, monkeypatch):
    snap = tmp_path / "snap"
    (snap / "criu" / "1").mkdir(parents=True)
    img = snap / "criu" / "1" / "core.img"
    img.write_bytes(b"x")
    real = os.lstat

    def lstat(p, *a, **kw):
        if str(p) == str(img):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
        return real(p, *a, **kw)

    monkeypatch.setattr(snapdir.os, "lstat", lstat)
    with pytest.raises(AgentError) as ei:
        snapdir.SnapshotDir(snap).sync()
    assert (ei.value.phase, ei.value.reason.split(";")[0]) == (
        "sync",
        f"listing of {img} failed: No such file or directory (errno 2)",
    )
