"""Case 003 (shared/cases/003-fork-after-cuinit), kind: a child forked after cuInit acts on
its parent's inherited shim state.

In a process whose pid is not the one that initialised the shim, every tracked call is
forwarded to the driver (fakecuda, like the real driver, answers CUDA_ERROR_NOT_INITIALIZED
there), no inherited record is used, no ticket naming the parent is minted, and stderr says
once that fork after cuInit is unsupported. The parent is not disturbed.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.conftest import apps, fake_log, shim_env, vmm_app  # noqa: E402, F401 (fixtures)

GRAN = 2 << 20
POSIX = 1
NOT_INITIALIZED = 3
WARNING = "fork after cuInit is unsupported"


def test_forked_child_forwards_every_tracked_call(apps, fake_log):  # noqa: F811
    a = apps()
    a.ok("init")
    h = int(a.ok(f"create {GRAN} {POSIX}")[0], 0)
    va = int(a.ok(f"reserve {GRAN}")[0], 0)
    a.ok(f"map {va:#x} {GRAN} 0 {h:#x}")
    child = int(a.ok("fork")[0])
    assert child != a.pid
    # the child: inherited records are not used, the driver answers
    assert a.err(f"retain {va:#x}") == NOT_INITIALIZED
    assert a.err(f"export {h:#x}") == NOT_INITIALIZED
    assert a.err(f"create {GRAN} {POSIX}") == NOT_INITIALIZED
    assert a.err(f"unmap {va:#x} {GRAN}") == NOT_INITIALIZED
    assert a.err(f"release {h:#x}") == NOT_INITIALIZED
    assert a.ok("quit") == []
    assert a.proc.stdout.readline() == "ok 0\n"  # the parent's answer to "fork": child exit 0
    assert a.ok("pid") == [str(a.pid)]
    # every call of the child reached the driver with the handle as given (no ticket minted)
    exports = fake_log.calls(pid=child, fn="cuMemExportToShareableHandle")
    assert [r for _, _, r in exports] == ["CUDA_ERROR_NOT_INITIALIZED"]
    assert [r for _, _, r in fake_log.calls(pid=child, fn="cuMemRetainAllocationHandle")] == [
        "CUDA_ERROR_NOT_INITIALIZED"
    ]
    err = a.stderr()
    assert err.count(WARNING) == 1, err
    assert f"cuinterpose[{child}]: cuMemRetainAllocationHandle: pid {child}" in err, err
    # the parent keeps its records and its endpoint
    fd = int(a.ok(f"export {h:#x}")[0])
    assert fd >= 0
    a.ok(f"unmap {va:#x} {GRAN}")
    a.ok(f"release {h:#x}")
