"""A process tree shaped like a cuinterpose workload, for the CRIU dump/restore tests.

Usage: python criu_workload.py RUN_DIR   (started with setsid, stdio on files or /dev/null)

The launcher (this process) sets up anonymous shared and private memory and a socketpair,
forks two children, then waits for them. Each child has several threads:

- child 0: a counter thread writing "N\\n" to RUN_DIR/counter-0.log (a regular file opened
  for writing, O_APPEND) and storing N in shared memory slot 0; a server thread
  accepting on a listening Unix socket bound at RUN_DIR/sock-0 (mode 0600) and a second
  server thread on the abstract socket "\\0fakecuda-<pid>"; it holds an open sealed memfd
  (not mapped), a 1 GiB PROT_NONE MAP_NORESERVE reservation and a private anonymous mapping.
- child 1: a counter thread (counter-1.log, plain O_WRONLY unless CRIU_TEST_LOGS=append;
  shared slot 1) and a thread answering on its end of the socketpair.

Server commands (one line per connection, one JSON reply):
  ping            -> pid, tid count, memfd fd/seals/sha256, reservation, private/shared memory
  relay <text>    -> child 0 sends <text> over the socketpair; child 1's answer is returned
Each child writes RUN_DIR/child-<i>.json (pid, fds, addresses) once it is ready.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
import traceback

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]

RESERVE_BYTES = 1 << 30
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux x86-64 and arm64 value
MEMFD_BYTES = 3 * 4096 + 123
SHARED_BYTES = 16 * 4096
PRIVATE_BYTES = 8 * 4096
MEMFD_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def pattern(n: int, seed: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, path)


def counter_thread(run_dir: str, idx: int, shared: mmap.mmap) -> None:
    # counter-0.log is opened like a logging.FileHandler (O_APPEND); counter-1.log like a
    # shell `>` redirection (plain O_WRONLY, the file offset matters) unless
    # CRIU_TEST_LOGS=append, which opens both with O_APPEND.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if idx == 0 or os.environ.get("CRIU_TEST_LOGS") == "append":
        flags |= os.O_APPEND
    fd = os.open(os.path.join(run_dir, f"counter-{idx}.log"), flags, 0o644)
    n = 0
    while True:
        os.write(fd, b"%d\n" % n)
        struct.pack_into("<Q", shared, 8 * idx, n)
        n += 1
        time.sleep(0.002)


def child0(run_dir: str, shared: mmap.mmap, sp: socket.socket) -> None:
    pid = os.getpid()
    # sealed memfd, open but not mapped
    mfd = os.memfd_create("cuinterpose-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(mfd, pattern(MEMFD_BYTES, 7))
    fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    # big PROT_NONE reservation, never touched
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    resv = libc.mmap(None, RESERVE_BYTES, 0, flags, -1, 0)
    if resv in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap reservation")
    private = mmap.mmap(-1, PRIVATE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    private[:] = pattern(PRIVATE_BYTES, 11)
    sp_lock = threading.Lock()

    def info() -> dict:
        h = hashlib.sha256(os.pread(mfd, MEMFD_BYTES + 10, 0)).hexdigest()
        return {
            "pid": pid,
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "memfd_fd": mfd,
            "memfd_sha256": h,
            "memfd_seals": fcntl.fcntl(mfd, fcntl.F_GET_SEALS),
            "memfd_size": os.fstat(mfd).st_size,
            "reservation": resv,
            "private_ok": private[:] == pattern(PRIVATE_BYTES, 11),
            "shared": list(struct.unpack_from("<QQ", shared, 0)),
        }

    def handle(conn: socket.socket) -> None:
        with conn:
            line = conn.makefile("rb").readline().decode().strip()
            if line == "ping":
                reply = info()
            elif line.startswith("relay "):
                with sp_lock:
                    sp.sendall((line[6:] + "\n").encode())
                    answer = sp.makefile("rb").readline().decode().strip()
                reply = {"answer": answer}
            else:
                reply = {"error": f"unknown command {line!r}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")

    def serve(listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            handle(conn)

    path = os.path.join(run_dir, "sock-0")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600, like the shim's control socket
    ls.bind(path)
    os.umask(old)
    os.chmod(path, 0o600)
    ls.listen(8)
    abstract = f"\0fakecuda-{pid}"
    la = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    la.bind(abstract)
    la.listen(8)
    for target, arg in ((serve, ls), (serve, la), (counter_thread, None)):
        args = (run_dir, 0, shared) if target is counter_thread else (arg,)
        threading.Thread(target=target, args=args, daemon=True).start()
    write_json(
        os.path.join(run_dir, "child-0.json"),
        {
            "pid": pid,
            "socket_path": path,
            "abstract": abstract[1:],
            "memfd_fd": mfd,
            "reservation": resv,
            "info": info(),
        },
    )
    while True:
        time.sleep(3600)


def child1(run_dir: str, shared: mmap.mmap, sp: socket.socket) -> None:
    pid = os.getpid()

    def answer() -> None:
        f = sp.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                return
            sp.sendall(f"ack:{line.decode().strip()}:{pid}\n".encode())

    threading.Thread(target=answer, daemon=True).start()
    threading.Thread(target=counter_thread, args=(run_dir, 1, shared), daemon=True).start()
    write_json(os.path.join(run_dir, "child-1.json"), {"pid": pid})
    while True:
        time.sleep(3600)


def main() -> None:
    run_dir = sys.argv[1]
    shared = mmap.mmap(-1, SHARED_BYTES)  # MAP_SHARED | MAP_ANONYMOUS, inherited by fork
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    kids = []
    for body, mine, other in ((child0, a, b), (child1, b, a)):
        pid = os.fork()
        if pid == 0:
            other.close()
            try:
                body(run_dir, shared, mine)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            os._exit(1)
        kids.append(pid)
    a.close()
    b.close()
    lock_path = os.environ.get("CRIU_TEST_FLOCK")
    if lock_path:  # hold an exclusive flock for the whole run (a job's cache or db lock)
        import fcntl

        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    write_json(os.path.join(run_dir, "launcher.json"), {"pid": os.getpid(), "children": kids})
    print(f"launcher {os.getpid()} children {kids}", flush=True)
    for _ in kids:
        pid, status = os.wait()
        print(f"child {pid} exited with status {status}", flush=True)


if __name__ == "__main__":
    main()
