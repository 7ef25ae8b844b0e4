"""scripts/gpu-check.sh's checks, rehearsed on fakecuda, as they would run on a GPU machine.

The run itself (``gpu_check.py --driver fake``, every check) must report PASS with the values
each check promises: the driver probe and the semantics experiments agree (fakecuda against
itself), the carriers verify byte for byte, afdwin 2A2F keeps its VAs and loses nothing across
the cut, with and without the native checkpoint steps, and the agent's ``--leave-running``
checkpoint succeeds. Also: a check past its deadline is a FAIL line and leaves no workload
running; the deps step installs only what the interpreter lacks; CRIU travels as an archive.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
LINE = re.compile(
    r"^gpu-check: (?P<name>[a-z-]+) (?P<status>PASS|FAIL|SKIP)( \(.*\))?( \S+=\S+)* t=[\d.]+s$"
)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory, criu_ok):
    work = tmp_path_factory.mktemp("gpu-check")
    out = work / "out"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "gpu_check.py"),
            "--driver",
            "fake",
            "--out",
            str(out),
            "--work",
            str(work),
            "--budget-s",
            "900",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert (out / "gpu-check.json").exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    return res, report, out


def by_name(report) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_every_check_runs_in_order_with_one_line_each(fake_run):
    res, report, out = fake_run
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "driver",
        "driver-semantics",
        "kernel",
        "criu",
        "doctor",
        "gpu-tests",
        "real-stacks",
        "conformance",
        "bench-intercept",
        "bench-phases",
        "carrier-copy",
        "afdwin-live",
        "native-cycle",
        "agent-leave-running",
        "bench-datapath",
    ]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("gpu-check: ")]
    assert len(lines) == 2 * len(names)  # as each check ends, then the summary
    assert all(LINE.match(ln) for ln in lines), [ln for ln in lines if not LINE.match(ln)]
    assert report["done"] is True and report["driver"] == "fake"
    # no GPU here: the GPU tests skip, saying why; everything else passes
    c = by_name(report)
    assert c["gpu-tests"]["status"] == "SKIP" and "skipped" in c["gpu-tests"]["reason"]
    assert {n: c[n]["status"] for n in names if n != "gpu-tests"} == {
        n: "PASS" for n in names if n != "gpu-tests"
    }, {n: c[n].get("reason") for n in names}
    assert res.returncode == 0
    assert "===== afdwin-live PASS =====" in (out / "gpu-check.log").read_text()


def test_real_stacks_rehearsed_on_cpu_torch_reports_cold_start_against_restore(fake_run):
    """``real-stacks`` with --driver fake: the decode flow on CPU torch under the shim, cut by the
    agent with CRIU; its row becomes the check's keys (seconds, bytes, the ratio of the two)."""
    _, report, _ = fake_run
    c = by_name(report)["real-stacks"]
    assert (c["status"], c["keys"]["passed"], c["keys"]["failed"]) == ("PASS", 1, 0), c
    row = c["detail"]["rows"]["cpu-decode"]
    k = c["keys"]
    assert k["cpu-decode.cold_start_s"] == row["cold_start_s"] > 0
    assert k["cpu-decode.restore_s"] == row["restore_to_next_token_s"] > 0
    assert k["cpu-decode.cold_over_restore"] == round(
        row["cold_start_s"] / row["restore_to_next_token_s"], 2
    )
    assert k["cpu-decode.snapshot_bytes"] == row["snapshot_bytes"] > 0
    assert set(row["cold_parts_s"]) == {
        "spawn",
        "import",
        "context",
        "build",
        "warm_up",
        "first_token",
    }


def test_driver_facts_and_semantics(fake_run):
    _, report, _ = fake_run
    c = by_name(report)
    k = c["driver"]["keys"]
    assert (k["vmm"], k["posix_fd"], k["checkpoint_api"], k["gran_min"]) == (1, 1, 1, 2 << 20)
    s = c["driver-semantics"]
    assert s["keys"]["differ"] == 0 and s["keys"]["experiments"] >= 30
    d = s["detail"]["fakecuda"]
    # the answers R580 gave on an H200 (docs/gpu-validation.md), now fakecuda's
    assert d["import_props_other_process"] == ["CUDA_SUCCESS", "CUDA_SUCCESS", 1, 1, 0, 0]
    assert d["export_of_import"] == "CUDA_ERROR_INVALID_VALUE"
    assert d["map_aligned_offset"] == d["map_unaligned_offset"] == "CUDA_ERROR_NOT_SUPPORTED"
    assert d["import_bad_fd"] == d["import_memfd"] == "CUDA_ERROR_UNKNOWN"
    assert d["memcpy_dtoh_unmapped"] == d["memset_unmapped"] == "CUDA_ERROR_INVALID_VALUE"
    assert d["state_non_cuda_pid"] == d["lock_non_cuda_pid"] == "CUDA_ERROR_NOT_INITIALIZED"
    assert d["state_no_such_pid"] == "CUDA_ERROR_OPERATING_SYSTEM"


def test_semantics_comparison_lists_differences_accepted_and_one_sided_keys():
    sys.path.insert(0, str(SCRIPTS))
    import gpu_check_steps as steps

    real = {"a": "X", "b": "Y", "export_fd.kind": "chr", "export_fd.info_ino": 1, "m_unsupp": "N"}
    fake = {"a": "X", "b": "Z", "export_fd.kind": "reg", "export_fd.info_ino": 2, "m_supp": "S"}
    cmp = steps.compare(real, fake)
    assert cmp["compared"] == ["a", "b", "export_fd.kind"]
    assert cmp["differ"] == {"b": {"driver": "Y", "fakecuda": "Z"}}
    assert list(cmp["accepted"]) == ["export_fd.kind"] and cmp["accepted"]["export_fd.kind"]["why"]
    assert (cmp["only_driver"], cmp["only_fakecuda"]) == (["m_unsupp"], ["m_supp"])


def test_carriers_verify_and_count_every_byte(fake_run):
    _, report, _ = fake_run
    rows = by_name(report)["carrier-copy"]["detail"]["rows"]
    assert [r["bytes"] for r in rows] == [64 << 20, 256 << 20]
    for r in rows:
        assert r["verified"] is True and r["bytes_compared"] == 2 * r["bytes"]
        assert r["save_bytes"] == r["load_bytes"] == r["bytes"]
        # both staging rings page-locked: the agent's 64 MiB default, none left pageable
        assert (r["save_staging_pinned_bytes"], r["load_staging_pinned_bytes"]) == (64 << 20,) * 2
        assert (r["save_pageable"], r["load_pageable"]) == ({}, {})


@pytest.mark.parametrize("name", ["afdwin-live", "native-cycle"])
def test_afdwin_cut_keeps_vas_and_messages(fake_run, name):
    _, report, _ = fake_run
    c = by_name(report)[name]
    k = c["keys"]
    assert (k["ranks"], k["vas_equal"], k["lost"], k["duplicated"], k["torn"]) == (4, 1, 0, 0, 0)
    assert k["messages"] == 120 * 8  # 120 steps, 2 attention x 2 FFN ranks, both directions
    assert c["detail"]["before"] == c["detail"]["after"] and k["records"] > 0
    if name == "native-cycle":
        assert c["detail"]["states"] == {
            "lock": ["LOCKED"],
            "checkpoint": ["CHECKPOINTED"],
            "restore": ["LOCKED"],
            "unlock": ["RUNNING"],
        }


def test_datapath_bench_verifies_dense_and_sparse(fake_run):
    _, report, _ = fake_run
    rows = by_name(report)["bench-datapath"]["detail"]["rows"]
    assert [(r["bytes"], r["zero_fraction"]) for r in rows] == [(64 << 20, 0.0), (64 << 20, 0.9)]
    assert all(r["verified"] and r["bytes_compared"] == 2 * r["allocated_bytes"] for r in rows)
    assert "64m_z90_ckpt_over_dense" in by_name(report)["bench-datapath"]["keys"]


def test_agent_leave_running(fake_run):
    _, report, _ = fake_run
    k = by_name(report)["agent-leave-running"]["keys"]
    assert (k["agent_exit"], k["ok"], k["messages"], k["lost"]) == (0, 1, 960, 0)
    # issue 23: the rebuilt processes kept their signal dispositions, threads and fds
    assert (k["signals_kept"], k["threads_kept"], k["fds_kept"]) == (1, 1, 1)


def gpu_check_module():
    sys.path.insert(0, str(SCRIPTS))
    import gpu_check

    return gpu_check


def child_args(tmp_path):
    for d in ("logs", "results", "out"):
        (tmp_path / d).mkdir(exist_ok=True)
    (tmp_path / "facts.json").write_text("{}")
    return argparse.Namespace(work=str(tmp_path), out=str(tmp_path / "out"), driver="fake")


def test_a_stopped_check_kills_what_it_started(tmp_path):
    g = gpu_check_module()
    args = child_args(tmp_path)
    proc, log = g.start_child(g.SELFTEST, args, 600, tmp_path / "facts.json")
    try:
        pid = None
        while pid is None and proc.poll() is None:  # the check says its workload's pid
            m = re.search(r"selftest: sleeper pid (\d+)", log.read_text())
            pid = int(m.group(1)) if m else time.sleep(0.02)
        assert pid is not None, log.read_text()
        assert pathlib.Path(f"/proc/{pid}").exists()
    finally:
        g.stop_child(proc)  # what a deadline does
    assert not pathlib.Path(f"/proc/{pid}").exists()
    assert "Interrupted: stopped by SIGTERM at the deadline" in log.read_text()
    res = json.loads((tmp_path / "results" / "selftest-hang.json").read_text())
    assert res["status"] == "FAIL" and "stopped by SIGTERM at the deadline" in res["reason"]


def test_a_check_past_its_deadline_is_a_fail_line(tmp_path):
    g = gpu_check_module()
    res = g.run_child(g.SELFTEST, child_args(tmp_path), 1.0, tmp_path / "facts.json")
    assert res["status"] == "FAIL" and res["reason"].startswith(
        "timed out after 1 s; last log line:"
    )
    assert LINE.match(g.line(res))


def wheel(directory: pathlib.Path, name: str, version: str) -> pathlib.Path:
    """A minimal pure-Python wheel of ``name`` ``version`` holding one module."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 1\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


def test_deps_installs_only_what_is_missing_or_different(tmp_path):
    import importlib.metadata

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    have = importlib.metadata.version("click")
    wheel(wheels, "click", have)  # same version: kept, not installed
    wheel(wheels, "gpu_check_probe_dist", "1.0")  # missing: installed
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "gpu_check_deps.py"),
            str(wheels),
            str(tmp_path / "site"),
            str(tmp_path / "deps.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "deps.json").read_text())
    assert out["detail"]["kept"] == {"click": have}
    assert out["detail"]["installed"] == {"gpu-check-probe-dist": [None, "1.0"]}
    assert (tmp_path / "site" / "gpu_check_probe_dist.py").is_file()
    assert not (tmp_path / "site" / "click").exists()
    assert res.stdout.startswith("gpu-check: deps PASS kept=1 installed=1 ")


def install_criu(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / "install-criu.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_criu_travels_as_an_archive(tmp_path, criu_ok):
    env = {k: v for k, v in os.environ.items() if k != "CUINTERPOSE_CRIU_CACHE"}
    packed = install_criu("--pack", str(tmp_path / "c.tgz"), env=env)
    if packed.returncode != 0 and "to pack" in packed.stderr:
        pytest.skip(f"no cached CRIU to pack here (the system's is used): {packed.stderr.strip()}")
    assert packed.returncode == 0, packed.stderr
    env["CUINTERPOSE_CRIU_CACHE"] = str(tmp_path / "cache")
    res = install_criu("--from-archive", str(tmp_path / "c.tgz"), env=env)
    assert res.returncode == 0, res.stderr
    wrapper = tmp_path / "cache" / "bin" / "criu"
    assert str(tmp_path / "cache" / "root") in wrapper.read_text()
    ver = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=60)
    assert re.search(r"Version: ([4-9])\.", ver.stdout), ver.stdout + ver.stderr
    bad = install_criu("--from-archive", str(tmp_path / "none.tgz"), env=env)
    assert bad.returncode == 1 and "--from-archive needs an existing FILE" in bad.stderr


def test_gpu_check_sh_runs_from_a_kit(tmp_path, criu_ok):
    """The whole of ``gpu-check.sh run`` on fakecuda: a kit with no wheels (this interpreter has
    every dependency), its CRIU archive, the CMake build into the private site, whose libraries
    the checks then use; the set-up entries and the check lines in the report."""
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CUINTERPOSE_CRIU_CACHE", "OUT")}
    packed = install_criu("--pack", str(kit / "criu-root.tgz"), env=env)
    if packed.returncode != 0:
        pytest.skip(f"no cached CRIU to pack here: {packed.stderr.strip()}")
    work, out = tmp_path / "work", tmp_path / "out"
    env |= {
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_KIT": str(kit),
        "GPU_CHECK_WORK": str(work),
    }
    sh = ["bash", str(SCRIPTS / "gpu-check.sh"), "run", "--driver", "fake"]
    res = subprocess.run(
        sh + ["--only", "driver,criu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert [(s["name"], s["status"]) for s in report["setup"]] == [
        ("deps", "PASS"),
        ("build", "PASS"),
        ("criu-install", "PASS"),
    ]
    assert report["setup"][0]["keys"] == {"kept": 0, "installed": 0, "from_kit": "none"}
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("driver", "PASS"),
        ("criu", "PASS"),
    ]
    site = work / "site" / "cuinterpose"
    assert by_name(report)["driver"]["detail"]["library"] == str(
        site / "lib" / "fakecuda" / "libcuda.so.1"
    )
    assert by_name(report)["criu"]["keys"]["binary"] == str(work / "criu" / "bin" / "criu")
    assert report["commit"] != "" and report["done"] is True
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("gpu-check: ")]
    assert all(LINE.match(ln) for ln in lines), lines
    assert len(lines) == 3 + 2 + 5  # set-up and checks as each ends, then the summary of all
    # bad usage: exit 2, the option named; a work dir holding anything else is not emptied
    bad = subprocess.run(sh + ["--out"], capture_output=True, text=True, env=env, timeout=60)
    assert (bad.returncode, bad.stderr.strip()) == (2, "gpu-check: error: --out needs a value")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    refused = subprocess.run(
        sh, capture_output=True, text=True, timeout=60, env=env | {"GPU_CHECK_WORK": str(other)}
    )
    assert refused.returncode == 2 and "holds files of something else" in refused.stderr
    assert (other / "keep.txt").read_text() == "mine"


def test_real_stacks_keys_name_each_rows_answer(tmp_path, monkeypatch):
    """What a real run's rows become on the check's line: the decode's seconds and their ratio,
    each CuPy run's comparison, where each NCCL cut stopped, each rank's first refused native
    step (every row whole in the detail)."""
    sys.path.insert(0, str(SCRIPTS))
    import gpu_check_steps as steps

    rows = {
        "gpu-decode": {"cold_start_s": 9.0, "restore_to_next_token_s": 1.5, "snapshot_bytes": 7},
        "gpu-cupy-ipc-shim": {"shim": True, "rc": 1, "equal": False},
        "gpu-nccl-one-rank-kept": {"ok": False, "stage": "checkpoint", "error": "census: ..."},
        "gpu-native-alone": {
            "steps": {
                "producer": {"lock": "ok", "checkpoint": "NativeError: CUDA_ERROR_X: y"},
                "consumer0": dict.fromkeys(("lock", "checkpoint", "restore", "unlock"), "ok"),
            },
        },  # fmt: skip
    }

    def fake_pytest(ctx, tests, env, xml_name, **kw):
        assert (tests, kw["extra"]) == (steps.STACK_TESTS[0], ("-s", *steps.STACK_TESTS[1:]))
        d = pathlib.Path(env["CUI_TORCHMP_REPORT_DIR"])
        d.mkdir(parents=True)
        for name, row in rows.items():
            (d / f"{name}.json").write_text(json.dumps(row))
        return steps.Result("PASS", "", {"passed": 6}, {})

    monkeypatch.setattr(steps, "pytest_check", fake_pytest)
    ctx = steps.Ctx("real", tmp_path, tmp_path, {}, time.monotonic() + 60)
    res = steps.real_stacks(ctx)
    assert res.keys == {
        "passed": 6,
        "gpu-cupy-ipc-shim.equal": False,
        "gpu-decode.cold_start_s": 9.0,
        "gpu-decode.restore_s": 1.5,
        "gpu-decode.cold_over_restore": 6.0,
        "gpu-decode.snapshot_bytes": 7,
        "gpu-native-alone.producer": "checkpoint:NativeError",
        "gpu-native-alone.consumer0": "all-ok",
        "gpu-nccl-one-rank-kept.stage": "checkpoint",
    }
    assert res.detail["rows"] == rows
