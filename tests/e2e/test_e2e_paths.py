"""One path canonicalization for every command (issue 23): ``checkpoint`` resolved
``p/a/../b/snap`` lexically (``p/b/snap``) while ``restore`` resolved it as the kernel does
(through the symlink ``p/a``), so a snapshot was not found by the string it was written to.
Now every command and the daemon take ``agent.paths.canonical`` (absolute, symlinks and
``..`` resolved as the kernel does): an afdwin job checkpointed into ``p/a/../b/snap`` (``p/a``
a symlink elsewhere) is listed, restored and deleted by that same string, and runs to an exact
end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.agent import paths
from cuinterpose.workloads.afdwin import demo

STEPS = 200


def agent(cwd, *args) -> tuple[int, dict]:
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )  # fmt: skip
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, {"raw": res.stdout + res.stderr}


def test_a_path_with_dotdot_through_a_symlink_names_one_snapshot_for_every_command(
    afdwin, tmp_path
):
    (tmp_path / "q" / "x").mkdir(parents=True)
    (tmp_path / "p").mkdir()
    os.symlink(tmp_path / "q" / "x", tmp_path / "p" / "a")
    given = "p/a/../b/snap"
    real = tmp_path / "q" / "b" / "snap"  # the kernel's: p/a is q/x, so p/a/.. is q
    assert paths.canonical(tmp_path / given) == str(real)
    a = afdwin(steps=STEPS, step_delay_ms=2, hold_at=(20,))
    a.wait_hold()
    rc, cp = agent(tmp_path, *a.checkpoint_args(given))
    assert rc == 0 and cp["images_dir"] == str(real), cp
    assert not (tmp_path / "p" / "b").exists()  # not the lexical p/b/snap
    rc, ls = agent(tmp_path, "snapshots", "p/a/../b")
    assert rc == 0 and [s["images_dir"] for s in ls["snapshots"]] == [str(real)], ls
    assert a.wait_dumped() == -9
    rc, rs = agent(tmp_path, "restore", "--images-dir", given, "--driver", "fake")
    assert rc == 0 and rs["snapshot_id"] == cp["snapshot_id"], rs
    assert a.wait_restored_exit(300) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []
    rc, dl = agent(tmp_path, "delete", given)
    assert rc == 0 and dl["deleted"] == str(real), dl
    assert not real.exists()
