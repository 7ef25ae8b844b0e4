"""``cuinterpose-agent inspect --pid PID``: INSPECT one process through its control socket.

Read-only: INSPECT is accepted in every shim phase except FAILED and changes nothing. It is
refused while a checkpoint or restore of the process's job runs (``quiesce.job_busy``), and
it holds the control directory's lock while connected, so a checkpoint's quiesce request (and
with it CRIU) waits until its connection is closed.
"""

from __future__ import annotations

import os
import pathlib

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import ctldir, quiesce
from cuinterpose.coordinator.protocol import default_control_dir


def inspect_pid(pid: int, *, control_dir=None, timeout_s: float = 10.0) -> dict:
    """INSPECT ``pid``; returns ``{"pid", "socket_path", "phase" (name), "records" [Record dicts],
    "roles" {"private","creator","importer": n}, "adapter" (:func:`adapter_stats`),
    "devices" (:func:`device_table`), "message"}``. Raises ``AgentError`` (phase "INSPECT")
    naming the pid when the socket is missing, the shim does not answer, or refuses (a driver
    CUDA IPC handle in the process makes the shim refuse: the message names it)."""
    from cuinterpose.agent.snapshot.manifest import role_counts
    from cuinterpose.coordinator.client import ShimClient, ShimClientError
    from cuinterpose.coordinator.protocol import Op, Phase, Status

    cdir = pathlib.Path(control_dir or default_control_dir())
    ctldir.check(cdir, phase="INSPECT", pid=pid)
    sock = census_mod.socket_path(cdir, pid)
    census_mod.check_process_id(pid, "INSPECT")
    if cdir.is_dir():
        _refuse_busy(cdir, pid)  # before the stop check: a dead agent's stopped tree says so
    census_mod.check_not_stopped(pid, "INSPECT")
    if not os.path.exists(sock):
        if not census_mod.pid_alive(pid):
            raise AgentError("INSPECT", "no such process", pid=pid)
        census_mod.check_socket_dir(cdir, "INSPECT")
        with_socket = descendants_with_socket(pid, cdir)
        if with_socket:
            listed = ", ".join(f"{c} ({comm})" for c, comm in with_socket)
            raise AgentError(
                "INSPECT",
                f"has no control socket {sock}; processes under it that "
                f"have one: {listed} (inspect one of those; pass pid {pid} to "
                "checkpoint as the root of the job)",
                pid=pid,
            )
        raise AgentError(
            "INSPECT",
            f"has no control socket {sock} (not started under the shim, "
            "no cuInit yet, or another --control-dir)",
            pid=pid,
        )
    census_mod.check_socket_owner(sock, pid, "INSPECT")
    client = ShimClient(sock, timeout_s, pid=pid, inspect_devices=True)
    try:
        # under the control dir's lock (quiesce.serial), which a checkpoint's quiesce request
        # and a restore's record take too: this connection is closed before either starts, and
        # none is opened while one runs (CRIU would find it in the tree: "External socket")
        with quiesce.serial(cdir):
            _refuse_busy(cdir, pid)
            resp = client.request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
            if resp.reply.status == Status.REFUSED_PHASE:
                # INSPECT must name the shim's current phase; the refusal told us which it is
                resp = client.request(Op.INSPECT, txn_id=0, expected_phase=resp.reply.phase)
    except TimeoutError as e:
        raise AgentError("INSPECT", f"{e}; INSPECT refused", pid=pid) from None
    except ShimClientError as e:
        # the client's text already starts "INSPECT: pid P "
        text = str(e).removeprefix(f"INSPECT: pid {pid} ").removeprefix("INSPECT: ")
        raise AgentError("INSPECT", text, pid=pid) from None
    if resp.reply.status != Status.OK:
        raise AgentError(
            "INSPECT", f"shim answered {Status(resp.reply.status).name}: {resp.message}", pid=pid
        )
    try:
        phase = Phase(resp.reply.phase).name
    except ValueError:
        phase = str(int(resp.reply.phase))
    return {
        "pid": pid,
        "socket_path": str(sock),
        "phase": phase,
        "records": [r.to_dict() for r in resp.records],
        "roles": role_counts(resp.records),
        "adapter": adapter_stats(resp.records),
        "devices": device_table(resp.records),
        "message": resp.message,
    }


def _refuse_busy(cdir, pid: int) -> None:
    """``AgentError`` (phase INSPECT, refused) naming what holds ``pid``'s job, if anything
    (``quiesce.job_busy``: a live checkpoint or restore, or a dead agent's, naming release)."""
    busy = quiesce.job_busy(cdir, [pid, *census_mod.ancestors(pid)])
    if busy:
        raise AgentError(
            "INSPECT",
            f"{busy}; INSPECT refused while it runs (its connection would be in the tree when "
            "CRIU dumps or restores it): retry once it has ended",
            pid=pid,
        )


def native_state(pid: int, options) -> dict:
    """What the driver says of ``pid``: {"state": "RUNNING" | "LOCKED" | "CHECKPOINTED" |
    "FAILED", "backend": the native backend that asked ("driver-api", "cuda-checkpoint"),
    "driver": "real" | "fake"}, or {"state": None, "error": why} when the driver of
    ``options`` (agent/options.py ``DriverOptions``: ``--driver``, ``--native-backend``)
    cannot be loaded or does not answer (read-only: ``cuCheckpointProcessGetState``)."""
    from cuinterpose.agent.mech import native

    try:
        with native.using(options):
            drv = native.load(options.driver)
            b = native.backend()
            return {"state": b.get_state(pid), "backend": b.name, "driver": drv.kind}
    except AgentError as e:
        return {"state": None, "error": str(e)}


def device_table(records) -> list[dict]:
    """The GPUs one INSPECT says the process uses, from its DEVICE records (``Record``;
    protocol.h ``CUI_RECORD_DEVICE``), ordinal order: ``[{"ordinal" (the process's),
    "uuid" ("GPU-..." as the driver names the ordinal now), "total_memory" (bytes),
    "name_hash" (16 hex digits: cui_checksum64 of cuDeviceGetName), "uses" (["CONTEXT",
    "ALLOCATION", "ACCESS", "MULTICAST"], those set)}]``. Empty for a shim without DEVICE
    records."""
    from cuinterpose.coordinator.protocol import DeviceUse, RecordKind

    out = []
    for r in records:
        if int(r.kind) != RecordKind.DEVICE:
            continue
        out.append(
            {
                "ordinal": int(r.prop_location_id),
                "uuid": r.device_uuid,
                "total_memory": int(r.size),
                "name_hash": f"{r.device_name_hash:016x}",
                "uses": [u.name for u in DeviceUse if r.reserved0 & u],
            }
        )
    out.sort(key=lambda d: d["ordinal"])
    return out


def adapter_stats(records) -> dict:
    """The IPC adapter's share of one INSPECT (docs/shim.md "IPC adapter"), from its allocation
    records (``Record``): ``allocations`` (cuMemAlloc_v2 backed by cuMemCreate in this process),
    ``requested`` and ``mapped`` bytes of those and ``waste`` (mapped - requested: the rounding
    up to the granularity), ``ipc_exported`` (of them, shared by cuIpcGetMemHandle),
    ``ipc_imports`` (allocations opened from other processes) and ``ipc_opens`` (their open
    handles: reserved[1])."""
    from cuinterpose.coordinator.protocol import RecordFlag, RecordKind, Role

    out = dict.fromkeys(
        ("allocations", "requested", "mapped", "waste", "ipc_exported", "ipc_imports", "ipc_opens"),
        0,
    )
    for r in records:
        if r.kind != RecordKind.ALLOCATION or not r.flags & RecordFlag.ADAPTER:
            continue
        if r.role == Role.IMPORTER:
            out["ipc_imports"] += 1
            out["ipc_opens"] += r.reserved[1]
            continue
        out["allocations"] += 1
        out["requested"] += r.reserved[0]
        out["mapped"] += r.size
        out["ipc_exported"] += bool(r.flags & RecordFlag.IPC)
    out["waste"] = out["mapped"] - out["requested"]
    return out


def descendants_with_socket(pid: int, control_dir) -> list[tuple[int, str]]:
    """(pid, comm) of the processes under ``pid`` (not itself) that have a control socket in
    ``control_dir``, in tree order."""
    try:
        tree = census_mod.walk_tree([pid])[1:]
    except AgentError:
        return []
    return [
        (c, comm)
        for c, _, comm in tree
        if census_mod.is_socket(census_mod.socket_path(control_dir, c))
    ]


def render_table(res: dict) -> None:
    """Print an INSPECT result as a rich table on stdout (one row per record)."""
    from rich.console import Console
    from rich.table import Table

    from cuinterpose.agent.run.report import fmt_bytes

    short = {"ALLOCATION": "alloc", "MAPPING": "map", "RESERVATION": "resv"}
    recs = [r for r in res["records"] if r["kind"] != "DEVICE"]
    t = Table(
        title=f"pid {res['pid']}  phase {res['phase']}  ({res['socket_path']})",
        title_justify="left",
    )
    for col in ("kind", "role", "allocation", "creator", "va", "size", "flags", "access"):
        t.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
    for r in recs:
        acc = ",".join(f"{a.get('location_id')}:{a.get('flags')}" for a in r.get("access", []))
        is_resv = r["kind"] == "RESERVATION"
        t.add_row(
            short.get(str(r["kind"]), str(r["kind"])),
            "" if is_resv else str(r["role"]).lower(),
            "" if is_resv else str(r["alloc_id"])[:8] + "…",
            str(r["creator_pid"] or ""),
            f"{r['va']:#x}" if r["va"] else "",
            fmt_bytes(r["size"]),
            f"{r['flags']:#x}",
            acc,
        )
    c = Console()
    if not c.is_terminal:
        c = Console(width=120)
    c.print(t)
    devices = res.get("devices") or []
    if devices:
        d = Table(title=f"pid {res['pid']}  devices", title_justify="left")
        for col in ("ordinal", "uuid", "memory", "uses"):
            d.add_column(col, no_wrap=True)
        for g in devices:
            d.add_row(
                str(g["ordinal"]), g["uuid"], fmt_bytes(g["total_memory"]), ",".join(g["uses"])
            )
        c.print(d)
    roles = res["roles"]
    c.print(
        f"allocations: {roles['private']} private, {roles['creator']} creator, "
        f"{roles['importer']} importer"
    )
    nat = res.get("native") or {}
    if nat.get("state"):
        c.print(f"native: {nat['state']} ({nat['driver']} driver, {nat['backend']})")
    elif nat:
        c.print(f"native: unknown ({nat.get('error')})")
    ad = res.get("adapter") or {}
    if ad.get("allocations") or ad.get("ipc_imports"):
        c.print(
            f"IPC adapter: {ad['allocations']} cuMemAlloc allocations "
            f"({ad['ipc_exported']} shared by cuIpcGetMemHandle), "
            f"{fmt_bytes(ad['requested'])} requested, {fmt_bytes(ad['mapped'])} mapped "
            f"({fmt_bytes(ad['waste'])} rounding waste); {ad['ipc_imports']} IPC imports "
            f"({ad['ipc_opens']} open handles)"
        )
