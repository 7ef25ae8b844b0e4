"""``python -m cuinterpose.agent.kube --config FILE [--node NAME]``: the pod watcher alone.

Exit codes: 0 stopped by SIGINT/SIGTERM (after a running request finished), 1 the watcher
thread died, 2 bad configuration (the message names the key).
``--api-server URL`` overrides ``kubernetes.apiServer`` (tests), ``--node`` the node name.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading

from cuinterpose.agent.config import ConfigError, load_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cuinterpose.agent.kube",
        description="Watch this node's pods for cuinterpose.io annotations.",
    )
    p.add_argument("--config", required=True, help="agent YAML configuration file")
    p.add_argument("--node", help="node name (default: kubernetes.nodeName, then $NODE_NAME)")
    p.add_argument("--api-server", help="plain http(s) API URL without credentials (tests)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if a.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        print(f"cuinterpose.agent.kube: config {a.config}: {e}", file=sys.stderr)
        return 2
    k = cfg.kubernetes
    k = dataclasses.replace(
        k, enabled=True, node_name=a.node or k.node_name, api_server=a.api_server or k.api_server
    )
    cfg = dataclasses.replace(cfg, kubernetes=k)
    # the agent never runs under the shim; helpers (CRIU) must not inherit it either
    from cuinterpose.agent.run.checkpoint import strip_preload_env

    strip_preload_env()
    # before any thread: the node's cgroup paths (agent/kube/hostcgroup.py)
    from cuinterpose.agent.kube.hostcgroup import join_and_log

    join_and_log()
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.kube.watcher import build_watcher

    try:
        w = build_watcher(cfg)  # the node's options: the config's over the environment
    except (ValueError, AgentError) as e:
        print(f"cuinterpose.agent.kube: {e}", file=sys.stderr)
        return 2
    # the watch blocks in a socket read: run it in a daemon thread, and on a signal close the
    # watcher (a running checkpoint/restore finishes, none starts, the read is cut)
    t = threading.Thread(target=w.run, args=(stop,), name="pod-watcher", daemon=True)
    t.start()
    while not stop.wait(0.5):
        if not t.is_alive():
            return 1
    w.close()
    t.join(10)
    return 0


if __name__ == "__main__":
    rc = main()
    # leave without interpreter finalization: the watcher is a daemon thread that may sit in a
    # socket read (or the driver's library may still have threads) and tearing the interpreter
    # down under it can abort; nothing is running at this point (in_flight was empty)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
