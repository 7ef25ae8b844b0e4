"""Requests to an S3-compatible object store, each bounded and retried where safe.

:class:`Client` wraps the ``minio`` client (PyPI ``minio``, pinned in pyproject.toml; imported
on first use) with one urllib3 pool: per-request connect/read timeouts, no retries of its own.
:meth:`Client.call` makes one logical request in at most ``attempts`` tries: it retries
connection errors, timeouts, truncated bodies, HTTP 5xx and 429 (``SlowDown``), and a body
whose length or checksum is wrong (:class:`Retry`), waiting ``backoff_s`` doubled each time
(at most 5 s, jittered), never past the operation's deadline; it does not retry a 4xx answer
(403 access denied, 404, 400). Every request it makes is idempotent: a GET or HEAD, a PUT of
a whole object or of one multipart part, a LIST, a DELETE. Failures raise ``StorageError``
naming the phase, bucket, key, the request and the last cause (HTTP status and S3 error code,
or the socket error). A set ``cancel`` event stops the next attempt (Ctrl-C, or a failed
sibling transfer).

Multipart uploads use minio's ``_create_multipart_upload``/``_upload_part``/
``_complete_multipart_upload``/``_abort_multipart_upload`` (S3 API CreateMultipartUpload,
UploadPart, CompleteMultipartUpload, AbortMultipartUpload), so that each part is one task of
the shared pool and is retried alone.

Ranged GETs: a ``Range: bytes=A-B`` answer must say ``Content-Range: bytes A-B/...`` (206,
or a 200 with that header, as ``rclone serve s3`` answers) and carry exactly B-A+1 bytes; an
endpoint that ignores ranges is refused.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from typing import Callable, Optional

from cuinterpose.agent.snapshot.backends.api import StorageError, TransferOptions
from cuinterpose.agent.snapshot.backends.transfer import PIECE

_RETRY_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "ServerError"}


class Retry(Exception):
    """One attempt got a wrong answer that a new attempt may fix (a short body, a checksum
    mismatch); the text says what."""


class NotFound(Exception):
    """HTTP 404 NoSuchKey (the object is absent)."""


def _code_of(exc) -> tuple[Optional[int], str]:
    """(HTTP status, S3 error code) of a minio exception."""
    from minio.error import InvalidResponseError, S3Error, ServerError

    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", None)
        return status, exc.code or ""
    if isinstance(exc, ServerError):
        return exc.status_code, ""
    if isinstance(exc, InvalidResponseError):
        body = getattr(exc, "_body", "") or ""
        m = re.search(r"<Code>([^<]+)</Code>", body)
        return getattr(exc, "_code", None), m.group(1) if m else ""
    return None, ""


def classify(exc: BaseException) -> tuple[bool, str]:
    """(retry it?, what happened) for an exception of one attempt."""
    import urllib3.exceptions as ue
    from minio.error import MinioException

    if isinstance(exc, Retry):
        return True, str(exc)
    if isinstance(exc, MinioException):
        status, code = _code_of(exc)
        what = f"HTTP {status}" + (f" {code}" if code else "")
        return (
            status is not None and (status >= 500 or status == 429)
        ) or code in _RETRY_CODES, what
    if isinstance(exc, ue.NewConnectionError):
        return True, f"cannot connect ({exc.__class__.__name__}: {_short(exc)})"
    if isinstance(exc, ue.MaxRetryError):
        return True, f"cannot connect ({_short(exc.reason)})"
    if isinstance(exc, (ue.HTTPError, ConnectionError, TimeoutError, OSError)):
        return True, f"{exc.__class__.__name__}: {_short(exc)}"
    return False, f"{exc.__class__.__name__}: {_short(exc)}"


def _short(exc) -> str:
    s = str(exc)
    m = re.search(r"\[Errno \d+\] ([^'\")]+)", s)
    return m.group(1) if m else s[:200]


class Client:
    """One endpoint's client for one operation: ``settings`` (awsconf.S3Settings),
    ``transfer`` (api.TransferOptions; its ``deadline_s`` starts counting here), ``cancel``
    (threading.Event; set: stop)."""

    def __init__(self, settings, transfer: TransferOptions, cancel=None):
        import certifi
        import urllib3
        from minio import Minio

        self.settings, self.transfer = settings, transfer
        self.cancel = cancel or threading.Event()
        #: time.monotonic() past which no request is sent (None: no deadline)
        self.deadline = None
        if transfer.deadline_s is not None:
            self.deadline = time.monotonic() + transfer.deadline_s
        pool = urllib3.PoolManager(
            num_pools=4,
            maxsize=transfer.threads + 2,
            block=False,
            timeout=urllib3.Timeout(
                connect=transfer.connect_timeout_s, read=transfer.read_timeout_s
            ),
            retries=False,
            cert_reqs="CERT_REQUIRED",
            ca_certs=settings.ca_bundle or certifi.where(),
        )
        self.mc = Minio(
            settings.host,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            session_token=settings.session_token,
            secure=settings.secure,
            region=settings.region,
            http_client=pool,
        )
        #: attempts that failed and were retried (for tests and the result's notes)
        self.retries = 0
        self._lock = threading.Lock()

    def call(self, phase: str, bucket: str, key: str, what: str, attempt: Callable):
        """``attempt()`` (one request, reading its whole answer) until it succeeds, at most
        ``attempts`` times (module docstring). Raises ``NotFound`` for a 404 NoSuchKey,
        ``StorageError`` otherwise."""
        from minio.error import MinioException

        t = self.transfer
        for n in range(1, t.attempts + 1):
            if self.cancel.is_set():
                raise StorageError(phase, f"{what} cancelled", bucket=bucket, key=key)
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise StorageError(
                    phase,
                    f"{what} not sent: the operation's deadline ({t.deadline_s:g} s) passed",
                    bucket=bucket,
                    key=key,
                )
            try:
                return attempt()
            except MinioException as e:
                # a 404 comes as S3Error, or (an XML body served as text/xml, as rclone does)
                # as InvalidResponseError
                status, code = _code_of(e)
                if code in ("NoSuchKey", "NoSuchUpload") or (
                    status == 404 and code != "NoSuchBucket"
                ):
                    raise NotFound(key) from None
                retry, why = classify(e)
            except (StorageError, NotFound):
                raise
            except Exception as e:  # noqa: B902 - classified below
                retry, why = classify(e)
            if not retry:
                raise StorageError(
                    phase, self._refusal(what, why), bucket=bucket, key=key
                ) from None
            delay = min(5.0, t.backoff_s * 2 ** (n - 1)) * random.uniform(0.5, 1.0)
            late = self.deadline is not None and time.monotonic() + delay > self.deadline
            if n == t.attempts or late:
                end = "the operation's deadline passed" if late else f"{n} attempts"
                raise StorageError(
                    phase,
                    f"{what} failed ({why}; {end}) at {self.settings.endpoint}",
                    bucket=bucket,
                    key=key,
                ) from None
            with self._lock:
                self.retries += 1
            if self.cancel.wait(delay):
                raise StorageError(phase, f"{what} cancelled", bucket=bucket, key=key)

    @contextlib.contextmanager
    def cleanup(self):
        """Requests that undo a failed operation (remove its objects, its pin, its lock): not
        stopped by the cancel event or the deadline, still bounded by the per-request
        timeouts and attempts."""
        was, deadline = self.cancel.is_set(), self.deadline
        self.cancel.clear()
        self.deadline = None
        try:
            yield self
        finally:
            self.deadline = deadline
            if was:
                self.cancel.set()

    def _refusal(self, what: str, why: str) -> str:
        if why.startswith("HTTP 403"):
            return (
                f"{what} refused: {why} (access denied: check the credentials from "
                f"{self.settings.source('credentials') or 'the settings'} and the bucket policy)"
            )
        return f"{what} refused: {why} at {self.settings.endpoint}"

    # ------------------------------------------------------------------ requests

    def head(self, phase: str, bucket: str, key: str) -> Optional[int]:
        """The object's size in bytes, None when it does not exist."""
        try:
            st = self.call(phase, bucket, key, "HEAD", lambda: self.mc.stat_object(bucket, key))
        except NotFound:
            return None
        return int(st.size)

    def get(
        self,
        phase: str,
        bucket: str,
        key: str,
        *,
        length: int,
        offset: int = 0,
        whole: bool = False,
        sink: Callable[[int, memoryview], None],
        begin: Callable[[], None] = lambda: None,
        verify: Callable[[], None] = lambda: None,
    ) -> None:
        """GET ``length`` bytes of the object from ``offset`` (``whole``: the whole object,
        no Range header, which must be ``length`` bytes), handing each piece to
        ``sink(position in the object, bytes)``; ``begin()`` before each attempt and
        ``verify()`` after its last byte (raise :class:`Retry` to try again). Raises
        ``NotFound``/``StorageError``."""
        what = "GET" if whole else f"GET bytes {offset}-{offset + length - 1}"

        def attempt():
            begin()
            if length == 0 and whole:
                return verify()
            resp = self.mc.get_object(bucket, key, offset=offset, length=0 if whole else length)
            try:
                self._read(phase, bucket, key, resp, offset, length, whole, sink)
            finally:
                resp.close()
                resp.release_conn()
            verify()

        self.call(phase, bucket, key, what, attempt)

    def _read(self, phase, bucket, key, resp, offset, length, whole, sink) -> None:
        cr = resp.headers.get("Content-Range")
        want = f"bytes {offset}-{offset + length - 1}/"
        if not whole and not (cr or "").startswith(want):
            raise StorageError(
                phase,
                f"GET bytes {offset}-{offset + length - 1} was answered with Content-Range "
                f"{cr!r}: the endpoint does not serve byte ranges",
                bucket=bucket,
                key=key,
            )
        got = 0
        while got < length:
            if self.cancel.is_set():
                raise StorageError(phase, "GET cancelled", bucket=bucket, key=key)
            piece = resp.read(min(PIECE, length - got))
            if not piece:
                break
            sink(offset + got, memoryview(piece))
            got += len(piece)
        if got < length:
            raise Retry(f"truncated body: {got} of {length} bytes")
        if whole and resp.read(1):
            raise Retry(f"object is longer than the {length} bytes expected")

    def get_bytes(self, phase: str, bucket: str, key: str, limit: int) -> bytes:
        """The whole object (at most ``limit`` bytes, else ``StorageError``)."""
        size = self.head(phase, bucket, key)
        if size is None:
            raise NotFound(key)
        if size > limit:
            raise StorageError(
                phase, f"object is {size} bytes, over {limit}", bucket=bucket, key=key
            )
        buf = bytearray(size)

        def sink(pos, piece):
            buf[pos : pos + len(piece)] = piece

        self.get(phase, bucket, key, length=size, whole=True, sink=sink)
        return bytes(buf)

    def put(self, phase: str, bucket: str, key: str, data) -> None:
        """PUT ``data`` (bytes, at most 5 GiB) as the whole object (one request)."""
        import io

        n = len(data)
        self.call(
            phase,
            bucket,
            key,
            f"PUT {n} bytes",
            lambda: self.mc.put_object(bucket, key, io.BytesIO(data), n, part_size=max(n, 5 << 20)),
        )

    def multipart_begin(self, phase: str, bucket: str, key: str) -> str:
        return self.call(
            phase,
            bucket,
            key,
            "CreateMultipartUpload",
            lambda: self.mc._create_multipart_upload(bucket, key, {}),
        )

    def multipart_part(self, phase, bucket, key, upload_id: str, number: int, data) -> str:
        """Upload part ``number`` (1-based) and return its ETag."""
        return self.call(
            phase,
            bucket,
            key,
            f"UploadPart {number} ({len(data)} bytes)",
            lambda: self.mc._upload_part(bucket, key, bytes(data), None, upload_id, number),
        )

    def multipart_complete(self, phase, bucket, key, upload_id: str, etags: list) -> None:
        from minio.datatypes import Part

        parts = [Part(i + 1, e) for i, e in enumerate(etags)]
        self.call(
            phase,
            bucket,
            key,
            "CompleteMultipartUpload",
            lambda: self.mc._complete_multipart_upload(bucket, key, upload_id, parts),
        )

    def multipart_abort(self, bucket: str, key: str, upload_id: str) -> None:
        """Best effort (an abandoned upload is also removed by a bucket lifecycle rule)."""
        try:
            self.mc._abort_multipart_upload(bucket, key, upload_id)
        except Exception:  # noqa: BLE001 - cleanup after a failure already being raised
            pass

    def list(self, phase: str, bucket: str, prefix: str, *, recursive: bool) -> list:
        """``[(name, size, is_dir)]`` under ``prefix`` (directories: common prefixes ending in
        "/" when not ``recursive``)."""

        def attempt():
            return [
                (o.object_name, int(o.size or 0), bool(o.is_dir))
                for o in self.mc.list_objects(bucket, prefix=prefix, recursive=recursive)
            ]

        return self.call(phase, bucket, prefix or "/", "LIST", attempt)

    def remove(self, phase: str, bucket: str, key: str) -> None:
        """DELETE the object (an absent one is fine)."""
        try:
            self.call(phase, bucket, key, "DELETE", lambda: self.mc.remove_object(bucket, key))
        except NotFound:
            pass
