"""GPU identity and restore onto other GPUs: the GPU records of the manifest, ``restore
--device-map OLD=NEW[,...]``, and the automatic mapping (docs/agent.md "Restore onto other GPUs").

Shapes. A *GPU record* is ``{"ordinal": int, "uuid": "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
"name": str, "total_memory": int (bytes), "compute_capability": "MAJOR.MINOR"}`` (the driver's
``cuDeviceGetUuid``, ``cuDeviceGetName``, ``cuDeviceTotalMem``,
``CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}``). In the manifest each participant
has ``gpus`` (its visible GPUs, ``ordinal`` as the process saw it) and, when it was set,
``cuda_visible_devices``. :func:`node_gpus` lists the GPUs the agent sees, ``ordinal`` being
the agent's.

A restore onto other GPUs passes each process the ``(old UUID, new UUID)`` pairs of its own
GPUs (``CUcheckpointRestoreArgs.gpuPairs``, cuda.h 13.0; ``cuda-checkpoint --device-map``): like
the CLI, every checkpointed GPU must be listed, the new one of the same model (name) and with
at least the old one's total memory. The process keeps its ordinals: the driver puts each
ordinal on its new GPU, so the shim's records (which name devices by ordinal) stay valid and
the post-restore INSPECT equals the capture (docs/decisions.md, "restore onto other GPUs").

Every refusal raises :class:`DeviceMapError` (phase "device map") naming both GPUs, before
anything of the snapshot or the node is touched.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from cuinterpose.agent.errors import AgentError

PHASE = "device map"


class DeviceMapError(AgentError):
    """The device map (given or automatic) was refused; nothing was restored."""

    def __init__(self, reason: str):
        super().__init__(PHASE, reason)


# ------------------------------------------------------------------ UUIDs, records


def uuid_str(b: bytes) -> str:
    """16 UUID bytes as ``nvidia-smi -L`` writes them: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = bytes(b).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def describe(g: dict) -> str:
    """``GPU-... (H100 80GB, 85899345920 bytes)``: how a refusal names a GPU."""
    return f"{g['uuid']} ({g['name']}, {g['total_memory']} bytes)"


def node_gpus(driver=None) -> list[dict]:
    """The GPUs the agent sees, in its ordinal order, as GPU records (the loaded driver: see
    :func:`cuinterpose.agent.mech.native.load`). Raises ``AgentError`` (phase "driver") when a
    query fails."""
    if driver is None:
        from cuinterpose.agent.mech import native

        native.info()
        driver = native._driver

    def ok(res, what):
        if int(res[0]) != 0:
            raise AgentError("driver", f"{what}: {getattr(res[0], 'name', int(res[0]))}")
        return res[1]

    out = []
    attr = driver.CUdevice_attribute
    for i in range(ok(driver.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = ok(driver.cuDeviceGet(i), f"cuDeviceGet({i})")
        name = ok(driver.cuDeviceGetName(256, dev), f"cuDeviceGetName({i})")
        uuid = ok(driver.cuDeviceGetUuid(dev), f"cuDeviceGetUuid({i})")
        mem = ok(driver.cuDeviceTotalMem(dev), f"cuDeviceTotalMem({i})")
        cc = [
            ok(driver.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({i})")
            for a in (
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
        ]
        out.append(
            {
                "ordinal": i,
                "uuid": uuid_str(bytes(uuid.bytes)),
                "name": bytes(name).split(b"\0")[0].decode(errors="replace"),
                "total_memory": int(mem),
                "compute_capability": f"{cc[0]}.{cc[1]}",
            }
        )
    return out


def visible(cvd: Optional[str], node: Sequence[dict]) -> list[dict]:
    """The GPUs of ``node`` (GPU records by node ordinal) a process with
    ``CUDA_VISIBLE_DEVICES=cvd`` sees, with ``ordinal`` renumbered as it sees them. The driver's
    rules (CUDA C++ Programming Guide, "CUDA Environment Variables"): unset, all; else the listed
    ordinals or UUIDs (``GPU-...`` or an unambiguous prefix) in order, cut at the first invalid,
    unknown, ambiguous or repeated entry."""
    if cvd is None:
        return [dict(g, ordinal=i) for i, g in enumerate(node)]
    out: list[dict] = []
    for tok in cvd.split(","):
        t = tok.strip()
        hit = None
        if t.startswith("GPU-"):
            hits = [g for g in node if g["uuid"].startswith(t)]
            hit = hits[0] if len(hits) == 1 else None
        elif t.isdigit() and int(t) < len(node):
            hit = node[int(t)]
        if hit is None or any(g["uuid"] == hit["uuid"] for g in out):
            break
        out.append(dict(hit, ordinal=len(out)))
    return out


def process_gpus(pid: int, node: Sequence[dict]) -> tuple[list[dict], Optional[str]]:
    """(GPU records of ``pid`` by its ordinals, its ``CUDA_VISIBLE_DEVICES`` or None), from
    ``/proc/PID/environ`` (the value it was started with) against ``node``."""
    cvd = _environ(pid, "CUDA_VISIBLE_DEVICES")
    return visible(cvd, node), cvd


def _environ(pid: int, name: str) -> Optional[str]:
    from cuinterpose.agent.mech import procfs

    try:
        raw = procfs.environ_value(pid, name)
    except OSError:
        return None
    return raw.decode(errors="replace") if raw is not None else None


def placement_gpus(pid: int, node: Sequence[dict]) -> list[dict]:
    """The GPUs a placement process (a placeholder container's init, ``restore --into-pid``)
    sees, renumbered as it sees them: its ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA container
    runtime's: unset or ``all``: every GPU; ``none``, ``void`` or empty: none; else indices or
    UUIDs, as ``CUDA_VISIBLE_DEVICES``), then its ``CUDA_VISIBLE_DEVICES`` on top (both from
    ``/proc/PID/environ``)."""
    nv = _environ(pid, "NVIDIA_VISIBLE_DEVICES")
    if nv is None or nv.strip() == "all":
        seen = visible(None, node)
    elif nv.strip() in ("none", "void", ""):
        seen = []
    else:
        seen = visible(nv, node)
    return visible(_environ(pid, "CUDA_VISIBLE_DEVICES"), seen)


def snapshot_gpus(m: dict) -> Optional[list[dict]]:
    """Every GPU of the snapshot once (without ``ordinal``), in the documented order:
    participants in manifest order, each one's GPUs by its ordinal; None when the manifest has
    no GPU records (an older agent wrote it)."""
    parts = m.get("participants") or []
    if not any("gpus" in p for p in parts):
        return None
    seen: dict[str, dict] = {}
    for p in parts:
        for g in sorted(p.get("gpus") or [], key=lambda g: g["ordinal"]):
            seen.setdefault(g["uuid"], {k: v for k, v in g.items() if k != "ordinal"})
    return list(seen.values())


# ------------------------------------------------------------------ the mapping


def _check_target(old: dict, new: dict) -> None:
    if new["name"] != old["name"]:
        raise DeviceMapError(
            f"GPU {describe(old)} cannot be restored onto {describe(new)}: another model"
        )
    if new["total_memory"] < old["total_memory"]:
        raise DeviceMapError(
            f"GPU {describe(old)} cannot be restored onto {describe(new)}: less memory"
        )


def _old_gpu(tok: str, m: dict, gpus: Sequence[dict]) -> dict:
    t = tok.strip()
    if t.isdigit():
        found = {
            g["uuid"]
            for p in m.get("participants") or []
            for g in p.get("gpus") or []
            if g["ordinal"] == int(t)
        }
        if len(found) > 1:
            raise DeviceMapError(
                f"old GPU {t} is ambiguous: the processes saw ordinal {t} as "
                f"{', '.join(sorted(found))}; name it by UUID"
            )
        hits = [g for g in gpus if g["uuid"] in found]
    else:
        hits = [g for g in gpus if g["uuid"].startswith(t)] if t.startswith("GPU-") else []
    if len(hits) != 1:
        have = ", ".join(describe(g) for g in gpus)
        raise DeviceMapError(f"old GPU {t!r} is no GPU of the snapshot (it has {have})")
    return hits[0]


def _new_gpu(tok: str, node: Sequence[dict]) -> dict:
    t = tok.strip()
    if t.isdigit():
        hits = [g for g in node if g["ordinal"] == int(t)]
    else:
        hits = [g for g in node if g["uuid"].startswith(t)] if t.startswith("GPU-") else []
    if len(hits) != 1:
        have = ", ".join(f"{g['ordinal']}: {describe(g)}" for g in node) or "none"
        raise DeviceMapError(f"new GPU {t!r} is not visible to the agent (it sees {have})")
    return hits[0]


def parse(text: str, m: dict, node: Sequence[dict]) -> dict[str, str]:
    """``--device-map OLD=NEW[,...]`` -> {old UUID: new UUID}. OLD: a snapshot GPU by UUID
    (or unique prefix) or by the ordinal the processes saw it at (refused when they saw
    different GPUs there); NEW: a GPU the agent sees by UUID or by the agent's ordinal. Every
    GPU of the snapshot must appear, each NEW once, of the same model and with at least as much
    total memory. Raises :class:`DeviceMapError`."""
    gpus = snapshot_gpus(m)
    if not gpus:
        raise DeviceMapError(
            "the snapshot records no GPUs (an older agent took it): --device-map cannot be checked"
        )
    out: dict[str, str] = {}
    used: dict[str, str] = {}
    for entry in (e for e in text.split(",") if e.strip()):
        if entry.count("=") != 1:
            raise DeviceMapError(f"entry {entry.strip()!r} is not OLD=NEW")
        o, n = entry.split("=")
        old, new = _old_gpu(o, m, gpus), _new_gpu(n, node)
        if old["uuid"] in out:
            raise DeviceMapError(f"old GPU {describe(old)} is listed twice")
        if new["uuid"] in used:
            raise DeviceMapError(
                f"new GPU {describe(new)} is the target of both {used[new['uuid']]} and "
                f"{old['uuid']}"
            )
        _check_target(old, new)
        out[old["uuid"]] = new["uuid"]
        used[new["uuid"]] = old["uuid"]
    missing = [g for g in gpus if g["uuid"] not in out]
    if missing:
        raise DeviceMapError(
            "every checkpointed GPU must be listed; missing: "
            + ", ".join(describe(g) for g in missing)
        )
    return out


def automatic(m: dict, node: Sequence[dict]) -> dict[str, str]:
    """The mapping when ``--device-map`` is not given: {} when every GPU of the snapshot is
    visible (or the manifest has no GPU records); else each visible snapshot GPU stays, and each
    absent one, in :func:`snapshot_gpus` order, takes the first visible GPU (agent ordinal
    order) that no other takes, of the same model and with at least its total memory. Refused
    (:class:`DeviceMapError`) when fewer GPUs are visible than the snapshot used, or when an
    absent GPU finds no target (naming it and the visible GPUs that were refused)."""
    gpus = snapshot_gpus(m)
    if not gpus:
        return {}
    here = {g["uuid"] for g in node}
    if all(g["uuid"] in here for g in gpus):
        return {}
    if len(node) < len(gpus):
        raise DeviceMapError(
            f"the snapshot used {len(gpus)} GPUs ({', '.join(describe(g) for g in gpus)}), "
            f"the agent sees {len(node)}: pass --device-map or restore where enough are visible"
        )
    out = {g["uuid"]: g["uuid"] for g in gpus if g["uuid"] in here}
    taken = set(out.values())
    for old in (g for g in gpus if g["uuid"] not in here):
        free = [g for g in node if g["uuid"] not in taken]
        fit = [
            g for g in free if g["name"] == old["name"] and g["total_memory"] >= old["total_memory"]
        ]
        if not fit:
            why = "; ".join(
                f"{describe(g)}: "
                + ("another model" if g["name"] != old["name"] else "less memory")
                for g in free
            )
            raise DeviceMapError(
                f"GPU {describe(old)} is absent and no visible GPU can take it ({why or 'none'})"
            )
        out[old["uuid"]] = fit[0]["uuid"]
        taken.add(fit[0]["uuid"])
    return out


def resolve(m: dict, node: Sequence[dict], device_map: Optional[str]) -> dict[str, str]:
    """{old UUID: new UUID} for the restore: :func:`parse` of ``device_map`` when given, else
    :func:`automatic`; {} when the processes go back onto their own GPUs."""
    mapping = parse(device_map, m, node) if device_map else automatic(m, node)
    if all(o == n for o, n in mapping.items()):
        return {}
    return mapping


def pairs_for(
    participant: dict, mapping: dict[str, str], node: Sequence[dict] = ()
) -> list[tuple[str, str]]:
    """The (old UUID, new UUID) pairs passed to one participant's restore; [] when ``mapping``
    is empty. The driver wants every GPU of the node listed, not only the process's own
    (cuda.core ``Process.restore``: "provide mappings for every GPU visible to the kernel-mode
    driver. User-space masking such as CUDA_VISIBLE_DEVICES does not reduce this mapping
    requirement"), so the pairs are a permutation of every GPU known here: the participant's
    own (unmoved ones onto themselves), the rest of the snapshot's by ``mapping``, and the GPUs
    of ``node`` (GPU records, :func:`node_gpus`) neither covers, each onto a GPU left free (one
    of the same model first). A node the agent sees only in part (its own
    ``CUDA_VISIBLE_DEVICES``) or a restore on another node leaves GPUs of the checkpoint node
    unknown: the driver then refuses the pairs (INVALID_VALUE), nothing restored."""
    if not mapping:
        return []
    gpus = sorted(participant.get("gpus") or [], key=lambda g: g["ordinal"])
    pairs = {g["uuid"]: mapping.get(g["uuid"], g["uuid"]) for g in gpus}
    for old, new in mapping.items():
        pairs.setdefault(old, new)
    name = {g["uuid"]: g.get("name") for g in node}
    known = list(dict.fromkeys([*pairs, *pairs.values(), *name]))
    free = [u for u in known if u not in set(pairs.values())]
    for old in (u for u in known if u not in pairs):
        same = [u for u in free if name.get(u) is not None and name.get(u) == name.get(old)]
        new = (same or free)[0]
        free.remove(new)
        pairs[old] = new
    return list(pairs.items())


def mapped_gpus(participant: dict, mapping: dict[str, str], node: Sequence[dict]) -> list[dict]:
    """The participant's GPU records after the restore: same ordinals, the new GPUs."""
    by_uuid = {g["uuid"]: g for g in node}
    out = []
    for g in sorted(participant.get("gpus") or [], key=lambda g: g["ordinal"]):
        new = by_uuid.get(mapping.get(g["uuid"], g["uuid"]))
        out.append(dict(new, ordinal=g["ordinal"]) if new else dict(g))
    return out


# ------------------------------------------------------------------ native restore with pairs


def native_restore(pids: Iterable[int], pairs_of: dict[int, list[tuple[str, str]]]) -> None:
    """Native-restore every pid (in order) with its own pairs (``pairs_of[pid]``, [] = its own
    GPUs) through the chosen native backend (``native.restore_all(pids, gpu_pairs)``: the
    driver API's ``CUcheckpointRestoreArgs.gpuPairs`` or ``cuda-checkpoint --device-map``).
    Raises ``NativeError`` (phase "native restore")."""
    from cuinterpose.agent.mech import native

    for pid in pids:
        native.restore_all([pid], gpu_pairs=tuple(pairs_of.get(pid) or ()))
