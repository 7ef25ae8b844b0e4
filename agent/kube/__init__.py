"""Kubernetes integration of the node agent: a watcher of this node's pods that turns
``cuinterpose.io/*`` annotations into checkpoints and restores (docs/kubernetes.md).

Entry points: :func:`run_watcher` (part of ``cuinterpose-agent serve``) and
``python -m cuinterpose.agent.kube --config FILE`` (standalone).
"""
from .watcher import Gone, PodWatcher, build_watcher, make_api_client, run_watcher
from .resolver import CgroupResolver, ContainerTree, ResolveError
from .actions import AgentActions

__all__ = ["AgentActions", "CgroupResolver", "ContainerTree", "Gone", "PodWatcher", "ResolveError",
           "build_watcher", "make_api_client", "run_watcher"]
