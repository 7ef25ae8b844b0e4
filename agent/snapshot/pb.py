"""The generated protobuf/gRPC modules and the manifest <-> ``cuinterpose.v1.Manifest`` mapping.

The modules are generated at build time (``scripts/gen_proto.py``, run by CMake) into
``cuinterpose/_proto/cuinterpose/v1/``; :func:`modules` imports them and raises
``ImportError`` naming ``make build`` when they are missing.

The manifest on disk stays the JSON object format_version 1 always had (docs/decisions.md
D10); ``cuinterpose.v1.Manifest`` is its schema with the same field names, except that the
file's ``capture`` object travels as ``capture_json`` and ``quiesce.ready`` as
``quiesce.ready_json`` (JSON text: their 64-bit integers would not survive
``google.protobuf.Struct``). :func:`manifest_to_proto` validates a manifest dict against the
schema, :func:`manifest_from_proto` gives the dict back, and
``manifest_from_proto(manifest_to_proto(m)) == m`` for every manifest the agent writes.
"""

from __future__ import annotations

import os
from typing import Any

# gRPC's fork handlers: the agent forks children (CRIU, with a preexec step that joins cgroups
# and namespaces) from threads while gRPC's own threads run; each child only execs. With the
# handlers on, gRPC logs "Other threads are currently calling into gRPC, skipping fork()
# handlers" to stderr for every one. Off unless the caller chose (read when grpc is imported).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

_MODS = None


def modules():
    """(agent_pb2, agent_pb2_grpc, manifest_pb2). Raises ``ImportError`` when not generated."""
    global _MODS
    if _MODS is None:
        try:
            from cuinterpose._proto.cuinterpose.v1 import agent_pb2, agent_pb2_grpc, manifest_pb2
        except ImportError as e:
            raise ImportError(
                f"the generated protobuf modules are missing ({e}); "
                "build the package: `make build` (pip install -e .)"
            ) from e
        _MODS = (agent_pb2, agent_pb2_grpc, manifest_pb2)
    return _MODS


def manifest_to_proto(m: dict):
    """``cuinterpose.v1.Manifest`` from a manifest dict (the parsed manifest.json). Raises
    ``ValueError`` (json_format's ``ParseError``, a subclass) naming the field whose value does
    not fit the schema; unknown keys are refused too (a newer writer bumps
    ``format_version``)."""
    import json

    from google.protobuf import json_format

    _, _, mpb = modules()
    d = dict(m)
    if "capture" in d:
        d["capture_json"] = json.dumps(d.pop("capture"), sort_keys=True)
    if "chunks" in d:
        d["chunks_json"] = json.dumps(d.pop("chunks"), sort_keys=True)
    if isinstance(d.get("quiesce"), dict):
        q = dict(d["quiesce"])
        if "ready" in q:
            ready = q.pop("ready")
            if not isinstance(ready, dict):
                raise ValueError("quiesce.ready: expected an object")
            q["ready_json"] = {str(k): json.dumps(v, sort_keys=True) for k, v in ready.items()}
        d["quiesce"] = q
    _gpu_storage_to_proto(d, mpb)
    return json_format.ParseDict(d, mpb.Manifest())


#: the Manifest field carrying ``gpu_storage`` as JSON text (issue 12, native custom storage)
GPU_STORAGE_FIELD = "gpu_storage_json"


def _gpu_storage_to_proto(d: dict, mpb) -> None:
    """``gpu_storage`` travels as JSON text in ``gpu_storage_json``."""
    import json

    g = d.pop("gpu_storage", None)
    if g is not None:
        d[GPU_STORAGE_FIELD] = json.dumps(g, sort_keys=True)


_INT64 = None


def _int_types():
    global _INT64
    if _INT64 is None:
        from google.protobuf.descriptor import FieldDescriptor as F

        _INT64 = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64}
    return _INT64


def _fix_ints(desc, d: Any) -> Any:
    """json_format writes 64-bit integers as strings; turn them back into ints, guided by the
    message descriptor (Struct values are left as they are)."""
    if not isinstance(d, dict) or desc.full_name == "google.protobuf.Struct":
        return d
    for f in desc.fields:
        if f.name not in d:
            continue
        v = d[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            if vf.message_type is not None:
                d[f.name] = {k: _fix_ints(vf.message_type, x) for k, x in v.items()}
            elif vf.type in _int_types():
                d[f.name] = {k: int(x) for k, x in v.items()}
        elif f.message_type is not None:
            d[f.name] = (
                [_fix_ints(f.message_type, x) for x in v]
                if isinstance(v, list)
                else _fix_ints(f.message_type, v)
            )
        elif f.type in _int_types():
            d[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
    return d


def message_to_dict(msg) -> dict:
    """Any message as a dict with original field names, every field present (defaults
    included) and 64-bit integers as ints."""
    from google.protobuf import json_format

    d = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _fix_ints(msg.DESCRIPTOR, d)


def manifest_from_proto(msg) -> dict:
    """The manifest dict (the JSON written to disk) for a ``Manifest``; ``group``, ``mac`` and
    ``native`` only when set."""
    import json

    d = message_to_dict(msg)
    for opt in ("group", "mac", "native"):
        if not msg.HasField(opt):
            d.pop(opt, None)
    d["capture"] = json.loads(d.pop("capture_json") or "null")
    chunks = d.pop("chunks_json", "")
    if chunks:
        d["chunks"] = json.loads(chunks)
    q = d.get("quiesce") or {}
    q["ready"] = {k: json.loads(v) for k, v in q.pop("ready_json", {}).items()}
    g = d.pop(GPU_STORAGE_FIELD, "")
    if g:
        d["gpu_storage"] = json.loads(g)
    return d
