"""What the pod watcher runs for a request: the node agent's checkpoint and restore, in-process.

An *actions* object has two methods (tests pass their own):

- ``checkpoint(pod, snapshot_name, *, roots, images_dir, leave_running) -> dict``: checkpoint
  the trees under ``roots`` (host pids, list of int) into ``images_dir`` (absolute path, new or
  empty); returns the manifest (``snapshot_id``, ``roots``, ``cuda_pids``, ...).
- ``restore(pod, snapshot, *, images_dir, into_pid=None, into_start_time=None) -> dict``:
  restore the snapshot named ``snapshot`` from ``images_dir``; with ``into_pid`` (a host pid:
  the placeholder container's init, whose ``/proc/PID/stat`` start time was
  ``into_start_time`` when the watcher resolved it) the restored trees join that process's
  cgroups, namespaces and stdio (``cuinterpose.agent.mech.placement.Placement``); a pid that no
  longer has that start time (reused while the request waited for the node) is refused;
  returns ``{"snapshot_id", "roots", "cuda_pids", ...}``.

Both raise on failure; an ``AgentError`` (``phase``, ``pid``, ``reason``, ``outcome``) is
written to the pod as it is, any other exception as ``"<kind>: <type>: <text>"``.
"""

from __future__ import annotations

from cuinterpose.agent.config import AgentConfig


class AgentActions:
    """The default actions: ``cuinterpose.agent.run.checkpoint.checkpoint`` and
    ``cuinterpose.agent.run.restore.restore`` with the config's driver, control directory and
    timeouts (empty ones: the agent's defaults, ``$CUINTERPOSE_DRIVER`` /
    ``$CUINTERPOSE_CONTROL_DIR``; a restore uses the driver kind the manifest records).

    ``service``: the daemon's ``AgentService`` when the watcher runs inside ``serve``; each
    request then runs through ``service.run_local``: under the node lock that gRPC requests
    hold too (a pod request and a gRPC checkpoint/restore never run at once) and counted in
    the daemon's metrics. Without it (``python -m cuinterpose.agent.kube``) they run as they
    are, one at a time in the watcher's thread."""

    def __init__(self, config: AgentConfig, service=None, storage=None):
        self.config = config
        self.service = service
        #: how an ``s3://`` snapshotDir is reached (the daemon's, else ``storage``)
        self.storage = storage if service is None else service.opts.storage

    def _remote(self, images_dir: str, kind: str):
        """The agent/run/remote.py ``Remote`` of ``images_dir`` (None for a local one)."""
        from cuinterpose.agent.run import remote

        if self.service is not None:
            return self.service.remote_for(images_dir, kind)
        return remote.make(
            images_dir,
            self.storage,
            kind=kind,
            staging_root=self.config.staging_dir or None,
        )

    def _run(self, kind: str, pod: dict, name: str, work):
        if self.service is None:
            return work(None)
        m = pod.get("metadata") or {}
        return self.service.run_local(
            kind, f"the {kind} {name} of pod {m.get('namespace')}/{m.get('name')}", work
        )

    def checkpoint(
        self, pod: dict, snapshot_name: str, *, roots, images_dir, leave_running: bool = False
    ) -> dict:
        from cuinterpose.agent.run import checkpoint as checkpoint_mod

        c = self.config
        where = self._remote(images_dir, "checkpoint")
        return self._run(
            "checkpoint",
            pod,
            snapshot_name,
            lambda rep: checkpoint_mod.checkpoint(
                roots,
                where.local_dir if where is not None else images_dir,
                remote=where,
                control_dir=c.control_dir or None,
                driver=c.driver or None,
                quiesce_timeout_ms=c.quiesce_timeout_ms,
                lock_timeout_ms=c.lock_timeout_ms,
                phase_timeout_s=c.phase_timeout_s,
                carrier_timeout_s=c.carrier_timeout_s,
                leave_running=leave_running,
                reporter=rep,
            ),
        )

    def restore(
        self, pod: dict, snapshot: str, *, images_dir, into_pid=None, into_start_time=None
    ) -> dict:
        from cuinterpose.agent.run import restore as restore_mod

        c = self.config

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
            where = self._remote(images_dir, "restore")
            rs = restore_mod.Restore(
                where.local_dir if where is not None else images_dir,
                remote=where,
                driver=c.driver or None,
                phase_timeout_s=c.phase_timeout_s,
                carrier_timeout_s=c.carrier_timeout_s,
                reporter=rep,
                placement=placement,
            )
            try:
                return rs.run()
            finally:
                rs.release_store()  # a downloaded copy goes

        return self._run("restore", pod, snapshot, work)
