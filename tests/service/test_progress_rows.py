"""Progress rows of a phase that moves bytes (``event`` "progress": bytes done, total, rate,
ETA) as the service streams them and as the CLI's ``--agent`` display takes them back, and the
per-phase seconds and bytes in Prometheus. No daemon: the Stream and the metrics registry."""

from __future__ import annotations

import re

import pytest

from cuinterpose.agent.cli.common import RemoteRows
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import service
from cuinterpose.agent.rpc.metrics import Metrics
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot import pb

TOTAL = 3 << 20
STEPS = (0, 1 << 20, 1 << 20, 2 << 20, TOTAL)
DETAIL = re.compile(
    r"^(?P<done>[\d.]+ (?:B|KiB|MiB|GiB)) of (?P<total>[\d.]+ (?:B|KiB|MiB|GiB))"
    r"(?: \((?P<pct>\d+)%\))?, [\d.]+ (?:B|KiB|MiB|GiB)/s(?:, ETA (?P<eta>[\d.]+ (?:us|ms|s)))?$"
)


def _events(work):
    st = service.Stream(work)
    st.rep.PROGRESS_EVERY_NS = 0
    return list(st)


def _sync_work(rep, emit):
    with rep.phase("sync") as ph:
        for done in STEPS:
            rep.progress(ph, done, TOTAL, final=done == TOTAL)
        ph.detail = "3 files fsynced"
    return {"ok": True}, None


def test_progress_rows_carry_bytes_done_of_the_total_with_rate_and_eta():
    evs = _events(_sync_work)
    rows = [e.progress for e in evs if e.WhichOneof("kind") == "progress"]
    assert [(r.event, r.phase) for r in rows] == (
        [("start", "sync")] + [("progress", "sync")] * len(STEPS) + [("end", "sync")]
    )
    prog = [r for r in rows if r.event == "progress"]
    assert [r.bytes for r in prog] == list(STEPS)  # monotone, the last one the total
    assert all(r.status == "running" and r.elapsed_ns >= 0 for r in prog)
    parsed = [DETAIL.match(r.detail) for r in prog]
    assert all(parsed), [r.detail for r in prog]
    assert {m["total"] for m in parsed} == {"3.0 MiB"}
    assert [m["done"] for m in parsed] == ["0 B", "1.0 MiB", "1.0 MiB", "2.0 MiB", "3.0 MiB"]
    assert [m["pct"] for m in parsed] == ["0", "33", "33", "66", "100"]
    assert parsed[0]["eta"] is None  # nothing moved yet: no rate, so no ETA
    assert all(m["eta"] is not None for m in parsed[1:]) and parsed[-1]["eta"] == "0 us"
    # the schema's own fields: the total, a rate once bytes moved, the ETA (-1 before)
    assert [r.total_bytes for r in prog] == [TOTAL] * len(STEPS)
    assert prog[0].eta_ns == -1 and all(r.rate_bytes_per_s > 0 for r in prog[1:])
    assert prog[-1].eta_ns == 0
    end = rows[-1]
    assert (end.status, end.bytes, end.detail) == ("ok", TOTAL, "3 files fsynced")
    res = evs[-1].result
    assert [(p.name, p.bytes) for p in res.phases] == [("sync", TOTAL)]


def test_the_remote_display_follows_progress_rows_and_a_pollers_row_gives_way():
    shown = []
    rep = Reporter([lambda ev, ph: shown.append((ev, ph.name, ph.bytes, ph.status))])
    rows = RemoteRows(rep)
    base = {"node": "", "pid": 0, "group_phase": "", "text": "", "elapsed_ns": 0}
    # a poller's progress for SAVE_ALLOCATIONS (no start row), then the coordinator's row
    for done in (0, 4096, 8192):
        rows(
            {
                **base,
                "event": "progress",
                "phase": "SAVE_ALLOCATIONS",
                "status": "running",
                "bytes": done,
                "detail": f"{done} B of 8.0 KiB",
            }
        )
    for ev in ("start", "end"):
        rows(
            {
                **base,
                "event": ev,
                "phase": "SAVE_ALLOCATIONS",
                "status": "running" if ev == "start" else "ok",
                "bytes": 0 if ev == "start" else 8192,
                "elapsed_ns": 0 if ev == "start" else 5000,
                "detail": "2 pids",
            }
        )
    assert shown == [
        ("progress", "SAVE_ALLOCATIONS", 0, "running"),
        ("progress", "SAVE_ALLOCATIONS", 4096, "running"),
        ("progress", "SAVE_ALLOCATIONS", 8192, "running"),
        ("start", "SAVE_ALLOCATIONS", 0, "running"),
        ("end", "SAVE_ALLOCATIONS", 8192, "ok"),
    ]
    assert [(p.name, p.bytes, p.status, p.elapsed_ns) for p in rep.phases] == [
        ("SAVE_ALLOCATIONS", 8192, "ok", 5000)
    ]


def test_the_live_table_shows_progress_then_the_rows_detail():
    from cuinterpose.agent.run.report import RichSink

    sink = RichSink("checkpoint")
    rep = Reporter([sink])
    rep.PROGRESS_EVERY_NS = 0
    with sink:
        with rep.phase("sync") as ph:
            rep.progress(ph, 1 << 20, 2 << 20)
            running = [r.progress_text() for r in sink.rows]
            ph.detail = "done"
    assert running == [ph.progress_text()] and running[0].startswith("1.0 MiB of 2.0 MiB (50%), ")
    assert [(r.name, r.status, r.detail) for r in sink.rows] == [("sync", "ok", "done")]


def test_prometheus_has_each_phases_seconds_and_bytes():
    m = Metrics()
    m.phase_done("checkpoint", "sync", 1_500_000_000, 1 << 20)
    m.phase_done("checkpoint", "sync", 500_000_000, 1 << 20)
    m.phase_done("restore", "verify", 250_000_000, 4096)
    text = m.text()
    assert 'cuinterpose_phase_seconds_total{kind="checkpoint",phase="sync"} 2.0' in text
    assert 'cuinterpose_phase_bytes_total{kind="checkpoint",phase="sync"} 2.097152e+06' in text
    assert 'cuinterpose_phase_seconds_total{kind="restore",phase="verify"} 0.25' in text
    assert 'cuinterpose_phase_duration_seconds_count{kind="checkpoint",phase="sync"} 2.0' in text
    assert 'cuinterpose_phase_duration_seconds_sum{kind="checkpoint",phase="sync"} 2.0' in text


def test_progress_dict_has_only_the_schemas_fields():
    apb, _, _ = pb.modules()
    rep = Reporter()
    with rep.phase("verify") as ph:
        rep.progress(ph, 10, 20)
        d = service.progress_dict("progress", ph)
    assert set(d) <= set(apb.Progress.DESCRIPTOR.fields_by_name)
    assert apb.Progress(**d).bytes == 10


def test_checkpoint_options_carry_the_data_path_to_the_daemons_checkpoint(tmp_path):
    """CheckpointOptions.chunk_bytes/staging_bytes/writers/gpu_storage become the options of
    the daemon's Checkpoint; the fields a request leaves unset take the daemon's own (here
    its config's ``incremental`` and ``writers``), else the defaults."""
    from cuinterpose.agent.options import for_kinds

    apb, _, _ = pb.modules()
    own = for_kinds({"incremental": True, "writers": 8})
    svc = service.AgentService(
        service.ServeOptions(node="n", options=own, snapshot_dir=str(tmp_path))
    )
    msg = apb.CheckpointOptions(
        chunk_bytes=1 << 20, staging_bytes=4 << 20, writers=2, gpu_storage="host"
    )
    o = svc.request_options("checkpoint", msg)
    assert (o.chunk_bytes, o.staging_bytes, o.writers, o.gpu_storage, o.incremental) == (
        1 << 20,
        4 << 20,
        2,
        "host",
        True,
    )
    o = svc.request_options("checkpoint", None)
    assert (o.chunk_bytes, o.staging_bytes, o.writers, o.gpu_storage, o.incremental) == (
        None,
        None,
        8,
        "auto",
        True,
    )
    # a request may turn the daemon's incremental off, and a bad field names itself
    assert not svc.request_options(
        "checkpoint", apb.CheckpointOptions(incremental=False)
    ).incremental
    with pytest.raises(AgentError) as e:
        svc.request_options("checkpoint", apb.CheckpointOptions(writers=65))
    assert (e.value.phase, e.value.reason, e.value.outcome) == (
        "request",
        "options.writers=65: must be an integer from 1 to 64",
        "refused",
    )
