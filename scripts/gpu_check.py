#!/usr/bin/env python3
"""The checks of scripts/gpu-check.sh, one child process each, each with its own deadline.

    python3 scripts/gpu_check.py --driver real|fake --out DIR --work DIR [--budget-s S]
        [--only NAME,...] [--skip NAME,...] [--setup FILE]

Runs :data:`CHECKS` in order (the order of issue 14: the driver and the machine, the GPU
tests, the benches, afdwin under the shim's phases, native checkpoint). Each check runs as
``gpu_check.py --one NAME`` in a new session with stdout and stderr in ``WORK/logs/NAME.log``;
past its timeout (seconds, capped by what is left of ``--budget-s``) it gets SIGTERM (its
``finally`` blocks kill the workloads it started), then SIGKILL 10 s later, and counts FAIL.
A check whose prerequisite fact is missing (no checkpoint API, CRIU unusable) is SKIP with the
reason; when the budget is spent every check left is SKIP.

Prints one line per check as it ends, ``gpu-check: NAME PASS|FAIL|SKIP (reason) key=value…
t=SECONDS``, and rewrites after each check ``OUT/gpu-check.json`` (``{"driver", "host",
"started", "setup", "checks": [{"name", "status", "reason", "keys", "seconds", "detail"}],
"elapsed_s", "done"}``) and ``OUT/gpu-check.log`` (every check's log, the last
:data:`LOG_TAIL` bytes of each), so a run cut short still reports everything before the cut.
``--setup FILE``: a JSON list of results gpu-check.sh produced before (deps, build), put
first in the report. Exit status: 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_check_steps as steps  # noqa: E402 (stdlib only at import: --help works anywhere)

LOG_TAIL = 64 << 10  # bytes of each check's log kept in OUT/gpu-check.log
KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL
T0 = time.monotonic()  # the run's start: budgets and the +S offsets count from here


@dataclasses.dataclass(frozen=True)
class Check:
    """``name`` (the report's key), ``fn`` ("steps.NAME" or "jobs.NAME": a function ctx ->
    Result in gpu_check_steps.py or gpu_check_jobs.py, imported by the check's own child, so a
    broken build fails that check, not the runner), ``timeout_s``."""

    name: str
    fn: str
    timeout_s: float

    def resolve(self):
        module, name = self.fn.split(".")
        return getattr(importlib.import_module(f"gpu_check_{module}"), name)


CHECKS = (
    Check("driver", "steps.driver", 60),
    Check("driver-semantics", "steps.driver_semantics", 90),
    Check("kernel", "steps.kernel", 20),
    Check("criu", "steps.criu", 60),
    Check("doctor", "steps.doctor", 60),
    Check("gpu-tests", "steps.gpu_tests", 240),
    Check("real-stacks", "steps.real_stacks", 420),
    Check("conformance", "steps.conformance", 180),
    Check("bench-intercept", "steps.bench_intercept", 90),
    Check("bench-phases", "steps.bench_phases", 90),
    Check("carrier-copy", "jobs.carrier_copy", 180),
    Check("afdwin-live", "jobs.afdwin_live", 150),
    Check("native-cycle", "jobs.native_cycle", 150),
    Check("agent-leave-running", "jobs.agent_leave_running", 150),
    Check("bench-datapath", "jobs.bench_datapath", 240),
)
#: not run by run_all: it starts a sleeper in its own session and blocks, so that a test can
#: stop it as a deadline would (tests/scripts/test_gpu_check.py)
SELFTEST = Check("selftest-hang", "steps.selftest_hang", 600)
BY_NAME = {c.name: c for c in CHECKS + (SELFTEST,)}


def fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s.replace(" ", "_") if s else "''"


def line(res: dict) -> str:
    """``gpu-check: NAME STATUS (reason) k=v… t=S``: the one line a check prints."""
    parts = [f"gpu-check: {res['name']} {res['status']}"]
    if res.get("reason"):
        reason = " | ".join(ln.strip() for ln in str(res["reason"]).splitlines() if ln.strip())
        parts.append(f"({reason})")
    parts += [f"{k}={fmt_value(v)}" for k, v in res.get("keys", {}).items()]
    parts.append(f"t={res.get('seconds', 0):.1f}s")
    return " ".join(parts)


def tail_of(path: pathlib.Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_line(path: pathlib.Path) -> str:
    lines = [ln for ln in tail_of(path, 4096).splitlines() if ln.strip()]
    return lines[-1].strip()[:200] if lines else "no output"


def start_child(check: Check, args, timeout_s: float, facts_path: pathlib.Path):
    """Start ``gpu_check.py --one NAME`` in a new session, output appended to its log;
    returns (Popen, log path)."""
    log = pathlib.Path(args.work) / "logs" / f"{check.name}.log"
    (pathlib.Path(args.work) / "results" / f"{check.name}.json").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--one",
        check.name,
        "--driver",
        args.driver,
        "--work",
        args.work,
        "--out",
        args.out,
        "--facts",
        str(facts_path),
        "--timeout-s",
        f"{timeout_s:.0f}",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    return proc, log


def stop_child(proc: subprocess.Popen) -> None:
    """SIGTERM the check's session (its ``finally`` blocks kill what it started), SIGKILL it
    :data:`KILL_GRACE_S` later if it is still there; reaps it."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


CURRENT: list = []  # the check's child process while it runs (for an interrupt)


def run_child(check: Check, args, timeout_s: float, facts_path: pathlib.Path) -> dict:
    """Run one check in its own session; returns its result dict (FAIL on timeout or crash)."""
    result_path = pathlib.Path(args.work) / "results" / f"{check.name}.json"
    t0 = time.monotonic()
    proc, log = start_child(check, args, timeout_s, facts_path)
    CURRENT[:] = [proc]
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_child(proc)
        return {
            "name": check.name,
            "status": "FAIL",
            "seconds": time.monotonic() - t0,
            "reason": f"timed out after {timeout_s:.0f} s; last log line: {last_line(log)}",
            "keys": {},
            "detail": {},
        }
    try:
        res = json.loads(result_path.read_text())
    except (OSError, ValueError):
        res = {
            "name": check.name,
            "status": "FAIL",
            "keys": {},
            "detail": {},
            "reason": f"the check exited {proc.returncode} without a result; "
            f"last log line: {last_line(log)}",
        }
    res["seconds"] = time.monotonic() - t0
    return res


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def become_subreaper() -> None:
    """Orphans of the checks (a workload whose starter died) are re-parented to this process,
    so that :func:`sweep` finds them."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children() -> list[int]:
    me, out = os.getpid(), []
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def sweep() -> int:
    """SIGKILL (with its process group) and reap every process a check left behind; returns
    how many there were. Bounded: at most :data:`KILL_GRACE_S` of retries."""
    seen: set[int] = set()
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        left = children()
        if not left:
            break
        for pid in left:
            seen.add(pid)
            try:  # its group (a session of its own, never ours), then it
                if os.getpgid(pid) != os.getpgrp():
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.05)
    return len(seen)


def write_report(args, report: dict, results: list[dict]) -> None:
    out = pathlib.Path(args.out)
    report["checks"] = results
    report["elapsed_s"] = round(time.monotonic() - T0, 1)
    tmp = out / "gpu-check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out / "gpu-check.json")
    logs = pathlib.Path(args.work) / "logs"
    with open(out / "gpu-check.log", "w") as f:
        for res in report["setup"] + results:
            f.write(f"===== {res['name']} {res['status']} =====\n")
            f.write(tail_of(logs / f"{res['name']}.log", LOG_TAIL))
            f.write("\n")


def run_all(args) -> int:
    out, work = pathlib.Path(args.out), pathlib.Path(args.work)
    for d in (out, work / "logs", work / "results"):
        d.mkdir(parents=True, exist_ok=True)
    setup = json.loads(pathlib.Path(args.setup).read_text()) if args.setup else []
    report = {
        "commit": os.environ.get("GPU_CHECK_COMMIT", "unknown"),
        "driver": args.driver,
        "host": platform.node(),
        "done": False,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "budget_s": args.budget_s,
        "setup": setup,
    }
    only = set(filter(None, args.only.split(","))) if args.only else None
    skip = set(filter(None, args.skip.split(",")))
    for name in (only or set()) | skip:
        if name not in BY_NAME:
            raise SystemExit(f"gpu_check: no check {name!r} (checks: {', '.join(BY_NAME)})")
    facts: dict = {"setup": {r["name"]: r.get("facts", {}) for r in setup}}
    facts_path = work / "facts.json"
    results: list[dict] = []
    failed = any(r["status"] == "FAIL" for r in setup)
    become_subreaper()

    def on_term(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run_checks(args, report, setup, results, only, skip, facts, facts_path, failed)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the check, kill what it started, report
        if CURRENT:
            stop_child(CURRENT[0])
        swept = sweep()
        report["interrupted"] = True
        write_report(args, report, results)
        print(
            f"# interrupted: the check running was stopped, {swept} processes killed; "
            f"report {out / 'gpu-check.json'}",
            flush=True,
        )
        return 130


def run_checks(args, report, setup, results, only, skip, facts, facts_path, failed) -> int:
    """run_all's loop over :data:`CHECKS`."""
    out = pathlib.Path(args.out)
    for check in CHECKS:
        if (only is not None and check.name not in only) or check.name in skip:
            continue
        left = args.budget_s - (time.monotonic() - T0)
        if left < 15 + KILL_GRACE_S:
            res = {
                "name": check.name,
                "status": "SKIP",
                "seconds": 0.0,
                "keys": {},
                "detail": {},
                "reason": f"budget of {args.budget_s:.0f} s spent",
            }
        else:
            timeout = min(check.timeout_s, left - 5 - KILL_GRACE_S)
            print(
                f"# {check.name}: start at +{time.monotonic() - T0:.1f} s "
                f"(deadline {timeout:.0f} s)",
                flush=True,
            )
            facts_path.write_text(json.dumps(facts))
            res = run_child(check, args, timeout, facts_path)
            res["left_running"] = sweep()
            if res["left_running"]:
                print(f"# {check.name}: killed {res['left_running']} processes it left running")
        facts[check.name] = res.pop("facts", {})
        failed |= res["status"] == "FAIL"
        results.append(res)
        print(line(res), flush=True)
        write_report(args, report, results)
    report["done"] = True
    write_report(args, report, results)
    print(f"# summary ({time.monotonic() - T0:.1f} s; report {out / 'gpu-check.json'})")
    for res in setup + results:
        print(line(res))
    return 1 if failed else 0


def run_one(args) -> int:
    """Child side: run one check, write WORK/results/NAME.json."""
    check = BY_NAME[args.one]
    facts = json.loads(pathlib.Path(args.facts).read_text()) if args.facts else {}
    ctx = steps.Ctx(
        driver=args.driver,
        work=pathlib.Path(args.work),
        out=pathlib.Path(args.out),
        facts=facts,
        deadline=time.monotonic() + args.timeout_s - 5,
    )

    def on_term(signum, frame):
        raise steps.Interrupted(f"stopped by {signal.Signals(signum).name} at the deadline")

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    try:
        res = check.resolve()(ctx)
    except steps.Skip as e:
        res = steps.Result("SKIP", str(e))
    except BaseException as e:  # every failure is a FAIL line with its reason, never a crash
        import traceback

        traceback.print_exc()
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        res = steps.Result("FAIL", f"{type(e).__name__}: {last}"[:300])
    body = {
        "name": check.name,
        "status": res.status,
        "reason": res.reason,
        "keys": res.keys,
        "detail": res.detail,
        "facts": res.facts,
        "seconds": time.monotonic() - t0,
    }
    path = pathlib.Path(args.work) / "results" / f"{check.name}.json"
    path.write_text(json.dumps(body, default=str))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="checks, in order: " + ", ".join(c.name for c in CHECKS),
    )
    ap.add_argument("--driver", choices=("real", "fake"), default="real")
    ap.add_argument("--out", required=True, help="where gpu-check.json and gpu-check.log go")
    ap.add_argument("--work", required=True, help="scratch directory (logs, snapshots)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall time for all checks")
    ap.add_argument("--only", default="", help="run only these checks (comma separated)")
    ap.add_argument("--skip", default="", help="leave these checks out (comma separated)")
    ap.add_argument("--setup", default="", help="JSON list of setup results to report first")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--facts", default="", help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return run_one(args) if args.one else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
