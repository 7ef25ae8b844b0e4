"""The harness of the tmsh tests: one tmsh run (``Tmsh``, carw's harness with tmsh's options:
tests/carw/carw_kit.py) and the checks of a finished run (``check_finished``)."""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "carw"))
from carw_kit import Carw  # noqa: E402


class Tmsh(Carw):
    """``python -m cuinterpose.workloads.tmsh`` under the shim (``shim=True``) on fakecuda, its
    JSON lines in ``run_dir/tmsh.log`` (appended)."""

    module = "cuinterpose.workloads.tmsh"

    def __init__(
        self,
        run_dir,
        *,
        procs: int = 2,
        variant: str = "ipc",
        steps: int = 40,
        hold_at: int = 0,
        consumer_hold_at: int = 0,
        max_events: int = 1000,
        shim: bool = True,
        env: dict | None = None,
        driver: str = "fake",
    ):
        super().__init__(run_dir, ranks=procs, steps=steps, shim=shim, env=env, driver=driver)
        self.log = self.run_dir / "tmsh.log"
        self.err = self.run_dir / "tmsh.err"
        self.procs, self.variant = procs, variant
        self.args = [
            *("--procs", str(procs), "--variant", variant, "--steps", str(steps)),
            *("--hold-at", str(hold_at), "--consumer-hold-at", str(consumer_hold_at)),
            *("--max-events", str(max_events), "--step-delay-ms", "0", "--consumer-delay-ms", "0"),
        ]

    def wait_hold(self) -> None:
        """Until the producer and every consumer hold (a checkpoint then cuts at that point)."""
        self.wait_for(
            lambda ev: len({e["pid"] for e in ev if e.get("event") == "hold"}) == self.procs,
            "every hold",
        )

    def roles(self) -> dict[str, int]:
        return {r["role"]: r["pid"] for r in self.of("setup")[0]["ranks"]}

    def kill(self) -> None:
        """Kill the session, then remove what a killed tree leaves in /dev/shm: its queue's
        semaphores and the producer's counter files (a run that ends does it itself)."""
        super().kill()
        setup = self.of("setup")
        if not setup:
            return
        names = [f"sem.{n.lstrip('/')}" for n in setup[0].get("semaphores", [])]
        prod = self.roles().get("producer")
        names += [n for n in os.listdir("/dev/shm") if prod and n.startswith(f"tmsh_{prod}_")]
        for n in names:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except FileNotFoundError:
                pass


def check_finished(run: Tmsh, *, restores: int) -> dict:
    """Every storage received exactly once with its payload exact, no storage reused while
    referenced (a reused one would hold another sequence number), every VA identical across
    each quiesce, ``restores`` restored resumes; returns the summary."""
    (s,) = run.of("summary")
    assert s["problems"] == [] and s["ok"] is True, s
    assert (s["received_once"], s["failed_payloads"], s["restores_seen"]) == (True, 0, restores)
    assert s["rank_exit"] == {r: 0 for r in run.roles()}
    assert all(q["vas_identical"] for q in s["quiesces"])
    assert s["producer"]["sent"] == run.steps and s["producer"]["live_events_at_end"] == 0
    return s
