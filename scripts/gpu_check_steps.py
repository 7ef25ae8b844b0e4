"""The checks of scripts/gpu_check.py: each is ``fn(ctx: Ctx) -> Result`` and runs in its own
child process (gpu_check.py ``--one NAME``), printing what it does to its log as it goes.

Facts the later checks need come from the earlier ones through ``ctx.facts`` (check name ->
its ``Result.facts``): ``driver`` gives ``checkpoint_api`` (every ``cuCheckpointProcess*``
exported), ``custom_storage``, ``driver_version``, ``libcuda``; ``criu`` gives ``ok``.

Every wait has a deadline (``ctx.deadline``, monotonic seconds, set 5 s before the parent's
SIGTERM); every workload a check starts is SIGKILLed (its whole session) in a ``finally``.
The workload-driving checks (carrier copy, afdwin, native checkpoint) are in
gpu_check_jobs.py. Raise :class:`Skip` for a check whose prerequisite is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = pathlib.Path(__file__).resolve().parents[1]
PROBE = REPO / "scripts" / "gpu_check_probe.py"
#: every cuCheckpointProcess* the native checkpoint needs (cuda.h 12.8+)
CHECKPOINT_API = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
CUSTOM_STORAGE_VERSION = 13040  # cuda.h 13.4: customStorageInfo_out, cuCheckpointOperationComplete
GPU_TEST_TIMEOUT_S = 90  # pytest-timeout per test in tests/gpu
PYTEST_GRACE_S = 30  # a pytest run is interrupted this long before its check's deadline


class Skip(Exception):
    """The check cannot run here (its reason is the message): a SKIP line, not a FAIL."""


class Interrupted(BaseException):
    """SIGTERM from the parent at the check's deadline (a BaseException: no ``except
    Exception`` swallows it, every ``finally`` runs)."""


@dataclasses.dataclass
class Result:
    """``status`` PASS|FAIL|SKIP, ``reason`` (why, for FAIL/SKIP; may note a PASS), ``keys``
    (the line's key=value pairs, in order), ``detail`` (the report's full data), ``facts``
    (what later checks read)."""

    status: str
    reason: str = ""
    keys: dict = dataclasses.field(default_factory=dict)
    detail: dict = dataclasses.field(default_factory=dict)
    facts: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ctx:
    """``driver`` real|fake, ``work`` (scratch dir), ``out`` (the report dir), ``facts``,
    ``deadline`` (monotonic s)."""

    driver: str
    work: pathlib.Path
    out: pathlib.Path
    facts: dict
    deadline: float

    def left(self) -> float:
        """Seconds before the deadline (at least 1)."""
        return max(1.0, self.deadline - time.monotonic())

    def fact(self, check: str, key: str, default=None):
        return self.facts.get(check, {}).get(key, default)

    def env(self, **extra) -> dict:
        """A child's environment without the shim, on the chosen driver (fakecuda on
        ``LD_LIBRARY_PATH`` and ``CUINTERPOSE_DRIVER=fake`` when fake)."""
        from cuinterpose.agent import paths

        env = paths.real_driver_env()
        if self.driver == "fake":
            env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
            env["CUINTERPOSE_DRIVER"] = "fake"
        env["PYTHONUNBUFFERED"] = "1"
        return env | extra


def say(msg: str) -> None:
    """One progress line in the check's log (stdout), with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, ctx: Ctx, *, env=None, timeout_s=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` (argv) to completion within ``timeout_s`` (default: what is left), output
    captured and copied to the log; raises ``subprocess.TimeoutExpired`` past the deadline."""
    timeout = min(timeout_s or ctx.left(), ctx.left())
    say(f"$ {' '.join(map(str, cmd))}")
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or ctx.env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(res.stdout[-20000:])
    sys.stdout.write(res.stderr[-20000:])
    say(f"exit {res.returncode}")
    return res


def last_json(text: str):
    for ln in reversed(text.strip().splitlines()):
        if ln.startswith("{"):
            return json.loads(ln)
    raise ValueError(f"no JSON object in the output: {text.strip()[-300:]!r}")


def tail_reason(res: subprocess.CompletedProcess) -> str:
    lines = (res.stderr or res.stdout or "").strip().splitlines() or ["no output"]
    return f"exit {res.returncode}: {lines[-1][:200]}"


def selftest_hang(ctx: Ctx) -> Result:
    """Never returns: starts ``sleep`` in its own session, as a workload, says its pid, and
    blocks; its ``finally`` kills it when the deadline's SIGTERM comes (gpu_check.SELFTEST)."""
    p = None
    try:
        p = subprocess.Popen(["sleep", "600"], start_new_session=True)
        say(f"selftest: sleeper pid {p.pid}")
        while True:
            time.sleep(0.05)
    finally:
        if p is not None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---- 1. the driver and the machine ---------------------------------------------------------
def driver(ctx: Ctx) -> Result:
    res = run([sys.executable, PROBE, "probe"], ctx, timeout_s=45)
    if res.returncode != 0:
        return Result("FAIL", f"probe {tail_reason(res)}")
    info = last_json(res.stdout)
    try:  # the driver's own report of itself, where the tool is installed
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,uuid,pci.bus_id,memory.total,compute_mode",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=15,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        smi = f"nvidia-smi: {e}"
    info["nvidia_smi"] = smi
    a, ex = info["attributes"], info["exports"]
    ckpt = all(ex.get(f) for f in CHECKPOINT_API)
    custom = bool(ex.get("cuCheckpointOperationComplete")) and (
        info["driver_version"] >= CUSTOM_STORAGE_VERSION
    )
    g = info["granularity"]
    keys = {
        "version": info["driver_version"],
        "gpu": info["name"],
        "uuid": info["uuid"],
        "cc": info["compute_capability"],
        "mem_gib": round(info["total_mem_bytes"] / 2**30, 1),
        "vmm": a.get("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
        "posix_fd": a.get("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
        "fabric": a.get("HANDLE_TYPE_FABRIC_SUPPORTED"),
        "multicast": a.get("MULTICAST_SUPPORTED"),
        "memops64": a.get("CAN_USE_64_BIT_STREAM_MEM_OPS"),
        "host_register": a.get("HOST_REGISTER_SUPPORTED"),
        "host_numa_vmm": a.get("HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
        "gran_min": g.get("minimum"),
        "gran_rec": g.get("recommended"),
        "checkpoint_api": int(ckpt),
        "self_state": info["checkpoint_state_self"].get(
            "state", info["checkpoint_state_self"]["result"]
        ),
        "custom_storage": int(custom),
    }
    facts = {
        "checkpoint_api": ckpt,
        "custom_storage": custom,
        "libcuda": info["library"],
        "granularity": g.get("minimum"),
        "driver_version": info["driver_version"],
        "multicast": a.get("MULTICAST_SUPPORTED") == 1,
    }
    missing = [
        label
        for label, attr in (
            ("VMM", "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
            ("POSIX FD handles", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
        )
        if a.get(attr) != 1
    ]
    if missing:
        return Result("FAIL", f"the device lacks {', '.join(missing)}", keys, info, facts)
    return Result("PASS", "", keys, info, facts)


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: differences fakecuda keeps on purpose: experiment -> why (reported, not counted)
ACCEPTED = {
    "export_fd.kind": "the driver exports /dev/nvidiactl (a character device); fakecuda's FD is "
    "the memfd that holds the bytes, which is how its processes share them",
}


def driver_semantics(ctx: Ctx) -> Result:
    """gpu_check_probe.py ``semantics`` on the chosen driver and on fakecuda, compared."""
    from cuinterpose.agent import paths

    got = {}
    for label, env in (
        ("driver", ctx.env()),
        ("fakecuda", ctx.env(LD_LIBRARY_PATH=str(paths.fakecuda_dir()))),
    ):
        res = run([sys.executable, PROBE, "semantics"], ctx, env=env, timeout_s=45)
        if res.returncode != 0:
            return Result("FAIL", f"semantics on {label}: {tail_reason(res)}")
        got[label] = flat(last_json(res.stdout))
    cmp = compare(got["driver"], got["fakecuda"])
    diff = cmp["differ"]
    keys = {
        "experiments": len(cmp["compared"]),
        "differ": len(diff),
        "accepted": len(cmp["accepted"]),
    }
    reason = "; ".join(
        f"{k}: driver {v['driver']} fakecuda {v['fakecuda']}" for k, v in diff.items()
    )
    return Result("FAIL" if diff else "PASS", reason[:600], keys, {**got, **cmp})


def compare(real: dict, fake: dict) -> dict:
    """Two flat ``semantics`` results compared: ``compared`` (the keys both have, ``info_``
    keys left out), ``differ`` and ``accepted`` (key -> {"driver", "fakecuda"}; accepted:
    :data:`ACCEPTED`, with its "why"), ``only_driver`` / ``only_fakecuda`` (keys one side
    lacks: listed, not compared)."""
    compared = [
        k for k in sorted(set(real) & set(fake)) if not k.split(".")[-1].startswith("info_")
    ]
    every = {k: {"driver": real[k], "fakecuda": fake[k]} for k in compared if real[k] != fake[k]}
    return {
        "compared": compared,
        "differ": {k: v for k, v in every.items() if k not in ACCEPTED},
        "accepted": {k: {**v, "why": ACCEPTED[k]} for k, v in every.items() if k in ACCEPTED},
        "only_driver": sorted(set(real) - set(fake)),
        "only_fakecuda": sorted(set(fake) - set(real)),
    }


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text().strip()
    except OSError:
        return ""


def kernel(ctx: Ctx) -> Result:
    u = os.uname()
    proc_version = _read("/proc/version")
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        dmesg = ""
    gvisor = "gvisor" in dmesg.lower() or u.release == "4.4.0"
    dmi = " ".join(
        filter(
            None, (_read("/sys/class/dmi/id/sys_vendor"), _read("/sys/class/dmi/id/product_name"))
        )
    )
    cpuinfo = _read("/proc/cpuinfo")
    flags = (
        set(re.search(r"^flags\s*:(.*)$", cpuinfo, re.M).group(1).split())
        if "flags" in cpuinfo
        else set()
    )
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+)", _read("/proc/meminfo"), re.M)
    low = (proc_version + " " + dmi + " " + u.release).lower()
    runtime = (
        "gVisor"
        if gvisor
        else "Firecracker"
        if ("firecracker" in low or "-fc-" in low)
        else ("VM" if "hypervisor" in flags else "bare metal")
    )
    keys = {
        "release": u.release,
        "runtime": runtime,
        "gvisor": int(gvisor),
        "cpus": os.cpu_count(),
        "mem_gib": round(int(mem.group(1)) / 2**20, 1) if mem else "?",
        "sha_ni": int("sha_ni" in flags),
        "python": sys.version.split()[0],
    }
    detail = {
        "uname": list(u),
        "proc_version": proc_version,
        "dmi": dmi,
        "cpu_model": model.group(1) if model else "",
        "dmesg_head": dmesg[:2000],
    }
    reason = "gVisor: CRIU cannot run here" if gvisor else ""
    return Result("PASS", reason, keys, detail, {"gvisor": gvisor})


def criu(ctx: Ctx) -> Result:
    from cuinterpose.agent.mech import criu_binary

    ok, out = criu_binary.check()
    keys = {}
    if ok:
        keys = {"version": criu_binary.version(), "binary": criu_binary.criu_command()[-1]}
    last = (out.strip().splitlines() or ["no output"])[-1][:200]
    return Result(
        "PASS" if ok else "FAIL",
        "" if ok else f"criu check: {last}",
        keys,
        {"check_output": out[-4000:]},
        {"ok": ok},
    )


def doctor(ctx: Ctx) -> Result:
    res = run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "doctor", "--json", "--driver", ctx.driver],
        ctx,
        timeout_s=50,
    )
    checks = last_json_block(res.stdout).get("checks", [])
    if not checks:
        return Result("FAIL", f"doctor printed no checks: {tail_reason(res)}")
    bad = [c["name"] for c in checks if not c.get("ok")]
    keys = {"ok": sum(1 for c in checks if c.get("ok")), "of": len(checks)}
    reason = "; ".join(f"{c['name']}: {c['detail'][:120]}" for c in checks if not c.get("ok"))
    return Result("FAIL" if bad or not checks else "PASS", reason, keys, {"checks": checks})


def last_json_block(text: str) -> dict:
    """The JSON document printed by ``--json`` (pretty-printed, possibly after log lines)."""
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


# ---- 2. the GPU tests and the conformance suite ----------------------------------------------
def pytest_check(
    ctx: Ctx,
    tests: str,
    env: dict,
    xml_name: str,
    *,
    extra: tuple = (),
    test_timeout_s: float = GPU_TEST_TIMEOUT_S,
) -> Result:
    """Run the pytest suite ``tests`` (and ``extra`` arguments) in ``env``, each test within
    ``test_timeout_s`` (junit XML in WORK/``xml_name``); PASS when nothing failed and something
    passed, SKIP when everything skipped (with the first reason)."""
    xml = ctx.work / xml_name
    xml.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        tests,
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        "--timeout",
        str(test_timeout_s),
        f"--junitxml={xml}",
        *extra,
    ]
    say(f"$ {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait(timeout=max(1.0, ctx.left() - PYTEST_GRACE_S))
    except subprocess.TimeoutExpired:  # the check's time is nearly spent: pytest writes its
        proc.send_signal(signal.SIGINT)  # report on an interrupt, with what ran so far
        try:
            rc = proc.wait(timeout=PYTEST_GRACE_S / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        say(f"pytest interrupted past the check's time ({rc})")
    say(f"pytest exit {rc}")
    if not xml.exists():
        return Result("FAIL", f"pytest exited {rc} without a report")
    tests_run = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = el.get("message") or el.text or ""
                msg = text.strip().splitlines()[0][:300] if text.strip() else ""
                break
        tests_run.append(
            {
                "test": f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}",
                "outcome": outcome,
                "seconds": float(tc.get("time", 0)),
                "message": msg,
            }
        )
    count = {
        k: sum(1 for t in tests_run if t["outcome"] == k)
        for k in ("passed", "failed", "error", "skipped")
    }
    bad = [t for t in tests_run if t["outcome"] in ("failed", "error")]
    skipped = [t for t in tests_run if t["outcome"] == "skipped"]
    if bad:
        status, reason = "FAIL", "; ".join(f"{t['test']}: {t['message'][:150]}" for t in bad)
    elif not count["passed"]:
        status, reason = (
            "SKIP",
            f"all {len(tests_run)} skipped: {skipped[0]['message'] if skipped else ''}",
        )
    else:
        status = "PASS"
        reason = "; ".join(sorted({f"skipped {t['test']}: {t['message'][:100]}" for t in skipped}))
    return Result(status, reason, count, {"tests": tests_run})


def gpu_tests(ctx: Ctx) -> Result:
    from cuinterpose.agent import paths

    ignore = tuple(f"--ignore={t}" for t in STACK_TESTS)
    return pytest_check(ctx, "tests/gpu", paths.real_driver_env(), "gpu-tests.xml", extra=ignore)


#: the GPU tests of real software (PyTorch, CuPy) that ``real-stacks`` runs, not ``gpu-tests``
STACK_TESTS = ("tests/gpu/test_gpu_torch.py", "tests/gpu/test_gpu_cupy.py")
TORCH_TEST_TIMEOUT_S = 240  # one test: a decode run straight and one cut (two torch start-ups)


def real_stacks(ctx: Ctx) -> Result:
    """Real PyTorch and CuPy under the shim (issue 29): :data:`STACK_TESTS` on the real driver,
    or, rehearsed with ``--driver fake``, the decode flow on a CPU build of torch (tests/torchmp).
    Keys: the tests' counts and each report row the flows wrote (docs/torchmp.md): the decode's
    ``cold_start_s``, ``restore_to_next_token_s`` and their ratio, ``snapshot_bytes``; the
    detail keeps every row whole."""
    from cuinterpose.agent import paths

    rows_dir = ctx.work / "torchmp-rows"
    shutil.rmtree(rows_dir, ignore_errors=True)
    env = dict(paths.real_driver_env(), CUI_TORCHMP_REPORT_DIR=str(rows_dir))
    # rehearsed: the decode flow only (the row the report is judged by; tests/torchmp has all)
    if ctx.driver == "real":
        tests, extra = STACK_TESTS[0], STACK_TESTS[1:]
    else:
        tests, extra = "tests/torchmp", ("-k", "decode")
    res = pytest_check(
        ctx,
        tests,
        env,
        "real-stacks.xml",
        extra=("-s", *extra),
        test_timeout_s=TORCH_TEST_TIMEOUT_S,
    )
    rows = {f.stem: json.loads(f.read_text()) for f in sorted(rows_dir.glob("*.json"))}
    res.detail["rows"] = rows
    for name, row in rows.items():
        if "cold_start_s" in row:
            res.keys[f"{name}.cold_start_s"] = row["cold_start_s"]
            res.keys[f"{name}.restore_s"] = row["restore_to_next_token_s"]
            res.keys[f"{name}.cold_over_restore"] = round(
                row["cold_start_s"] / max(row["restore_to_next_token_s"], 1e-3), 2
            )
            res.keys[f"{name}.snapshot_bytes"] = row["snapshot_bytes"]
        elif "equal" in row:  # the CuPy IPC experiment: the bytes read back equal
            res.keys[f"{name}.equal"] = row["equal"]
        elif "stage" in row:  # the collective experiment: where its cut stopped ("done": none)
            res.keys[f"{name}.stage"] = row["stage"]
        elif "steps" in row:  # the native experiment: the first refused step of each rank
            for role, steps in row["steps"].items():
                bad = [f"{k}:{v.split(':')[0]}" for k, v in steps.items() if v != "ok"]
                res.keys[f"{name}.{role}"] = bad[0] if bad else "all-ok"
    return res


def conformance(ctx: Ctx) -> Result:
    """tests/conformance (NVIDIA's documented checkpoint behaviour, targets plain and under the
    shim) on the chosen driver: ``CONFORMANCE_DRIVER=real`` uses the machine's libcuda.so.1 and
    the ``cuda-checkpoint`` on $PATH."""
    from cuinterpose.agent import paths

    env = dict(paths.real_driver_env(), CONFORMANCE_DRIVER=ctx.driver)
    return pytest_check(ctx, "tests/conformance", env, "conformance.xml")


# ---- 3. the benches ------------------------------------------------------------------------
def bench_env(ctx: Ctx) -> dict:
    """The bench's environment: on the real driver, ``LIBRARY_PATH`` names the directory of
    the ``libcuda.so.1`` the driver check found, so ``cc -l:libcuda.so.1`` links against it."""
    lib = ctx.fact("driver", "libcuda", "")
    if ctx.driver == "real" and lib:
        extra = os.path.dirname(lib)
        return ctx.env(LIBRARY_PATH=":".join(filter(None, (extra, os.environ.get("LIBRARY_PATH")))))
    return ctx.env()


def bench_intercept(ctx: Ctx) -> Result:
    res = run(
        [
            sys.executable,
            "bench/intercept.py",
            "--driver",
            ctx.driver,
            "--n",
            "10,1000",
            "--calls",
            "4000",
            "--alloc-sizes",
            "4096,33554432",
            "--json",
        ],
        ctx,
        env=bench_env(ctx),
    )
    if res.returncode != 0:
        return Result("FAIL", tail_reason(res))
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    keys = {}
    for r in rows:
        if r.get("n") == 1000 and r["op"] in ("map", "unmap"):
            keys[f"{r['op']}1000_ns"] = r["base_ns"]
            keys[f"{r['op']}1000_ratio"] = round(r["shim_tracked_ratio"], 3)
        if "bytes" in r and r["op"] == "alloc":
            keys[f"alloc{r['bytes']}_adapter_ratio"] = round(r["adapter_ratio"], 3)
            keys[f"alloc{r['bytes']}_adapter_over_vmm"] = round(r["adapter_over_vmm"], 3)
    return Result("PASS", "", keys, {"rows": rows})


TOTAL_ROW = re.compile(r"^\s*(\d+)\s+(capture|restore)\s+\(total\)\s+([\d.]+)")
COPY_ROW = re.compile(
    r"^\s*(\d+)\s+\w+\s+(SAVE|LOAD)_ALLOCATIONS(?:\s+[\d.]+){5}\s+([\d.]+)\s+([\d.]+)"
)


def bench_phases(ctx: Ctx) -> Result:
    # one allocation per granule: 64 KiB on fakecuda, the driver's minimum (2 MiB on an H200)
    size = ctx.fact("driver", "granularity") if ctx.driver == "real" else 64 << 10
    if not size:
        raise Skip("no allocation granularity: the driver check did not pass")
    res = run(
        [sys.executable, "bench/phases.py", "--driver", ctx.driver, "--k", "10,1000", "--json"]
        + ["--size", str(size)],
        ctx,
        env=bench_env(ctx),
    )
    if res.returncode != 0:
        return Result("FAIL", tail_reason(res))
    keys = {}
    # issue 26: restore over capture, the rows' share of each total, LOAD over SAVE per allocation
    for s in (last_json(res.stdout) or {}).get("summary", []):
        if s["k"] == 1000:
            for k in ("restore_over_capture", "capture_rows", "restore_rows", "load_over_save"):
                keys[f"{k}_k1000"] = s[k]
    for ln in res.stdout.splitlines():
        m = TOTAL_ROW.match(ln)
        if m:
            keys[f"{m.group(2)}_k{m.group(1)}_ms"] = float(m.group(3))
        m = COPY_ROW.match(ln)
        if m:
            keys[f"{m.group(2).lower()}_k{m.group(1)}_gbps"] = float(m.group(3))
    if not keys:
        return Result(
            "FAIL", "no (total) rows in bench/phases.py's output", {}, {"table": res.stdout}
        )
    return Result("PASS", "", keys, {"table": res.stdout})
