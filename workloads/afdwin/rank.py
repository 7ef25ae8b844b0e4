"""One afdwin rank process: window setup on driver VMM, then the attention or FFN loop.

Started by the launcher as ``python -m cuinterpose.workloads.afdwin.rank --connect SOCK
--rank I``; everything else arrives in the launcher's ``config`` message. The rank never
writes stdout: events go to the launcher over the socket. Exit status 0 when every invariant
this rank can see held, 1 on a failed invariant or error, 2 when the launcher went away.

The roles are attention.py and ffn.py, both on rank_base.py (which combines window.py, the
window and its checks, and control.py, the launcher messages and the quiesce handling).
Single-threaded on purpose: control messages are read between driver calls, so a parked rank
is provably not inside CUDA.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

from .attention import AttentionRank
from .config import Config
from .control import Abort
from .ffn import FfnRank
from .window import GeometryError
from .wire import Channel, ChannelClosed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cuinterpose.workloads.afdwin.rank")
    ap.add_argument("--connect", required=True, help="launcher's rendezvous socket path")
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.connect)
    chan = Channel(sock)
    chan.send({"type": "hello", "rank": args.rank, "pid": os.getpid()})
    r = None
    try:
        msg, _ = chan.recv()
        if msg["type"] != "config":
            raise RuntimeError(f"expected config, got {msg['type']!r}")
        cfg = Config(**msg["config"])
        cls = AttentionRank if cfg.role(args.rank) == "attention" else FfnRank
        r = cls(chan, args.rank, cfg, msg.get("host_memory", "auto"))
        r.main()
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except ChannelClosed:
        print(f"afdwin rank {args.rank}: launcher went away", file=sys.stderr)
        return 2
    except (Abort, GeometryError) as e:
        print(f"afdwin rank {args.rank}: {e}", file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - report every failure to the launcher
        traceback.print_exc()
        try:
            chan.send({"type": "error", "rank": args.rank, "message": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
