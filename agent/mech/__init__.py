"""Mechanisms the steps drive, each in its own module: ``census`` (which processes take part),
``quiesce`` (the agent's side of the workload contract), ``native`` (``cuCheckpointProcess*``),
``criu`` (dump and restore; ``criu_binary``, ``criu_child``, ``criu_run``, ``criu_images``
beside it), ``mntns`` (CRIU in another mount namespace), ``placement`` and ``inherit``
(restoring into a running process), ``fds`` (a tree's descriptors and mounts), ``procfs``
(every /proc parser) and ``libc`` (the ctypes calls). They import ``errors``, ``paths``,
``snapshot``, ``cuinterpose.coordinator`` and each other, never ``run``, ``rpc`` or ``cli``."""
