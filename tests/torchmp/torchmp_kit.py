"""The harness of the torchmp tests (docs/torchmp.md): one run of real PyTorch jobs (``TorchMp``,
carw's harness with torchmp's options: tests/carw/carw_kit.py), where torch comes from
(``torch_env``), and the two flows both the CPU rehearsal (tests/torchmp) and the lent GPU
(tests/gpu/test_gpu_torch.py) run: a stream cut mid-way and a decode cut at a token, each
checkpointed by the agent, killed by the dump, restored and finished exact."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "carw"))
from carw_kit import Carw  # noqa: E402

from cuinterpose.workloads.afdwin import demo  # noqa: E402

#: a site-packages directory holding torch and transformers, for an interpreter without them
SITE_VAR = "CUI_TORCH_SITE"
#: where the flows write their report rows (JSON, one file per flow), when set
REPORT_VAR = "CUI_TORCHMP_REPORT_DIR"


def torch_env(device: str) -> dict:
    """The environment additions under which this interpreter's children import torch and
    transformers with ``device`` usable; skips (printing why) where they cannot."""
    env = {}
    if os.environ.get(SITE_VAR):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), os.environ[SITE_VAR]) if p
        )
    probe = "import torch, transformers; print(torch.__version__, torch.cuda.is_available())"
    res = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    if res.returncode != 0:
        why = (
            f"torch and transformers are not importable by {sys.executable} "
            f"({(res.stderr.strip().splitlines() or ['?'])[-1]}); set {SITE_VAR} to a "
            "site-packages directory holding them (docs/torchmp.md)"
        )
    elif device == "cuda" and res.stdout.split()[-1] != "True":
        why = f"torch {res.stdout.split()[0]} sees no CUDA device"
    else:
        return env
    print(f"torchmp tests skipped: {why}")
    pytest.skip(why)


class TorchMp(Carw):
    """``python -m cuinterpose.workloads.torchmp`` (``job``, ``device``; the other keywords are
    its options, e.g. ``hold_at=12``) under the shim (``shim=True``), its JSON lines in
    ``run_dir/torchmp.log``."""

    module = "cuinterpose.workloads.torchmp"
    #: a GPU check runs each test within 240 s (scripts/gpu_check_steps.py): a wait gives up
    #: (with the processes' stacks) well before that
    event_hang_s = 100.0

    def __init__(
        self, run_dir, *, job="stream", device="cuda", shim=True, driver="real", env=None, **opts
    ):
        super().__init__(run_dir, shim=shim, env=env, driver=driver)
        self.log = self.run_dir / "torchmp.log"
        self.err = self.run_dir / "torchmp.err"
        cuinit = opts.pop("cuinit", shim) and device == "cpu"  # a CPU rehearsal's participant
        opts.setdefault("peer_timeout_s", 90)  # a rank waiting for a dead peer gives up
        self.job, self.opts = job, opts
        self.args = ["--job", job, "--device", device, *(["--cuinit"] if cuinit else [])]
        for k, v in opts.items():  # a bool is a flag: given when True
            flag = f"--{k.replace('_', '-')}"
            self.args += [flag] if v is True else [] if v is False else [flag, str(v)]

    def holders(self) -> int:
        """How many ranks hold at the cut: the producer (or decoder), and each consumer when
        ``consumer_hold_at`` is set."""
        if self.job == "stream" and self.opts.get("consumer_hold_at"):
            return 1 + int(self.opts.get("consumers", 1))
        return 1

    def wait_hold(self) -> None:
        n = self.holders()
        self.wait_for(
            lambda ev: len({e["pid"] for e in ev if e.get("event") == "hold"}) == n, "every hold"
        )

    def rank_pids(self) -> list[int]:
        setup = self.of("setup")
        return sorted(r["pid"] for r in setup[0]["ranks"]) if setup else []

    def summary(self) -> dict:
        (s,) = self.of("summary")
        assert s["problems"] == [] and s["ok"] is True, s
        return s


def report(name: str, row: dict) -> None:
    """Print ``row`` and write it to ``$CUI_TORCHMP_REPORT_DIR/NAME.json`` when that is set."""
    print(f"torchmp {name}: {json.dumps(row)}")
    out = os.environ.get(REPORT_VAR)
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / f"{name}.json").write_text(json.dumps(row, indent=1))


def cut(run: TorchMp, snap: pathlib.Path) -> dict:
    """Checkpoint ``run`` (held) into ``snap`` with the agent, let the dump kill it, restore it
    and wait until it finished; returns {"checkpoint", "restore"} (the agent's JSON) and the
    seconds the restore command took (``restore_s``) and when it started (``restore_t``)."""
    run.wait_hold()
    rc, cp = run.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert run.wait_dumped() == -signal.SIGKILL
    t0 = time.time()
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", run.driver)
    restore_s = time.time() - t0
    assert rc == 0 and rs["ok"], rs
    assert run.finish() in (0, None), run.stderr_tail()
    return {"checkpoint": cp, "restore": rs, "restore_s": restore_s, "restore_t": t0}


def stream_cut(run_dir: pathlib.Path, *, device: str, driver: str, shim: bool, env: dict) -> dict:
    """A producer and a consumer, cut after 12 of 40 tensors (the consumer holding 2 of its 3
    received): every tensor received once, payloads exact, addresses unchanged, one restore."""
    run = TorchMp(
        run_dir / "run", job="stream", device=device, shim=shim, driver=driver, env=env,
        steps=40, hold_at=12, consumer_hold_at=3, consumers=1, elems=1 << 14,
    )  # fmt: skip
    try:
        run.start()
        c = cut(run, run_dir / "snap")
        shutil.rmtree(run_dir / "snap")
        s = run.summary()
        assert (s["sent"], s["received_once"], s["failed_payloads"], s["restores_seen"]) == (
            40,
            True,
            0,
            1,
        )
        assert [q["vas_identical"] for q in s["quiesces"]] == [True]
        assert s["rank_exit"] == {"producer": 0, "consumer0": 0}
        return {"restore_s": round(c["restore_s"], 3), "quiesces": len(s["quiesces"])}
    finally:
        run.kill()


DECODE = {"tokens": 300, "hold_at": 100}


def decode_cut(run_dir: pathlib.Path, *, device: str, driver: str, shim: bool, env: dict) -> dict:
    """A decode of 300 tokens run once straight (the reference, and the cold start) and once cut
    after token 100, killed and restored: the 300 tokens equal, the sink agreeing each time.
    Returns the cold-start-versus-restore row (seconds, bytes)."""
    ref = TorchMp(run_dir / "ref", job="decode", device=device, shim=shim, driver=driver, env=env,
                  tokens=DECODE["tokens"])  # fmt: skip
    try:
        ref.start()
        assert ref.finish() == 0, ref.stderr_tail()
        want = ref.summary()
        (cold,) = ref.of("cold")
        first = ref.of("token", i=1)[0]
    finally:
        ref.kill()
    assert want["sink_agrees"] and len(want["tokens"]) == DECODE["tokens"]
    run = TorchMp(run_dir / "cut", job="decode", device=device, shim=shim, driver=driver, env=env,
                  **DECODE)  # fmt: skip
    try:
        run.start()
        c = cut(run, run_dir / "snap")
        got = run.summary()
        after = run.of("token", i=DECODE["hold_at"] + 1)
    finally:
        run.kill()
    assert got["tokens"] == want["tokens"], (got["digest"], want["digest"])
    assert got["sink_agrees"] and got["restores_seen"] == 1
    assert [e["restored"] for e in after] == [True]
    snap_bytes = sum(f.stat().st_size for f in (run_dir / "snap").rglob("*") if f.is_file())
    shutil.rmtree(run_dir / "snap")  # GBs on a GPU: the next flow needs the disk
    return {
        "digest": want["digest"],
        "distinct_tokens": len(set(want["tokens"])),
        "cold_start_s": round(first["t"] - cold["launch_t"], 3),
        "cold_parts_s": {
            k: round(b - a, 3)
            for k, a, b in (
                ("spawn", cold["launch_t"], cold["proc_t"]),  # the launcher's start to the rank's
                ("import", cold["proc_t"], cold["import_t"]),
                ("context", cold["import_t"], cold["ctx_t"]),
                ("build", cold["ctx_t"], cold["build_t"]),
                ("warm_up", cold["build_t"], cold["warm_t"]),
                ("first_token", cold["warm_t"], first["t"]),
            )
        },
        "restore_to_next_token_s": round(after[0]["t"] - c["restore_t"], 3),
        "restore_command_s": round(c["restore_s"], 3),
        "snapshot_bytes": snap_bytes,
    }


def native_alone(run_dir: pathlib.Path, *, device: str, driver: str, env: dict) -> dict:
    """What native checkpoint alone does with what torch.multiprocessing leaves live (IPC
    memory, IPC events; no shim): a stream held after 12 tensors, parked by hand through the
    contract, then ``lock``, ``checkpoint``, ``restore``, ``unlock`` of each rank in place (no
    CRIU), each step's outcome recorded ("ok" or the driver's error), then resumed. Returns
    {"steps": {role: {step: outcome}}, "finished_exact": bool, "problems": [...]} (an
    experiment: recorded, the caller asserts only that every rank was tried)."""
    from cuinterpose.agent.mech import native
    from cuinterpose.coordinator import contract

    run = TorchMp(
        run_dir / "native", job="stream", device=device, shim=False, driver=driver, env=env,
        steps=40, hold_at=12, consumer_hold_at=3, consumers=1, cuinit=True,
    )  # fmt: skip
    native.load(driver)
    out: dict = {"steps": {}}
    try:
        run.start()
        run.wait_hold()
        contract.write_atomic(
            contract.quiesce_path(run.ctl, run.pid, "request"), {"id": "n1", "timeout_ms": 60000}
        )
        run.wait_for(lambda ev: any(e.get("event") == "quiesced" for e in ev), "quiesced")
        roles = {r["role"]: r["pid"] for r in run.of("setup")[0]["ranks"]}
        for role, pid in roles.items():
            done = out["steps"][role] = {}
            for step, fn in (
                ("lock", lambda p: native.lock(p, 10000)),
                ("checkpoint", native.checkpoint),
                ("restore", native.restore),
                ("unlock", native.unlock),
            ):
                try:
                    fn(pid)
                    done[step] = "ok"
                except Exception as e:  # the answer is the finding
                    done[step] = f"{type(e).__name__}: {e}"[:300]
                    if step == "lock":
                        break
        contract.write_atomic(
            contract.quiesce_path(run.ctl, run.pid, "resume"), {"id": "n1", "restored": False}
        )
        try:
            run.finish()
        except RuntimeError as e:  # a rank the native steps broke: the run's story is the answer
            out.update(finished_exact=False, problems=[str(e)[:1500]])
            return out
        s = run.of("summary")
        out["finished_exact"] = bool(s and s[0]["ok"])
        out["problems"] = s[0]["problems"] if s else ["no summary: " + run.stderr_tail()]
        return out
    finally:
        run.kill()


def collective_cut(
    run_dir: pathlib.Path, *, device: str, driver: str, shim: bool, env: dict, reinit: bool
) -> dict:
    """One rank of ``torch.distributed`` (NCCL on a GPU, gloo on the CPU) all-reducing 40
    steps, cut after step 12 by the agent, killed, restored, finished; with ``reinit`` the rank
    destroys its process group before it parks and makes a new one after (no TCP socket at the
    dump). An experiment on a GPU (issue 29: what NCCL does across a cut): returns {"ok",
    "stage" (the first that failed: start, checkpoint, restore, finish, or "done"), "error",
    "steps", "wrong", "groups", "restores_seen"} instead of raising."""
    run = TorchMp(run_dir / "coll", job="collective", device=device, shim=shim, driver=driver,
                  env=env, steps=40, hold_at=12, elems=1 << 14, reinit=reinit)  # fmt: skip
    row: dict = {"ok": False, "stage": "start", "error": ""}
    try:
        run.start()
        run.wait_hold()
        row["stage"] = "checkpoint"
        rc, cp = run.checkpoint(run_dir / "snap")
        if rc != 0:
            row["error"] = json.dumps(cp.get("error", cp))[:600]
            return row
        run.wait_dumped()
        row["stage"] = "restore"
        rc, rs = demo.run_agent(
            "restore", "--images-dir", str(run_dir / "snap"), "--driver", driver
        )
        shutil.rmtree(run_dir / "snap", ignore_errors=True)
        if rc != 0:
            row["error"] = json.dumps(rs.get("error", rs))[:600]
            return row
        row["stage"] = "finish"
        run.finish()
        s = run.of("summary")
        if not s or not s[0]["ok"]:
            row["error"] = (json.dumps(s[0]["problems"]) if s else run.stderr_tail())[:600]
            return row
        row.update(ok=True, stage="done", steps=s[0]["steps"], wrong=s[0]["wrong"],
                   groups=s[0]["groups"], restores_seen=s[0]["restores_seen"])  # fmt: skip
        return row
    except Exception as e:  # the experiment's answer, not the test's failure
        row["error"] = f"{type(e).__name__}: {e}"[:600]
        return row
    finally:
        run.kill()
