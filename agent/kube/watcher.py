"""The pod watcher: Kubernetes annotations in, checkpoints and restores on this node out.

``PodWatcher(config, node_name, api_client, actions)`` lists and watches the pods of one node
(``fieldSelector=spec.nodeName=<node>``, plus the config's ``labelSelector``), resumes a watch at
the last ``resourceVersion`` it saw and re-lists when the API answers 410 Gone. Every pod that
is listed or changes is passed to :meth:`PodWatcher.handle`, which decides
(``annotations.decide``) and runs at most one request at a time, in the watcher's thread:

1. claim: one merge patch, conditional on the pod's ``metadata.resourceVersion``, sets
   ``-status: Pending``, ``-handled: NAME@UID`` and a message (409 Conflict: someone changed
   the pod in between; nothing runs, the newer version arrives as its own event);
2. resolve the pod's containers to process trees (``resolver.CgroupResolver``); none → Failed.
   A restore resolves the placeholder pod the same way and takes the init of its first running
   container (``resolver.placeholder``): the restored trees join its cgroups, namespaces and
   stdio (``into_pid``);
3. ``-status: Running`` with the root pids, then ``actions.checkpoint(...)`` /
   ``actions.restore(..., into_pid=PID)`` with the options the pod's annotations set
   (``annotations.option_values``; ``actions.AgentActions`` by default: the agent's own entry
   points, agent/run/ops.py);
4. ``-status: Succeeded`` (checkpoint: ``cuinterpose.io/snapshot`` = the snapshot directory) or
   ``Failed`` with the error (phase, pid, reason, outcome).

``run_watcher(config, actions=None, stop_event=None)`` builds the API client from the config
and runs until ``stop_event`` is set; ``cuinterpose-agent serve`` runs it in a thread of the
daemon (``service.Server.start_watcher``) and ``python -m cuinterpose.agent.kube --config
FILE`` standalone. :meth:`PodWatcher.close` stops it: no new request starts, a running one
finishes first, and the open watch read is cut so that the thread leaves at once.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from typing import Optional

import cuinterpose.agent.kube.annotations as A
from cuinterpose.agent.config import AgentConfig
from cuinterpose.agent.kube.resolver import CgroupResolver, ResolveError
from cuinterpose.agent.snapshot.snapdir import SnapshotDir

log = logging.getLogger("cuinterpose.kube")


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 / ERROR event with code 410)."""


def make_api_client(config: AgentConfig):
    """A ``kubernetes.client.ApiClient``: ``kubernetes.apiServer`` (plain URL, tests) if set,
    else ``kubernetes.kubeconfig`` if set, else the in-cluster service account."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    k = config.kubernetes
    if k.api_server:
        c = kclient.Configuration(host=k.api_server)
        return kclient.ApiClient(c)
    c = kclient.Configuration()
    if k.kubeconfig:
        kconfig.load_kube_config(config_file=k.kubeconfig, client_configuration=c)
    else:
        kconfig.load_incluster_config(client_configuration=c)
    return kclient.ApiClient(c)


def _error_message(kind: str, e: BaseException) -> str:
    outcome = getattr(e, "outcome", None)
    if hasattr(e, "phase") and hasattr(e, "reason"):
        return f"{e} [outcome: {outcome}]" if outcome else str(e)
    return f"{kind}: {type(e).__name__}: {e}"


def _one_line(s: str, limit: int = 1024) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


class PodWatcher:
    """See the module docstring. ``api_client``: a ``kubernetes.client.ApiClient``;
    ``actions``: see ``actions.py``; ``resolver``: an object with ``resolve(pod) ->
    [ContainerTree]`` (default ``CgroupResolver(config.kubernetes.proc_root)``).

    ``stats`` counts ``lists``, ``watches``, ``gone`` (410s), ``runs`` (requests run),
    ``conflicts`` (claims lost to a 409) for tests and logs."""

    def __init__(self, config: AgentConfig, node_name: str, api_client, actions, resolver=None):
        from kubernetes import client as kclient

        self.config = config
        self.node_name = node_name
        self.api = kclient.CoreV1Api(api_client)
        self.actions = actions
        self.resolver = resolver or CgroupResolver(config.kubernetes.proc_root)
        self.field_selector = f"spec.nodeName={node_name}"
        self.label_selector = config.kubernetes.label_selector or None
        self.namespaces = set(config.kubernetes.namespaces)
        self.in_flight: set[str] = set()
        self.stats = {"lists": 0, "watches": 0, "gone": 0, "runs": 0, "conflicts": 0}
        self.resource_version: Optional[str] = None
        #: patch_result: retries after the first attempt, and the first wait (seconds)
        self.result_retries = 5
        self.result_retry_s = 0.5
        #: held while a request runs (from its claim to its result); close() waits for it
        self._request_lock = threading.Lock()
        #: guards ``_closed`` and ``_resp`` (the open watch response)
        self._state_lock = threading.Lock()
        self._closed = False
        self._resp = None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop: wait until a running request has finished (it always does: each phase has
        a deadline), start no new one, and cut the open watch read so that :meth:`run`
        returns at once. Idempotent; safe from any thread but the watcher's own."""
        with self._state_lock:
            self._closed = True  # from here on no request starts
            resp = self._resp
        if resp is not None:
            _cut(resp)
        with self._request_lock:  # the running one (if any) has finished
            pass

    # -- API calls ------------------------------------------------------------------------
    def list_pods(self) -> tuple[list[dict], str]:
        """(pods as the API's JSON objects, the list's resourceVersion)."""
        kw = {"field_selector": self.field_selector, "_preload_content": False}
        if self.label_selector:
            kw["label_selector"] = self.label_selector
        resp = self.api.list_pod_for_all_namespaces(**kw)
        body = json.loads(resp.data)
        self.stats["lists"] += 1
        return body.get("items") or [], body["metadata"]["resourceVersion"]

    def patch(self, pod: dict, annotations: dict, *, conditional: bool = False) -> Optional[dict]:
        """Merge-patch ``annotations`` into ``pod``; with ``conditional`` only if the pod still
        has the ``resourceVersion`` we saw (returns None on 409 Conflict). Returns the patched
        pod (JSON object)."""
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        body = {"metadata": {"annotations": annotations}}
        if conditional:
            body["metadata"]["resourceVersion"] = meta["resourceVersion"]
        try:
            resp = self.api.patch_namespaced_pod(
                meta["name"],
                meta["namespace"],
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as e:
            if e.status == 409 and conditional:
                self.stats["conflicts"] += 1
                return None
            raise
        return json.loads(resp.data)

    # -- requests -------------------------------------------------------------------------
    def handle(self, pod: dict) -> None:
        """Decide and run the pod's checkpoint request, then its restore request."""
        ns = (pod.get("metadata") or {}).get("namespace")
        if self.namespaces and ns not in self.namespaces:
            return
        for kind in ("checkpoint", "restore"):
            if self._closed:
                return
            d = A.decide(pod, kind, frozenset(self.in_flight))
            if d is None or d.action == "skip":
                continue
            if d.action == "fail":
                patched = self.patch(
                    pod,
                    {
                        A.status_key(kind): A.FAILED,
                        A.message_key(kind): _one_line(d.message),
                        A.handled_key(kind): d.token,
                    },
                    conditional=True,
                )
            else:
                patched = self.run_request(pod, d)
            if patched is not None:
                pod = patched

    def snapshot_dir(self, pod: dict, name: str) -> str:
        """``<snapshotDir>/<namespace>/<name>`` (``name`` is validated by ``decide``); under an
        ``s3://BUCKET/PREFIX`` snapshotDir a location in that object store."""
        root, ns = self.config.snapshot_dir, pod["metadata"]["namespace"]
        if "://" in root:
            return f"{root.rstrip('/')}/{ns}/{name}"
        return str(pathlib.Path(root) / ns / name)

    def run_request(self, pod: dict, d: A.Decision) -> Optional[dict]:
        with self._request_lock:
            if self._closed:  # stopping: leave the request to the next agent
                return None
            return self._run_request(pod, d)

    def _run_request(self, pod: dict, d: A.Decision) -> Optional[dict]:
        kind = d.kind
        st, msg = A.status_key(kind), A.message_key(kind)
        images_dir = self.snapshot_dir(pod, d.name)
        claimed = self.patch(
            pod,
            {
                st: A.PENDING,
                A.handled_key(kind): d.token,
                msg: f"{kind} {d.name} accepted by node {self.node_name}",
            },
            conditional=True,
        )
        if claimed is None:
            log.info("claim of %s on %s lost to a concurrent change", d.token, _ref(pod))
            return None
        self.in_flight.add(d.token)
        self.stats["runs"] += 1
        try:
            return self._run_claimed(claimed, d, images_dir)
        finally:
            self.in_flight.discard(d.token)

    def _run_claimed(self, pod: dict, d: A.Decision, images_dir: str) -> dict:
        kind = d.kind
        st, msg = A.status_key(kind), A.message_key(kind)
        try:
            if kind == "checkpoint":
                trees = self.resolver.resolve(pod)
                roots = sorted({r for t in trees for r in t.roots})
                desc = "; ".join(
                    f"container {t.name}: roots {', '.join(map(str, t.roots))}" for t in trees
                )
                pod = self.patch(
                    pod,
                    {st: A.RUNNING, msg: _one_line(f"checkpoint {d.name}: {desc} -> {images_dir}")},
                )
                values = A.option_values(pod, kind)
                values.setdefault("leave_running", self.config.kubernetes.leave_running)
                leave = values["leave_running"]
                result = self.actions.checkpoint(
                    pod, d.name, roots=roots, images_dir=str(images_dir), options=values
                )
                done = {
                    st: A.SUCCEEDED,
                    A.SNAPSHOT: str(images_dir),
                    A.SNAPSHOT_NODE: self.node_name,
                    msg: _one_line(
                        f"snapshot {result.get('snapshot_id', d.name)} of roots "
                        f"{', '.join(map(str, roots))} (CUDA pids "
                        f"{', '.join(map(str, result.get('cuda_pids', [])))}) in "
                        f"{images_dir}"
                        + (
                            "; the workload keeps running"
                            if leave
                            else "; the workload was stopped"
                        )
                        + _notes(result.get("warnings"))
                    ),
                }
            else:
                # (in an object store the restore's download refuses a missing snapshot)
                local = "://" not in images_dir
                snap = SnapshotDir(images_dir)
                if local and not snap.has_manifest():
                    raise ResolveError(
                        f"restore: no snapshot {d.name!r} on node {self.node_name} "
                        f"(no {snap.manifest_path}); nothing was done"
                    )
                try:
                    tree, into, started = self.resolver.placeholder(pod)
                except ResolveError as e:
                    raise ResolveError(
                        f"restore: placeholder: {e}; the restored processes join "
                        "the cgroups and namespaces of the placeholder's running "
                        "container; nothing was done"
                    ) from e
                where = f"container {tree.name} (pid {into})"
                pod = self.patch(
                    pod,
                    {
                        st: A.RUNNING,
                        A.SNAPSHOT: str(images_dir),
                        msg: f"restore of {d.name} from {images_dir} into {where}",
                    },
                )
                result = self.actions.restore(
                    pod,
                    d.name,
                    images_dir=str(images_dir),
                    into_pid=into,
                    into_start_time=started,
                    options=A.option_values(pod, kind),
                )
                done = {
                    st: A.SUCCEEDED,
                    msg: _one_line(
                        f"restored snapshot {result.get('snapshot_id', d.name)} "
                        f"from {images_dir} into {where}: roots "
                        f"{', '.join(map(str, result.get('roots', [])))}"
                        + _notes(result.get("notes"))
                    ),
                }
        except ResolveError as e:
            text = str(e)
            done = {
                st: A.FAILED,
                msg: _one_line(
                    text if text.startswith("restore:") else f"resolve: {text}; nothing was done"
                ),
            }
        except Exception as e:  # the agent's refusal or failure: keep watching
            log.warning("%s %s on %s failed: %s", kind, d.name, _ref(pod), e)
            done = {st: A.FAILED, msg: _one_line(_error_message(kind, e))}
        return self.patch_result(pod, done)

    def patch_result(self, pod: dict, annotations: dict) -> Optional[dict]:
        """Write a request's outcome: retried (``result_retries`` times, waits doubling from
        ``result_retry_s``) on API errors other than 404 and on connection errors, since a
        lost outcome would later read as an interrupted run. A deleted pod (404) is logged
        and None returned."""
        from kubernetes.client.exceptions import ApiException

        wait = self.result_retry_s
        for attempt in range(self.result_retries + 1):
            try:
                return self.patch(pod, annotations)
            except ApiException as e:
                if e.status == 404:
                    log.warning(
                        "pod %s was deleted before its result %s could be written",
                        _ref(pod),
                        annotations,
                    )
                    return None
                err = e
            except Exception as e:  # connection refused/reset, timeouts
                err = e
            if attempt < self.result_retries:
                log.warning(
                    "writing the result to %s failed (%s); retrying in %.1f s", _ref(pod), err, wait
                )
                threading.Event().wait(wait)
                wait *= 2
        raise err

    # -- list + watch ---------------------------------------------------------------------
    def relist(self) -> str:
        """List the node's pods, handle each; returns the list's resourceVersion."""
        pods, rv = self.list_pods()
        for pod in pods:
            self.handle(pod)
        self.resource_version = rv
        return rv

    def watch_once(self, rv: str, stop_event: Optional[threading.Event] = None) -> str:
        """One watch request from ``rv`` (server timeout ``watchTimeoutSeconds``); handles
        ADDED/MODIFIED pods; returns the last resourceVersion seen. Raises ``Gone`` on 410."""
        kw = {
            "field_selector": self.field_selector,
            "resource_version": rv,
            "watch": True,
            "timeout_seconds": self.config.kubernetes.watch_timeout_seconds,
            "allow_watch_bookmarks": True,
            "_preload_content": False,
        }
        if self.label_selector:
            kw["label_selector"] = self.label_selector
        self.stats["watches"] += 1
        from kubernetes.client.exceptions import ApiException

        try:
            # the read timeout guards against a connection that died silently
            resp = self.api.list_pod_for_all_namespaces(
                _request_timeout=(10, self.config.kubernetes.watch_timeout_seconds + 30), **kw
            )
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e)) from e
            raise
        with self._state_lock:
            self._resp = resp
            closed = self._closed
        try:
            if closed:
                return rv
            for line in _lines(resp):
                ev = json.loads(line)
                typ, obj = ev.get("type"), ev.get("object") or {}
                if typ == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise Gone(obj.get("message", "410 Gone"))
                    raise RuntimeError(
                        f"watch ERROR {code} {obj.get('reason')}: {obj.get('message')}"
                    )
                if typ in ("ADDED", "MODIFIED"):
                    self.handle(obj)
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = self.resource_version = new_rv
                if self._closed or (stop_event is not None and stop_event.is_set()):
                    break
        except Exception:
            if self._closed:  # close() cut the read
                return rv
            raise
        finally:
            with self._state_lock:
                self._resp = None
            resp.close()
            resp.release_conn()
        return rv

    def run(self, stop_event: Optional[threading.Event] = None, retry_s: float = 5.0) -> None:
        """List, then watch from the list's resourceVersion until ``stop_event`` is set;
        re-list after 410 Gone; after any other API error wait ``retry_s`` and re-list."""
        stop_event = stop_event or threading.Event()
        while not (stop_event.is_set() or self._closed):
            try:
                rv = self.relist()
                while not (stop_event.is_set() or self._closed):
                    rv = self.watch_once(rv, stop_event)
            except Gone as e:
                self.stats["gone"] += 1
                log.info("watch expired (%s); re-listing", e)
            except Exception as e:
                if self._closed:
                    break
                log.warning(
                    "pod watch failed (%s: %s); retrying in %.0f s", type(e).__name__, e, retry_s
                )
                stop_event.wait(retry_s)


def _lines(resp):
    """Non-empty lines of a streamed (chunked) response, as they arrive."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line.decode("utf-8", "replace")
    if buf.strip():
        yield buf.decode("utf-8", "replace")


def _cut(resp) -> None:
    """Shut the socket of a streamed response down from another thread: the read blocked
    in it returns (urllib3 >= 2.3 ``HTTPResponse.shutdown``; else close it)."""
    try:
        if hasattr(resp, "shutdown"):
            resp.shutdown()
        else:
            resp.close()
    except Exception:
        pass


def _notes(items) -> str:
    """``"; note: A; note: B"`` for a result's notes/warnings (strings, or dicts with a
    ``message``), else ""."""
    out = []
    for n in items or []:
        text = n.get("message") or n.get("text") or str(n) if isinstance(n, dict) else str(n)
        if text:
            out.append(f"; note: {text}")
    return "".join(out)


def _ref(pod: dict) -> str:
    m = pod.get("metadata") or {}
    return f"{m.get('namespace')}/{m.get('name')}"


def build_watcher(
    config: AgentConfig, actions=None, *, api_client=None, resolver=None
) -> PodWatcher:
    """A ``PodWatcher`` for ``config.kubernetes`` (see :func:`run_watcher`)."""
    k = config.kubernetes
    if not k.enabled:
        raise ValueError("kubernetes.enabled is false: the pod watcher is off")
    node = k.node_name or os.environ.get("NODE_NAME", "")
    if not node:
        raise ValueError("kubernetes.nodeName: unknown (set it or NODE_NAME)")
    if actions is None:
        from cuinterpose.agent.kube.actions import AgentActions

        storage = None
        if "://" in config.snapshot_dir:  # an object store: its settings, read once here
            from cuinterpose.agent.snapshot import trust
            from cuinterpose.agent.snapshot.backends import awsconf
            from cuinterpose.agent.snapshot.backends.api import StorageOptions

            storage = StorageOptions(s3=awsconf.resolve(), node_key=trust.node_key())
        actions = AgentActions(config, storage=storage)
    return PodWatcher(
        config, node, api_client or make_api_client(config), actions, resolver=resolver
    )


def run_watcher(
    config: AgentConfig,
    actions=None,
    stop_event: Optional[threading.Event] = None,
    *,
    api_client=None,
    resolver=None,
) -> PodWatcher:
    """Run the pod watcher of ``config.kubernetes`` until ``stop_event`` is set (forever when
    None); returns the watcher when it stops. ``actions`` defaults to ``AgentActions(config)``
    (the agent's checkpoint/restore in this process). A running request always finishes; a
    watch request in progress ends at its server timeout (``watchTimeoutSeconds``) or the next
    event, so callers that must stop sooner run this in a daemon thread and wait for
    ``watcher.in_flight`` to be empty. Raises ``ValueError`` when ``kubernetes.enabled`` is
    false or no node name is known."""
    w = build_watcher(config, actions, api_client=api_client, resolver=resolver)
    log.info("watching pods on node %s", w.node_name)
    w.run(stop_event)
    return w
