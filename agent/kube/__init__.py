"""Kubernetes integration of the node agent: a watcher of this node's pods that turns
``cuinterpose.io/*`` annotations into checkpoints and restores (docs/kubernetes.md).

Entry points: :func:`run_watcher` (part of ``cuinterpose-agent serve``) and
``python -m cuinterpose.agent.kube --config FILE`` (standalone).
"""

from cuinterpose.agent.kube.actions import AgentActions
from cuinterpose.agent.kube.resolver import CgroupResolver, ContainerTree, ResolveError
from cuinterpose.agent.kube.watcher import (
    Gone,
    PodWatcher,
    build_watcher,
    make_api_client,
    run_watcher,
)

__all__ = [
    "AgentActions",
    "CgroupResolver",
    "ContainerTree",
    "Gone",
    "PodWatcher",
    "ResolveError",
    "build_watcher",
    "make_api_client",
    "run_watcher",
]
