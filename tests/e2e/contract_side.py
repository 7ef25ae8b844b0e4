"""Shared by the small e2e test workloads (ext_socket.py, rogue_export.py): JSON-lines events,
a driver-call check, and the workload side of docs/workload-contract.md (answer one quiesce
request, park until `.resume`, clean up)."""

from __future__ import annotations

import json
import os
import sys
import time


def emit(ev: dict) -> None:
    """One JSON event per line on stdout, flushed."""
    print(json.dumps(ev), flush=True)


def check(res, what: str):
    """A cuda.bindings result tuple: its value(s) on CUDA_SUCCESS, else an `error` event naming
    `what` and the CUresult, and exit status 3."""
    from cuda.bindings import driver as cu

    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        emit({"event": "error", "message": f"{what}: {err.name}"})
        sys.exit(3)
    return res[1] if len(res) == 2 else res[1:]


def park_on_request(ctl: str, root: int, deadline: float) -> dict | None:
    """Wait (until ``deadline``, time.monotonic()) for ``quiesce-ROOT.request``; answer `.ready`
    with this process as the only rank, wait for the `.resume` of its id, remove the three files
    (`.request` last), and return
    the resume object. None when no request came before the deadline."""
    req, ready, resume = (
        os.path.join(ctl, f"quiesce-{root}.{k}") for k in ("request", "ready", "resume")
    )
    while time.monotonic() < deadline:
        try:
            with open(req) as f:
                rid = json.load(f)["id"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.02)
            continue
        tmp = ready + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"id": rid, "ranks": [{"pid": root}]}, f)
        os.rename(tmp, ready)
        while True:
            try:
                with open(resume) as f:
                    res = json.load(f)
                if res.get("id") == rid:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        for p in (ready, resume, req):  # its own files, .request last (the contract)
            try:
                with open(p) as f:
                    mine = json.load(f).get("id") == rid
                if mine:
                    os.unlink(p)
            except (OSError, ValueError):
                pass
        return res
    return None
