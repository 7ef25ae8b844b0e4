"""fakecuda's devices: FAKECUDA_DEVICES, CUDA_VISIBLE_DEVICES, and a native restore with gpuPairs
(docs/fakecuda.md "Devices"). Each process is tests/fakecuda/devices_driver.py on cuda.bindings."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
GIB = 1 << 30
NODE4 = "H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,H100 80GB:80G"
#: another node: four more H100s, ids 4-7
NODE_B = "H100 80GB:80G:4,H100 80GB:80G:5,H100 80GB:80G:6,H100 80GB:80G:7"


def uuid(i: int) -> str:
    """The UUID fakecuda gives physical device i (by default its id is its position)."""
    b = b"fakecudaGPU-uu" + bytes([i >> 8, i & 0xFF])
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class Proc:
    def __init__(self, env):
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "devices_driver.py")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.init = json.loads(self.p.stdout.readline())["init"]
        self.pid = self.p.pid

    def __call__(self, line: str):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=60)


@pytest.fixture
def proc(fake_env):
    procs = []

    def start(**env):
        e = dict(fake_env)
        e.pop("CUDA_VISIBLE_DEVICES", None)
        for k, v in env.items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        p = Proc(e)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.close()


def test_default_devices_unchanged(proc):
    p = proc()
    assert p("devices") == [
        {"ordinal": 0, "name": "fakecuda GPU", "uuid": uuid(0), "mem": 16 * GIB},
        {"ordinal": 1, "name": "fakecuda GPU", "uuid": uuid(1), "mem": 16 * GIB},
    ]


def test_configured_devices(proc):
    p = proc(FAKECUDA_DEVICES="H100 80GB:80G,L4:24G:7,A100:512M")
    assert p("devices") == [
        {"ordinal": 0, "name": "H100 80GB", "uuid": uuid(0), "mem": 80 * GIB},
        {"ordinal": 1, "name": "L4", "uuid": uuid(7), "mem": 24 * GIB},
        {"ordinal": 2, "name": "A100", "uuid": uuid(2), "mem": 512 << 20},
    ]


@pytest.mark.parametrize("spec", ["H100", "H100:", "H100:80X", ":80G", "H100:80G:70000"])
def test_malformed_devices_spec_is_no_device(proc, spec):
    assert proc(FAKECUDA_DEVICES=spec).init == "CUDA_ERROR_NO_DEVICE"


@pytest.mark.parametrize(
    "visible, phys",
    [
        ("2,3", [2, 3]),
        ("3,0", [3, 0]),
        (f"{uuid(1)},2", [1, 2]),
        ("1,7,2", [1]),  # an unknown ordinal hides it and every entry after it
        ("1,1,2", [1]),  # so does a repeat
        ("0,GPU-nonesuch,1", [0]),
        (" 2 , 1", [2, 1]),
    ],
)
def test_visible_devices(proc, visible, phys):
    p = proc(FAKECUDA_DEVICES=NODE4, CUDA_VISIBLE_DEVICES=visible)
    assert [d["uuid"] for d in p("devices")] == [uuid(i) for i in phys]


# uuid(3)[:-1] is a prefix of uuid(0) to uuid(15): ambiguous
@pytest.mark.parametrize("visible", ["", "9", "GPU-fakecuda", uuid(3)[:-1]])
def test_nothing_visible_is_no_device(proc, visible):
    assert proc(FAKECUDA_DEVICES=NODE4, CUDA_VISIBLE_DEVICES=visible).init == "CUDA_ERROR_NO_DEVICE"


def pairs_arg(pairs) -> str:
    return " ".join(f"{uuid(a)}={uuid(b)}" for a, b in pairs)


def checkpointed_on_01(proc, controller_node=NODE4, controller_visible="2,3"):
    """A target on physical {0,1} of a 4-GPU node with 1 MiB on each, natively checkpointed by
    a controller of ``controller_node`` that sees ``controller_visible`` of it."""
    t = proc(FAKECUDA_DEVICES=NODE4, CUDA_VISIBLE_DEVICES="0,1")
    va0 = t("alloc 0 1048576 171")["va"]
    va1 = t("alloc 1 1048576 205")["va"]
    ctl = proc(FAKECUDA_DEVICES=controller_node, CUDA_VISIBLE_DEVICES=controller_visible)
    assert ctl(f"lock {t.pid}") == {"result": "CUDA_SUCCESS"}
    assert ctl(f"checkpoint {t.pid}") == {"result": "CUDA_SUCCESS"}
    return t, ctl, va0, va1


def test_restore_with_gpu_pairs_moves_the_memory(proc, fake_env):
    """The full map (every GPU of the node, cuda.core Process.restore: "provide mappings for every
    GPU visible to the kernel-mode driver"): accepted although the controller's
    CUDA_VISIBLE_DEVICES hides GPUs 0 and 1 of the node."""
    t, ctl, va0, va1 = checkpointed_on_01(proc)
    assert ctl(f"restore {t.pid} {pairs_arg([(0, 2), (1, 3), (2, 0), (3, 1)])}") == {
        "result": "CUDA_SUCCESS"
    }
    assert ctl(f"unlock {t.pid}") == {"result": "CUDA_SUCCESS"}
    # the same ordinals now name the new GPUs; the bytes are where they were
    assert [d["uuid"] for d in t("devices")] == [uuid(2), uuid(3)]
    assert t(f"read {va0} 16") == {"hex": "ab" * 16}
    assert t(f"read {va1} 16") == {"hex": "cd" * 16}
    assert t("ctxdev") == {"dev": 1}
    log = pathlib.Path(fake_env["FAKECUDA_LOG"]).read_text()
    moved = [ln.split(" ", 2)[2] for ln in log.splitlines() if "restore moved" in ln]
    assert moved == [
        f"fakecuda: restore moved ordinal 0 from {uuid(0)} to {uuid(2)} (1048576 bytes)",
        f"fakecuda: restore moved ordinal 1 from {uuid(1)} to {uuid(3)} (1048576 bytes)",
    ]
    # a second migration maps from the node as it is now, back home
    assert ctl(f"lock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert ctl(f"checkpoint {t.pid}")["result"] == "CUDA_SUCCESS"
    assert ctl(f"restore {t.pid} {pairs_arg([(2, 0), (3, 1), (0, 2), (1, 3)])}") == {
        "result": "CUDA_SUCCESS"
    }
    assert ctl(f"unlock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert [d["uuid"] for d in t("devices")] == [uuid(0), uuid(1)]


def test_restore_onto_a_missing_gpu_without_pairs_fails(proc):
    """Restored on another node (GPUs 4-7): without pairs the GPUs it used are missing."""
    t, ctl, va0, _ = checkpointed_on_01(proc, controller_node=NODE_B, controller_visible="0,1")
    assert ctl(f"restore {t.pid}") == {"result": "CUDA_ERROR_INVALID_DEVICE"}
    # refused before anything changed: still checkpointed, a restore with pairs then works
    assert ctl(f"state {t.pid}") == {"result": "CUDA_SUCCESS", "state": 2}
    assert ctl(f"restore {t.pid} {pairs_arg([(0, 7), (1, 6), (2, 5), (3, 4)])}") == {
        "result": "CUDA_SUCCESS"
    }
    assert ctl(f"unlock {t.pid}") == {"result": "CUDA_SUCCESS"}
    assert [d["uuid"] for d in t("devices")] == [uuid(7), uuid(6)]
    assert t(f"read {va0} 4") == {"hex": "ab" * 4}


@pytest.mark.parametrize(
    "pairs",
    [
        # partial: GPUs 2 and 3 of the node left out (ordinal 0 and a hidden GPU would be one)
        [(0, 2), (1, 3)],
        [(0, 2), (1, 3), (2, 0)],  # GPU 3 left out
        [(0, 2), (1, 2), (2, 0), (3, 1)],  # a new GPU twice
        [(0, 2), (1, 3), (2, 0), (9, 1)],  # 9 is no GPU of the target's node
        [(0, 9), (1, 3), (2, 0), (3, 1)],  # 9 is no GPU of this node
    ],
)
def test_refused_pairs_leave_the_process_checkpointed(proc, pairs):
    t, ctl, _, _ = checkpointed_on_01(proc)
    assert ctl(f"restore {t.pid} {pairs_arg(pairs)}") == {"result": "CUDA_ERROR_INVALID_VALUE"}
    assert ctl(f"state {t.pid}") == {"result": "CUDA_SUCCESS", "state": 2}


def test_another_model_or_less_memory_is_refused(proc):
    node = "H100:80G,H100:80G,L4:24G,H100:1M"
    t = proc(FAKECUDA_DEVICES=node, CUDA_VISIBLE_DEVICES="0,1")
    t("alloc 0 2097152 1")
    t("alloc 1 4096 2")
    ctl = proc(FAKECUDA_DEVICES=node)
    assert ctl(f"lock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert ctl(f"checkpoint {t.pid}")["result"] == "CUDA_SUCCESS"
    other_model = f"restore {t.pid} {pairs_arg([(0, 2), (1, 1), (2, 0), (3, 3)])}"
    assert ctl(other_model) == {"result": "CUDA_ERROR_INVALID_VALUE"}
    too_small = f"restore {t.pid} {pairs_arg([(0, 3), (1, 1), (2, 2), (3, 0)])}"
    assert ctl(too_small) == {"result": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert ctl(f"state {t.pid}") == {"result": "CUDA_SUCCESS", "state": 2}
    assert ctl(f"restore {t.pid} {pairs_arg([(0, 1), (1, 0), (2, 2), (3, 3)])}") == {
        "result": "CUDA_SUCCESS"
    }
    assert ctl(f"unlock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert [d["uuid"] for d in t("devices")] == [uuid(1), uuid(0)]


def test_restore_in_place_without_pairs(proc):
    t = proc(FAKECUDA_DEVICES=NODE4, CUDA_VISIBLE_DEVICES="1")
    va = t("alloc 0 4096 9")["va"]
    ctl = proc(FAKECUDA_DEVICES=NODE4)
    for op in ("lock", "checkpoint", "restore", "unlock"):
        assert ctl(f"{op} {t.pid}") == {"result": "CUDA_SUCCESS"}
    assert [d["uuid"] for d in t("devices")] == [uuid(1)]
    assert t(f"read {va} 4") == {"hex": "09" * 4}


def test_default_devices_are_one_model(proc):
    """The FAKECUDA_DEVICE_COUNT devices are one model, one name ("fakecuda GPU"): they may swap
    places."""
    t = proc()
    va = t("alloc 0 4096 7")["va"]
    ctl = proc()
    assert ctl(f"lock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert ctl(f"checkpoint {t.pid}")["result"] == "CUDA_SUCCESS"
    assert ctl(f"restore {t.pid} {uuid(0)}={uuid(1)} {uuid(1)}={uuid(0)}") == {
        "result": "CUDA_SUCCESS"
    }
    assert ctl(f"unlock {t.pid}")["result"] == "CUDA_SUCCESS"
    assert [(d["name"], d["uuid"]) for d in t("devices")] == [
        ("fakecuda GPU", uuid(1)),
        ("fakecuda GPU", uuid(0)),
    ]
    assert t(f"read {va} 4") == {"hex": "07" * 4}


def test_gpu_pairs_restore_under_asan(fcpeer_asan_exe, fake_env, proc):
    """The target's side (device tables, ck_place, the move) compiled with fakecuda's sources
    under ASan/UBSan: fcpeer on {0,1} of one node, restored on another (GPUs 4-7)."""
    from fakecuda_helpers import Peer

    env = dict(
        fake_env,
        FAKECUDA_DEVICES=NODE4,
        CUDA_VISIBLE_DEVICES="0,1",
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    env.pop("LD_LIBRARY_PATH")  # fakecuda is compiled in
    t = Peer(fcpeer_asan_exe, env)
    try:
        t.cmd("init 1")
        va = t.cmd("malloc 4096")[0]
        t.cmd(f"write {va} 91")
        ctl = proc(FAKECUDA_DEVICES=NODE_B)
        assert ctl(f"lock {t.pid}") == {"result": "CUDA_SUCCESS"}
        assert ctl(f"checkpoint {t.pid}") == {"result": "CUDA_SUCCESS"}
        assert ctl(f"restore {t.pid}") == {"result": "CUDA_ERROR_INVALID_DEVICE"}
        assert ctl(f"restore {t.pid} {uuid(1)}={uuid(5)}") == {"result": "CUDA_ERROR_INVALID_VALUE"}
        full = pairs_arg([(0, 4), (1, 5), (2, 6), (3, 7)])
        assert ctl(f"restore {t.pid} {full}") == {"result": "CUDA_SUCCESS"}
        assert ctl(f"unlock {t.pid}") == {"result": "CUDA_SUCCESS"}
        assert t.cmd(f"read {va}") == ["91"]
    finally:
        t.close()
    assert t.proc.returncode == 0


def test_each_configured_device_allocates_up_to_its_own_size(proc):
    """Under FAKECUDA_DEVICES a device's capacity is its own size (cuDeviceTotalMem,
    cuMemGetInfo and the allocation limit agree), not FAKECUDA_TOTAL_MEM."""
    p = proc(FAKECUDA_DEVICES="small:4M,big:64M", FAKECUDA_TOTAL_MEM=str(1 << 40))
    assert p("alloc 0 8388608 1") == {"error": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert "va" in p("alloc 1 8388608 1")
    assert "va" in p("alloc 0 2097152 1")
