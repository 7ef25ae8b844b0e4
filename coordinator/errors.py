"""Base error of the coordinator (results.PhaseError and topology.TopologyError derive from it)."""

from __future__ import annotations


class CoordinatorError(Exception):
    """A coordinator step failed.

    ``phase``: the op name ("INSPECT", "RESTORE_UNICAST", ...); ``pid``: the participant at
    fault, or None; ``changed``: False when nothing was changed in any shim.
    """

    phase: str | None = None
    pid: int | None = None
    changed: bool = False
