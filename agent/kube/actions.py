"""What the pod watcher runs for a request: the node agent's checkpoint and restore, in-process,
through the same entry as the command line (agent/run/ops.py).

An *actions* object has two methods (tests pass their own):

- ``checkpoint(pod, snapshot_name, *, roots, images_dir, options) -> dict``: checkpoint the
  trees under ``roots`` (host pids, list of int) into ``images_dir`` (absolute path, new or
  empty) with ``options`` (the options the pod's annotations set: {option name: value},
  ``leave_running`` always there; agent/kube/annotations.py ``option_values``); returns
  ``{"snapshot_id", "roots", "cuda_pids", "warnings", ...}`` (the CLI's ``--json`` object).
- ``restore(pod, snapshot, *, images_dir, into_pid=None, into_start_time=None, options)
  -> dict``: restore the snapshot named ``snapshot`` from ``images_dir`` with ``options`` (as
  above); with ``into_pid`` (a host pid: the placeholder container's init, whose
  ``/proc/PID/stat`` start time was ``into_start_time`` when the watcher resolved it) the
  restored trees join that process's cgroups, namespaces and stdio
  (``cuinterpose.agent.mech.placement.Placement``); a pid that no longer has that start time
  (reused while the request waited for the node) is refused; returns ``{"snapshot_id",
  "roots", "cuda_pids", "notes", ...}``.

Both raise on failure; an ``AgentError`` (``phase``, ``pid``, ``reason``, ``outcome``) is
written to the pod as it is, any other exception as ``"<kind>: <type>: <text>"``.
"""

from __future__ import annotations

import os
from typing import Optional

from cuinterpose.agent import options as options_mod
from cuinterpose.agent.config import AgentConfig
from cuinterpose.agent.kube import annotations as A


class AgentActions:
    """The default actions: ``cuinterpose.agent.run.ops.checkpoint`` and ``.restore`` with the
    node's options (``options``, by request kind: the daemon's when the watcher runs inside
    ``serve``, else the config's ``driver``, ``controlDir`` and timeouts over the environment;
    a restore uses the driver kind the manifest records) and the pod's annotations over them,
    built once per request.

    ``service``: the daemon's ``AgentService`` when the watcher runs inside ``serve``; each
    request then runs through ``service.run_local``: under the node lock that gRPC requests
    hold too (a pod request and a gRPC checkpoint/restore never run at once) and counted in
    the daemon's metrics. Without it (``python -m cuinterpose.agent.kube``) they run as they
    are, one at a time in the watcher's thread."""

    def __init__(
        self,
        config: AgentConfig,
        service=None,
        options: Optional[dict] = None,
        storage=None,
    ):
        self.config = config
        self.service = service
        if options is None:
            options = (
                service.opts.options
                if service is not None
                else options_mod.for_kinds(config.option_values(), os.environ)
            )
        #: the node's options by request kind (agent/options.py ``for_kinds``)
        self.options = options
        #: how an ``s3://`` snapshotDir is reached (the daemon's, else ``storage``)
        self.storage = storage if service is None else service.opts.storage

    def request_options(self, kind: str, values: Optional[dict]):
        """The options of one pod request: the node's with the pod's ``values`` (option name
        -> value) over them; an error names each value's annotation."""
        values = dict(values or {})
        labels = {n: A.option_key(kind, n) for n in values}
        return options_mod.BY_KIND[kind].build(self.options[kind], values, labels)

    def remote_for(self, images_dir: str, kind: str, opts):
        """The agent/run/remote.py ``Remote`` of ``images_dir`` (None for a local one)."""
        from cuinterpose.agent.run import remote

        if self.service is not None:
            return self.service.remote_for(images_dir, kind, opts)
        return remote.make(
            images_dir,
            self.storage,
            kind=kind,
            local_dir=opts.local_dir,
            staging_root=self.config.staging_dir or None,
            keep_local=opts.keep_local,
        )

    def _run(self, kind: str, pod: dict, name: str, work):
        from cuinterpose.agent.run.report import Reporter

        if self.service is None:
            return work(Reporter())
        m = pod.get("metadata") or {}
        return self.service.run_local(
            kind, f"the {kind} {name} of pod {m.get('namespace')}/{m.get('name')}", work
        )

    def checkpoint(
        self, pod: dict, snapshot_name: str, *, roots, images_dir, options: Optional[dict] = None
    ) -> dict:
        from cuinterpose.agent.run import ops

        opts = self.request_options("checkpoint", options)
        where = self.remote_for(images_dir, "checkpoint", opts)
        return self._run(
            "checkpoint",
            pod,
            snapshot_name,
            lambda rep: ops.checkpoint(rep, roots, images_dir, opts, where)[0],
        )

    def restore(
        self,
        pod: dict,
        snapshot: str,
        *,
        images_dir,
        into_pid=None,
        into_start_time=None,
        options: Optional[dict] = None,
    ) -> dict:
        from cuinterpose.agent.run import ops

        opts = self.request_options("restore", options)

        def work(rep):
            placement = into_pid or None
            if into_pid and into_start_time is not None:
                from cuinterpose.agent.mech.placement import Placement, PlacementError

                placement = Placement.of_pid(into_pid)
                if placement.start_time != into_start_time:
                    raise PlacementError(
                        f"is not the placeholder's process any more (started at tick "
                        f"{placement.start_time}, the placeholder's init at "
                        f"{into_start_time}): its pid was reused; nothing was done",
                        pid=into_pid,
                    )
            where = self.remote_for(images_dir, "restore", opts)
            return ops.restore(rep, images_dir, opts, where, placement=placement)

        return self._run("restore", pod, snapshot, work)
