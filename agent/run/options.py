"""Every option and environment variable a checkpoint reads later, checked before its first step
that changes anything (issue 23: ``CUINTERPOSE_GPU_STORAGE=bogus checkpoint --leave-running``
quiesced, tore the shared memory down and only then failed at the native checkpoint, exit 4,
instead of a refusal). :func:`check_checkpoint` resolves each one the way the step that uses it
will (the same functions), so a value the step would refuse is refused here: ``AgentError``
phase "request", outcome ``refused`` (exit 3), naming the option or variable and the value,
before the images dir is created or the workload is asked anything. Request fields (pids,
paths, timeouts) are agent/validate.py's.
"""

from __future__ import annotations

import math
import os

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import native, native_storage
from cuinterpose.agent.run import carriers

__all__ = ["check_checkpoint"]

#: values ``$CUINTERPOSE_INCREMENTAL`` may hold ("1": every checkpoint is incremental)
INCREMENTAL_VALUES = ("", "0", "1")


def _seconds_env(name: str) -> None:
    """``$name``, when set, is a finite number of seconds above 0 and below a day."""
    raw = os.environ.get(name, "")
    if raw == "":
        return
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (0 < v < 86400):
        raise ValueError(f"${name}={raw!r}: must be a number of seconds above 0 and below 86400")


def _incremental() -> None:
    raw = os.environ.get(carriers.INCREMENTAL_ENV, "")
    if raw not in INCREMENTAL_VALUES:
        raise ValueError(f"${carriers.INCREMENTAL_ENV}={raw!r}: must be 1, 0 or unset")


def _criu_timeout() -> None:
    from cuinterpose.agent.mech import criu_run

    criu_run.criu_timeout_s()


def _drop_reply() -> None:
    from cuinterpose.coordinator import client

    client.parse_drop_reply(os.environ.get(client.DROP_REPLY_ENV, ""))


def _node_key() -> None:
    from cuinterpose.agent.snapshot import trust

    trust.node_key()


def check_checkpoint(cp) -> None:
    """Check every later-read option and variable of the checkpoint ``cp`` (its
    ``gpu_storage_mode``, ``chunks`` and ``driver_kind``, and the environment); raises
    ``AgentError`` (phase "request", refused) naming the first bad one."""
    chunks = dict(getattr(cp, "chunks", None) or {})
    given = {k: chunks.get(k) for k in ("chunk_bytes", "staging_bytes", "writers", "checksum")}
    checks = (
        lambda: native_storage.mode(getattr(cp, "gpu_storage_mode", None)),
        lambda: native.driver_kind(getattr(cp, "driver_kind", None)),
        native.backend_kind,
        lambda: _seconds_env(native.CALL_DEADLINE_ENV),
        _criu_timeout,
        lambda: carriers.settings(**given),
        _incremental,
        _node_key,
        _drop_reply,
    )
    for check in checks:
        try:
            check()
        except (AgentError, ValueError) as e:
            reason = getattr(e, "reason", None) or str(e)
            where = getattr(e, "phase", None)
            raise AgentError(
                "request",
                (f"{where}: " if where and where != "request" else "")
                + f"{reason}; checkpoint refused before anything was changed",
            ) from e
        except Exception as e:  # CriuError (criu_run): not an AgentError subclass
            raise AgentError(
                "request", f"{e}; checkpoint refused before anything was changed"
            ) from e
