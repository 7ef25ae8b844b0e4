"""A small stand-in for the Kubernetes API server's Pod endpoints, on 127.0.0.1.

No API server is available on our machines, so the watcher's tests run the official
``kubernetes`` client against this. It serves the real API's JSON shapes for:

- ``GET /api/v1/pods?fieldSelector=spec.nodeName=N&labelSelector=k=v,...`` — a ``PodList``
  (``metadata.resourceVersion``, ``items``);
- the same with ``watch=true&resourceVersion=RV&timeoutSeconds=T`` — a chunked stream of
  ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": Pod}`` lines newer than RV, ending after
  T seconds (default 5) or at :meth:`FakeKubeAPI.end_watches`; an RV older than the
  compaction point gets one ``ERROR`` event carrying a ``Status`` with ``code: 410``
  (``reason: Expired``), as the real server sends;
- ``GET /api/v1/namespaces/NS/pods/NAME``;
- ``PATCH /api/v1/namespaces/NS/pods/NAME`` with ``application/merge-patch+json`` (RFC 7386);
  a patch that carries ``metadata.resourceVersion`` different from the pod's gets 409
  Conflict (``Status``), like the real optimistic concurrency check.

Every write bumps the global resourceVersion and records a MODIFIED event. ``patches`` keeps
``(namespace, name, patch body)`` of every accepted PATCH, in order.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NODE = "node-a"


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: null deletes a key, objects merge, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def status_obj(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def make_pod(
    name: str,
    *,
    namespace: str = "default",
    node: str = "node-a",
    uid: str = None,
    annotations: dict = None,
    labels: dict = None,
    phase: str = "Running",
    containers: list = None,
    host_pid: bool = True,
) -> dict:
    """A Pod object. ``containers``: [(name, "containerd://<id>")] (running); ``host_pid``:
    ``spec.hostPID`` (omitted when False, as the API server does for a false default)."""
    containers = containers if containers is not None else [("main", "containerd://" + "ab" * 32)]
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{name}",
            "labels": labels or {},
            "annotations": annotations or {},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": node,
            **({"hostPID": True} if host_pid else {}),
            "containers": [{"name": n, "image": "example/app:1"} for n, _ in containers],
        },
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": n,
                    "containerID": cid,
                    "ready": True,
                    "restartCount": 0,
                    "image": "example/app:1",
                    "imageID": "",
                    "state": {"running": {"startedAt": "2026-01-01T00:00:01Z"}},
                }
                for n, cid in containers
            ],
        },
    }


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client closing a watch early
        pass


class FakeKubeAPI:
    """Context manager; ``host`` is ``http://127.0.0.1:PORT``."""

    def __init__(self):
        self.lock = threading.Condition()
        self.pods: dict[tuple, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.rv = 100
        self.compacted = 0  # watches from an RV below this get 410
        self.watch_generation = 0  # bumped by end_watches()
        self.patches: list[tuple[str, str, dict]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path?query)
        self.fail_patches = 0  # the next N PATCHes get 500 InternalError
        self.server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.end_watches()
        self.server.shutdown()
        self.server.server_close()

    # -- state (tests call these) ---------------------------------------------------------
    def _bump(self, kind: str, pod: dict) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, copy.deepcopy(pod)))
        self.lock.notify_all()

    def add_pod(self, pod: dict) -> dict:
        with self.lock:
            pod = copy.deepcopy(pod)
            self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
            self._bump("ADDED", pod)
            return copy.deepcopy(pod)

    def update_pod(self, namespace: str, name: str, fn) -> dict:
        """Apply ``fn(pod)`` (in place) as a user's write; records MODIFIED."""
        with self.lock:
            pod = self.pods[(namespace, name)]
            fn(pod)
            self._bump("MODIFIED", pod)
            return copy.deepcopy(pod)

    def pod(self, namespace: str, name: str) -> dict:
        with self.lock:
            return copy.deepcopy(self.pods[(namespace, name)])

    def annotations(self, namespace: str, name: str) -> dict:
        return self.pod(namespace, name)["metadata"].get("annotations") or {}

    def bookmark(self) -> None:
        """Send a BOOKMARK (only ``metadata.resourceVersion``) to open watches: the resource
        version moves on without a pod event (another object changed)."""
        with self.lock:
            self.rv += 1
            self.events.append(
                (
                    self.rv,
                    "BOOKMARK",
                    {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.rv)},
                    },
                )
            )
            self.lock.notify_all()

    def compact(self) -> None:
        """Another object of the cluster changes (the resourceVersion moves on) and history
        up to it is forgotten: a watch from any earlier RV gets 410 Gone; the RV a list
        returns afterwards is valid."""
        with self.lock:
            self.rv += 1
            self.compacted = self.rv
            self.lock.notify_all()

    def end_watches(self) -> None:
        """Finish every open watch stream (as a server-side timeout would)."""
        with self.lock:
            self.watch_generation += 1
            self.lock.notify_all()

    def wait_for(self, pred, timeout: float = 30.0) -> bool:
        """Block until ``pred(self)`` holds, checking after every write and every 20 ms
        (``timeout`` is a hang guard only, never an assertion on time)."""
        end = time.monotonic() + timeout
        with self.lock:
            while not pred(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.02))
            return True

    # -- HTTP -----------------------------------------------------------------------------
    def _handler_class(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _send_json(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                u = urllib.parse.urlsplit(self.path)
                q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query).items()}
                parts = [p for p in u.path.split("/") if p]
                with api.lock:
                    api.requests.append((self.command, self.path))
                return parts, q

            def do_GET(self):
                parts, q = self._route()
                if parts == ["api", "v1", "pods"]:
                    if q.get("watch") in ("true", "1"):
                        return self._watch(q)
                    return self._list(q)
                if (
                    len(parts) == 6
                    and parts[:3] == ["api", "v1", "namespaces"]
                    and parts[4] == "pods"
                ):
                    with api.lock:
                        pod = api.pods.get((parts[3], parts[5]))
                        pod = copy.deepcopy(pod)
                    if pod is None:
                        return self._send_json(
                            404, status_obj(404, "NotFound", f'pods "{parts[5]}" not found')
                        )
                    return self._send_json(200, {"kind": "Pod", "apiVersion": "v1", **pod})
                self._send_json(
                    404,
                    status_obj(404, "NotFound", "the server could not find the requested resource"),
                )

            def _matches(self, pod: dict, q: dict) -> bool:
                for term in filter(None, q.get("fieldSelector", "").split(",")):
                    k, _, v = term.partition("=")
                    if k != "spec.nodeName":
                        raise ValueError(f"field selector {k} not supported")
                    if pod["spec"].get("nodeName") != v:
                        return False
                labels = pod["metadata"].get("labels") or {}
                for term in filter(None, q.get("labelSelector", "").split(",")):
                    if "!=" in term:
                        k, v = term.split("!=", 1)
                        if labels.get(k) == v:
                            return False
                    elif "=" in term:
                        k, v = term.split("=", 1)
                        if labels.get(k) != v.lstrip("="):
                            return False
                    elif term.startswith("!"):
                        if term[1:] in labels:
                            return False
                    elif term not in labels:
                        return False
                return True

            def _list(self, q):
                with api.lock:
                    items = [copy.deepcopy(p) for p in api.pods.values() if self._matches(p, q)]
                    rv = str(api.rv)
                self._send_json(
                    200,
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": rv},
                        "items": items,
                    },
                )

            def _chunk(self, obj: dict) -> None:
                data = (json.dumps(obj) + "\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _watch(self, q):
                since = int(q.get("resourceVersion") or 0)
                timeout = float(q.get("timeoutSeconds") or 5)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                with api.lock:
                    gen = api.watch_generation
                    if since < api.compacted:
                        gone = status_obj(
                            410, "Expired", f"too old resource version: {since} ({api.compacted})"
                        )
                        pending = [{"type": "ERROR", "object": gone}]
                        since = None
                    else:
                        pending = []
                try:
                    if since is None:
                        self._chunk(pending[0])
                    else:
                        deadline = time.monotonic() + timeout
                        while True:
                            with api.lock:
                                while True:
                                    new = [e for e in api.events if e[0] > since]
                                    left = deadline - time.monotonic()
                                    if new or api.watch_generation != gen or left <= 0:
                                        break
                                    api.lock.wait(min(left, 0.5))
                                if not new:
                                    break
                                since = new[-1][0]
                            for _rv, kind, pod in new:
                                if kind == "BOOKMARK":
                                    if q.get("allowWatchBookmarks") == "true":
                                        self._chunk({"type": kind, "object": pod})
                                elif self._matches(pod, q):
                                    self._chunk({"type": kind, "object": pod})
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_PATCH(self):
                parts, q = self._route()
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if not (
                    len(parts) == 6
                    and parts[:3] == ["api", "v1", "namespaces"]
                    and parts[4] == "pods"
                ):
                    return self._send_json(404, status_obj(404, "NotFound", "not found"))
                if ctype not in (
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                ):
                    return self._send_json(
                        415,
                        status_obj(
                            415,
                            "UnsupportedMediaType",
                            f"the body of the request was in an unknown format - accepted media "
                            f"types include: application/merge-patch+json (got {ctype})",
                        ),
                    )
                patch = json.loads(body or b"{}")
                key = (parts[3], parts[5])
                with api.lock:
                    if api.fail_patches > 0:
                        api.fail_patches -= 1
                        return self._send_json(
                            500, status_obj(500, "InternalError", "etcdserver: request timed out")
                        )
                with api.lock:
                    pod = api.pods.get(key)
                    if pod is None:
                        return self._send_json(
                            404, status_obj(404, "NotFound", f'pods "{parts[5]}" not found')
                        )
                    want = (patch.get("metadata") or {}).get("resourceVersion")
                    if want is not None and want != pod["metadata"]["resourceVersion"]:
                        return self._send_json(
                            409,
                            status_obj(
                                409,
                                "Conflict",
                                f'Operation cannot be fulfilled on pods "{parts[5]}": '
                                "the object has been modified; please apply your changes to the "
                                "latest version and try again",
                            ),
                        )
                    new = merge_patch(pod, patch)
                    new["metadata"]["resourceVersion"] = pod["metadata"]["resourceVersion"]
                    api.pods[key] = new
                    api.patches.append((parts[3], parts[5], patch))
                    api._bump("MODIFIED", new)
                    out = copy.deepcopy(new)
                self._send_json(200, {"kind": "Pod", "apiVersion": "v1", **out})

        return Handler
