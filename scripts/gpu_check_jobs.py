"""The workload-driving checks of scripts/gpu_check.py (the rest: gpu_check_steps.py).

- ``carrier-copy``: bench/datapath_job.py (a creator's B-byte ``cuMemCreate`` allocation,
  exported as a POSIX FD and mapped by an importer) under the shim; quiesced, captured with
  the coordinator (SAVE_ALLOCATIONS writes the chunk files) and restored at once
  (LOAD_ALLOCATIONS reads them); then both processes hash the whole mapping against what was
  written (``verified``). GB/s = 10^9 bytes/s: the phase's bytes over its wall time and over
  the shim's ``copy_ns`` (device <-> staging ring: the op's time issuing the pipelined copies and
  waiting for them, ops_copies.c), against a pinned ``cuMemcpy`` of 1 GiB and a ``dd
  oflag=direct`` of 1 GiB measured in the same run; ``save*_over_pinned`` / ``load*_over_pinned``
  are the ratios (issue 26: at least 0.8). It fails when a creator's staging ring was not
  page-locked (reply.reserved[4..5], protocol.h "Carriers").
- ``afdwin-live``: afdwin 2A2F (4 ranks, 2 attention) run to the end without a checkpoint;
  then a second run quiesced mid-stream, captured and restored by the shim's phases on the
  live processes, resumed and run to the end. The mapping VAs and sizes of every record
  (INSPECT before the capture, after the restore) are compared, and afdwin's own evidence
  (every message's bytes checked by the receiver) must show nothing lost, duplicated or torn.
- ``native-cycle``: the same with the driver's native lock, checkpoint, restore and unlock of
  every rank between the capture and the restore (each step timed, each state read back).
- ``agent-leave-running``: ``cuinterpose-agent checkpoint --leave-running`` of afdwin 2A2F
  (native checkpoint and CRIU's dump), which then runs to the end with the same evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from gpu_check_steps import PROBE, REPO, Ctx, Result, Skip, last_json, run, say, tail_reason

from cuinterpose.agent.mech import quiesce
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.claim import Claim
from cuinterpose.coordinator.phases import Coordinator
from cuinterpose.coordinator.results import Participant
from cuinterpose.workloads.afdwin import demo
from cuinterpose.workloads.afdwin.process_state import process_state

GIB = 1 << 30
CARRIER_BYTES = {"real": (1 * GIB, 8 * GIB), "fake": (64 << 20, 256 << 20)}
BASELINE_BYTES = {"real": 1 * GIB, "fake": 64 << 20}
AFDWIN = {"ranks": 4, "attention": 2, "ring_depth": 2, "step_delay_ms": 2.0}  # 2A2F
PLAIN_STEPS = 60
CUT_STEPS = 120
HOLD_STEP = 30  # the attention ranks hold after this step until the cut's quiesce
LOCK_TIMEOUT_MS = 10000


def control_dir() -> pathlib.Path:
    """A short private control dir (``<dir>/cuinterpose-<pid>.sock`` fits in sun_path)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="cui-gck-"))


def wait_json(path: pathlib.Path, ctx: Ctx, what: str, proc=None) -> dict:
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the job exited {proc.returncode} before writing {path}")
        if time.monotonic() > ctx.deadline:
            raise TimeoutError(f"{what}: no {path} before the deadline")
        time.sleep(0.01)


@contextlib.contextmanager
def quiesced(ctl, root: int, ctx: Ctx, *, restored: bool):
    """Ask ``root``'s job to quiesce (the workload contract), yield its rank pids, resume it
    (``restored``) when the block ends, or cancel if it raised before."""
    qid = quiesce.new_id()
    timeout_ms = int(min(60, ctx.left()) * 1000)
    quiesce.request(ctl, [root], qid, timeout_ms)
    ready = quiesce.wait_ready(ctl, [root], qid, timeout_ms)
    pids = [int(r["pid"]) for r in ready[root]["ranks"]]
    say(f"quiesced {root}: ranks {pids}")
    ok = False
    try:
        yield pids
        ok = True
    finally:
        if ok:
            quiesce.resume(ctl, [root], qid, restored=restored)
        else:
            quiesce.cancel(ctl, [root], qid)


def coordinator(pids, ctl, chunks: pathlib.Path, ctx: Ctx) -> Coordinator:
    parts = [Participant.from_pid(p, ctl) for p in pids]
    return Coordinator(
        parts,
        timeout_s=min(60.0, ctx.left()),
        carrier_timeout_s=ctx.left(),
        carriers=CarrierFiles(chunks),
        # the check drives the shims as the agent does: holding a claim (protocol.h "Claims")
        claim=Claim.take(ctl, list(pids), kind="gpu-check", token=_CLAIM_TOKEN),
    )


#: one claim token for every coordinator of this check (a later one must not revoke an earlier)
_CLAIM_TOKEN = os.urandom(16)


def phase(results, name: str):
    return next(p for p in results if p.phase == name)


def gbps(n: int, ns: int) -> float:
    return round(n / ns, 3) if ns else 0.0


# ---- carrier copy --------------------------------------------------------------------------
def dd_direct(path: pathlib.Path, n: int, ctx: Ctx) -> float | None:
    """Seconds of ``dd`` writing n zero bytes with O_DIRECT and a final fdatasync (None where
    dd refused O_DIRECT, e.g. on a tmpfs)."""
    t0 = time.monotonic()
    res = run(
        [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            "bs=8M",
            f"count={n >> 23}",
            "oflag=direct",
            "conv=fdatasync",
            "status=none",
        ],
        ctx,
        timeout_s=60,
    )
    dt = time.monotonic() - t0
    path.unlink(missing_ok=True)
    return dt if res.returncode == 0 else None  # dd refused O_DIRECT there (a tmpfs)


def carrier_cycle(n: int, ctx: Ctx) -> dict:
    d = ctx.work / f"carrier-{n}"
    d.mkdir(parents=True, exist_ok=True)
    ctl = control_dir()
    (d / "ready.json").unlink(missing_ok=True)
    (d / "result.json").unlink(missing_ok=True)
    env = demo.workload_env(ctl, driver=ctx.driver)
    cmd = [
        sys.executable,
        str(REPO / "bench" / "datapath_job.py"),
        "creator",
        "--bytes",
        str(n),
        "--out",
        str(d),
        "--ctl",
        str(ctl),
        "--timeout-s",
        f"{ctx.left():.0f}",
    ]
    say(f"carrier {n} B: {' '.join(cmd)}")
    with open(d / "job.log", "ab") as log:
        job = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    try:
        t0 = time.monotonic()
        ready = wait_json(d / "ready.json", ctx, f"carrier {n} B", job)
        say(f"carrier {n} B: job ready in {time.monotonic() - t0:.1f} s")
        with quiesced(ctl, ready["creator"], ctx, restored=True) as pids:
            coord = coordinator(pids, ctl, d / "chunks", ctx)
            cap = coord.capture()
            rest = coord.restore(cap)
        save, load = phase(cap.phases, "SAVE_ALLOCATIONS"), phase(rest.phases, "LOAD_ALLOCATIONS")
        res = wait_json(d / "result.json", ctx, f"carrier {n} B", job)
        job.wait(timeout=ctx.left())
        row = {
            "bytes": n,
            "verified": bool(res.get("verified")),
            "bytes_compared": res.get("bytes_compared", 0),
        }
        for label, p in (("save", save), ("load", load)):
            creator = max(p.participants.values(), key=lambda r: r.bytes)
            row[f"{label}_bytes"] = creator.bytes
            row[f"{label}_s"] = round(p.wall_ns / 1e9, 3)
            row[f"{label}_gbps"] = gbps(creator.bytes, p.wall_ns)
            row[f"{label}_copy_gbps"] = gbps(creator.bytes, creator.copy_ns)
            row[f"{label}_direct_bytes"] = creator.direct_bytes
            row[f"{label}_staging_pinned_bytes"] = creator.staging_pinned_bytes
            row[f"{label}_pageable"] = p.pageable_staging  # pid -> CUresult name
        say(f"carrier {n} B: {row}")
        return row
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        shutil.rmtree(d / "chunks", ignore_errors=True)  # B bytes on a small disk


def carrier_copy(ctx: Ctx) -> Result:
    base_n = BASELINE_BYTES[ctx.driver]
    res = run([sys.executable, PROBE, "memcpy", str(base_n)], ctx, timeout_s=60)
    if res.returncode != 0:
        return Result("FAIL", f"pinned baseline {tail_reason(res)}")
    base = last_json(res.stdout)
    dd_s = dd_direct(ctx.work / "dd-baseline.bin", base_n, ctx)
    keys = {
        "pinned_dtoh_gbps": base["dtoh"]["best_gbps"],
        "pinned_htod_gbps": base["htod"]["best_gbps"],
        "dd_direct_gbps": round(base_n / dd_s / 1e9, 3) if dd_s else "n/a",
    }
    rows, problems = [], []
    for n in CARRIER_BYTES[ctx.driver]:
        row = carrier_cycle(n, ctx)
        rows.append(row)
        g = f"{n >> 20}m"
        keys[f"save{g}_gbps"] = row["save_gbps"]
        keys[f"save{g}_copy_gbps"] = row["save_copy_gbps"]
        keys[f"load{g}_gbps"] = row["load_gbps"]
        keys[f"load{g}_copy_gbps"] = row["load_copy_gbps"]
        # issue 26: the staging copies (pipelined over streams, ops_copies.c) over a pinned
        # cuMemcpy of the same direction; copy_ns is the op's time issuing them and waiting
        keys[f"save{g}_over_pinned"] = round(row["save_copy_gbps"] / base["dtoh"]["best_gbps"], 3)
        keys[f"load{g}_over_pinned"] = round(row["load_copy_gbps"] / base["htod"]["best_gbps"], 3)
        say(
            f"carrier {n} B: staging copy / pinned cuMemcpy: SAVE {keys[f'save{g}_over_pinned']} "
            f"(DtoH {row['save_copy_gbps']} of {base['dtoh']['best_gbps']} GB/s), LOAD "
            f"{keys[f'load{g}_over_pinned']} (HtoD {row['load_copy_gbps']} of "
            f"{base['htod']['best_gbps']} GB/s)"
        )
        if not row["verified"] or row["save_bytes"] < n or row["load_bytes"] < n:
            problems.append(
                f"{n} B: verified={row['verified']} saved {row['save_bytes']} "
                f"loaded {row['load_bytes']}"
            )
        for label in ("save", "load"):  # a pageable ring copies at a quarter of the speed
            if row[f"{label}_pageable"] or not row[f"{label}_staging_pinned_bytes"]:
                problems.append(
                    f"{n} B: the {label} staging ring was not page-locked "
                    f"({row[f'{label}_pageable'] or 'no bytes locked'})"
                )
    detail = {"baseline": base, "dd_direct_s": dd_s, "rows": rows}
    return Result("FAIL" if problems else "PASS", "; ".join(problems), keys, detail)


# ---- afdwin --------------------------------------------------------------------------------
def start_afdwin(ctx: Ctx, name: str, steps: int, hold: bool = True, holds: int = 1) -> demo.Afdwin:
    """afdwin 2A2F under the shim; with ``hold`` its attention ranks stop after
    :data:`HOLD_STEP` (and each further ``holds`` multiple of it) until a quiesce comes (the
    cut lands there however fast the run is)."""
    hold_at = tuple(HOLD_STEP * (i + 1) for i in range(holds)) if hold else ()
    a = demo.Afdwin(ctx.work / name, steps=steps, driver=ctx.driver, hold_at=hold_at, **AFDWIN)
    a.ctl = control_dir()
    return a.start()


def finish(a: demo.Afdwin, steps: int, ctx: Ctx) -> dict:
    """Wait for the run to end; its evidence: problems (check_run), the summary counts."""
    rc = a.proc.wait(timeout=ctx.left())
    evs = a.events()
    ffn = AFDWIN["ranks"] - AFDWIN["attention"]
    problems = demo.check_run(
        evs, steps, attention=AFDWIN["attention"], ffn=ffn, expect_restore=False
    )
    s = ([e for e in evs if demo.kind(e) == "summary"] or [{}])[-1]
    pairs = [
        p
        for e in evs
        if demo.kind(e) == "done"
        for p in e.get("pairs", e.get("per_pair", [])) or []
    ]
    per_pair = {
        (p.get("src", p.get("sender")), p.get("dst", p.get("receiver"))): int(p.get("count", 0))
        for p in pairs
    }
    out = {
        "exit": rc,
        "problems": problems,
        "messages": sum(per_pair.values()),
        "lost": s.get("lost"),
        "duplicated": s.get("duplicated"),
        "torn": s.get("torn"),
    }
    if rc != 0 or problems:
        out["stderr_tail"] = a.stderr_tail()
    return out


def va_table(records: dict) -> dict:
    """{pid: sorted (kind, va, size, offset)} of an INSPECT, for comparing two of them."""
    return {
        pid: sorted((int(r.kind), r.va, r.size, r.offset) for r in recs)
        for pid, recs in records.items()
    }


def run_cut(ctx: Ctx, name: str, native_steps: bool) -> tuple[dict, dict]:
    """afdwin 2A2F cut mid-stream by the shim's phases (and the native checkpoint steps when
    ``native_steps``): returns (keys, detail)."""
    from cuinterpose.agent.mech import native

    a = start_afdwin(ctx, name, CUT_STEPS)
    try:
        a.wait_hold(1, ctx.left())
        timings, states = {}, {}
        with quiesced(a.ctl, a.pid, ctx, restored=False) as pids:
            coord = coordinator(pids, a.ctl, ctx.work / name / "chunks", ctx)
            before = va_table(coord.inspect())
            t0 = time.monotonic()
            cap = coord.capture()
            timings["phases_capture_ms"] = round((time.monotonic() - t0) * 1e3, 1)
            if native_steps:
                native.load(ctx.driver)
                for step, fn in (
                    ("lock", lambda: native.lock_all(pids, LOCK_TIMEOUT_MS)),
                    ("checkpoint", lambda: native.checkpoint_all(pids)),
                    ("restore", lambda: native.restore_all(pids)),
                    ("unlock", lambda: native.unlock_all(pids)),
                ):
                    t0 = time.monotonic()
                    per_pid = fn()
                    timings[f"native_{step}_ms"] = round((time.monotonic() - t0) * 1e3, 1)
                    timings[f"native_{step}_max_pid_ms"] = round(max(per_pid.values()) / 1e6, 1)
                    states[step] = sorted({native.get_state(p) for p in pids})
                    say(f"native {step}: {timings[f'native_{step}_ms']} ms, states {states[step]}")
            t0 = time.monotonic()
            rest = coord.restore(cap)
            timings["phases_restore_ms"] = round((time.monotonic() - t0) * 1e3, 1)
            after = va_table(coord.inspect())
        end = finish(a, CUT_STEPS, ctx)
    finally:
        a.kill()
    n_rec = sum(len(v) for v in before.values())
    carried = sum(
        r.bytes
        for p in cap.phases
        if p.phase == "SAVE_ALLOCATIONS"
        for r in p.participants.values()
    )
    keys = {
        "ranks": len(before),
        "records": n_rec,
        "vas_equal": int(before == after),
        "carried_bytes": carried,
        **timings,
        "messages": end["messages"],
        "lost": end["lost"],
        "duplicated": end["duplicated"],
        "torn": end["torn"],
    }
    detail = {
        "before": before,
        "after": after,
        "states": states,
        "finish": end,
        "restore_phases": [p.phase for p in rest.phases],
    }
    return keys, detail


def afdwin_live(ctx: Ctx) -> Result:
    a = start_afdwin(ctx, "afdwin-plain", PLAIN_STEPS, hold=False)
    try:
        plain = finish(a, PLAIN_STEPS, ctx)
    finally:
        a.kill()
    keys, detail = run_cut(ctx, "afdwin-phases", native_steps=False)
    keys = {"plain_messages": plain["messages"], "plain_problems": len(plain["problems"]), **keys}
    detail["plain"] = plain
    return verdict(keys, detail, plain)


def verdict(keys: dict, detail: dict, plain: dict | None = None) -> Result:
    problems = list(detail["finish"]["problems"])
    if plain is not None:
        problems += [f"plain run: {p}" for p in plain["problems"]]
        if plain["exit"] != 0:
            problems.append(
                f"plain run exited {plain['exit']}: {plain.get('stderr_tail', '')[-200:]}"
            )
    if detail["finish"]["exit"] != 0:
        problems.append(
            f"cut run exited {detail['finish']['exit']}: "
            f"{detail['finish'].get('stderr_tail', '')[-200:]}"
        )
    if not keys["vas_equal"]:
        problems.append("the records' VAs or sizes after the restore differ from before")
    return Result("FAIL" if problems else "PASS", "; ".join(map(str, problems))[:400], keys, detail)


def native_cycle(ctx: Ctx) -> Result:
    if not ctx.fact("driver", "checkpoint_api"):
        raise Skip("the driver exports no cuCheckpointProcess* API")
    keys, detail = run_cut(ctx, "afdwin-native", native_steps=True)
    return verdict(keys, detail)


def agent_leave_running(ctx: Ctx) -> Result:
    if not ctx.fact("driver", "checkpoint_api"):
        raise Skip("the driver exports no cuCheckpointProcess* API")
    if not ctx.fact("criu", "ok"):
        raise Skip("CRIU is not usable here (see the criu check)")
    a = start_afdwin(ctx, "afdwin-agent", CUT_STEPS, holds=2)
    snap = ctx.work / "afdwin-agent" / "snap"
    kept: dict = {}
    try:
        a.wait_hold(1, ctx.left())
        pids = [a.pid, *sorted(e["pid"] for e in a.events() if demo.kind(e) == "window")]
        before = {p: process_state(p) for p in pids}
        t0 = time.monotonic()
        rc, cp = demo.run_agent(
            *a.checkpoint_args(snap),
            "--leave-running",
            timeout_s=ctx.left(),
        )
        wall = time.monotonic() - t0
        say(f"agent checkpoint exit {rc} in {wall:.1f} s: {json.dumps(cp)[:2000]}")
        if rc == 0:  # rebuilt as after a rollback: the same signals, threads, fds (issue 23)
            a.wait_hold(2, ctx.left())
            kept = process_kept(before, {p: process_state(p) for p in pids})
        a.release_hold()
        end = finish(a, CUT_STEPS, ctx)
    finally:
        a.kill()
    keys = {
        "agent_exit": rc,
        "ok": int(bool(cp.get("ok"))),
        "checkpoint_s": round(wall, 2),
        **{k: int(not v) for k, v in kept.items()},
        "messages": end["messages"],
        "lost": end["lost"],
        "duplicated": end["duplicated"],
        "torn": end["torn"],
    }
    problems = list(end["problems"])
    if kept.get("signals_kept"):  # dispositions and masks must be kept on every driver
        problems.append(f"signal dispositions changed: {kept['signals_kept']}")
    if rc != 0 or not cp.get("ok"):
        problems.insert(0, f"agent: {cp.get('error') or cp.get('raw', '')[-300:]}")
    if end["exit"] != 0:
        problems.append(f"afdwin exited {end['exit']}: {end.get('stderr_tail', '')[-200:]}")
    return Result(
        "FAIL" if problems else "PASS",
        "; ".join(map(str, problems))[:400],
        keys,
        {"agent": cp, "finish": end, "kept": kept},
    )


def process_kept(before: dict, after: dict) -> dict:
    """{"signals_kept", "threads_kept", "fds_kept": [pid: what differs] (empty: kept)} of two
    ``process_state`` maps. Threads and fds are reported, not failed: a real driver may
    start threads or reopen descriptors in its native restore (this check settles it)."""
    out: dict = {"signals_kept": [], "threads_kept": [], "fds_kept": []}
    for p, b in before.items():
        a = after[p]
        sig = {k: (b[k], a[k]) for k in ("SigCgt", "SigBlk", "SigIgn") if b[k] != a[k]}
        if sig:
            out["signals_kept"].append({p: sig})
        if b["threads"] != a["threads"]:
            out["threads_kept"].append({p: [len(b["threads"]), len(a["threads"])]})
        fds = {f: (b["fds"].get(f), a["fds"].get(f)) for f in set(b["fds"]) | set(a["fds"])}
        fds = {f: v for f, v in fds.items() if v[0] != v[1]}
        if fds or b["device memory fds"] != a["device memory fds"]:
            out["fds_kept"].append({p: fds})
    return out


# ---- the data path of issue 12 (bench/datapath.py) ----------------------------------------
DATAPATH_BYTES = {"real": (1 * GIB, 4 * GIB), "fake": (64 << 20,)}
SHORT = {
    "checkpoint_over_dd": "ckpt_over_dd",
    "checkpoint_over_dd_direct": "ckpt_over_dd_direct",
    "restore_over_read_plus_criu": "restore_over_read_criu",
    "disk_over_bytes": "disk_over_b",
    "checkpoint_rss_over_bytes": "ckpt_rss_over_b",
    "checkpoint_over_dense": "ckpt_over_dense",
}


def bench_datapath(ctx: Ctx) -> Result:
    """``bench/datapath.py --json``: checkpoint and restore of B shared bytes, dense and 90 %
    zero, against ``dd``, a read and CRIU alone in the same run; keys ``<B>m[_z90]_<ratio>``."""
    if not ctx.fact("criu", "ok"):
        raise Skip("CRIU is not usable here (see the criu check)")
    if ctx.driver == "real" and not ctx.fact("driver", "checkpoint_api"):
        raise Skip("the driver exports no cuCheckpointProcess* API")
    d = ctx.work / "datapath"
    d.mkdir(exist_ok=True)
    sizes = [a for n in DATAPATH_BYTES[ctx.driver] for a in ("--bytes", str(n))]
    res = run(
        [
            sys.executable,
            "bench/datapath.py",
            "--driver",
            ctx.driver,
            "--json",
            "--dir",
            str(d),
            "--timeout-s",
            f"{ctx.left():.0f}",
            *sizes,
        ],
        ctx,
    )
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not rows:
        return Result("FAIL", tail_reason(res), {}, {"rows": rows})
    keys, problems = {}, []
    for r in rows:
        tag = f"{r['bytes'] >> 20}m" + (
            "" if r["zero_fraction"] == 0 else f"_z{round(r['zero_fraction'] * 100)}"
        )
        keys[f"{tag}_ckpt_s"] = r["checkpoint_s"]
        keys[f"{tag}_restore_s"] = r["restore_s"]
        keys.update({f"{tag}_{SHORT[k]}": v for k, v in r["ratios"].items() if k in SHORT})
        if not r["verified"]:
            problems.append(f"{tag}: the restored bytes differ")
    return Result("FAIL" if problems else "PASS", "; ".join(problems), keys, {"rows": rows})
