"""The torchmp launcher: the process-tree root (it imports torch for its queues' reductions but
makes no device call). It starts the job's ranks with ``torch.multiprocessing``'s spawn context,
answers the workload contract for the whole tree (workloads/mpcontract.py), and prints the
summary. See docs/torchmp.md for the options, the events and the checks of the summary.
"""

from __future__ import annotations

import argparse
import os

from .. import mpcontract, stacks
from . import collective, decode, stream


def parse(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m cuinterpose.workloads.torchmp", description=__doc__)
    p.add_argument("--job", choices=("stream", "decode", "collective"), default="stream")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--cuinit",
        action="store_true",
        help="with --device cpu: each rank calls cuInit all the same (a rehearsal under the shim)",
    )
    p.add_argument(
        "--hold-at",
        type=int,
        default=0,
        help="stream: the producer stops after "
        "sending H; decode: the decoder stops after token H; until a quiesce",
    )
    g = p.add_argument_group("stream (--steps and --elems: collective too)")
    g.add_argument("--consumers", type=int, default=1)
    g.add_argument("--steps", type=int, default=60, help="tensors sent, numbered 1..S")
    g.add_argument("--elems", type=int, default=1 << 14, help="int64 elements per tensor")
    g.add_argument("--hold", type=int, default=2, help="tensors a consumer keeps referenced")
    g.add_argument("--consumer-hold-at", type=int, default=0, help="each consumer stops after C")
    g.add_argument("--step-delay-ms", type=float, default=1.0)
    p.add_argument(
        "--reinit",
        action="store_true",
        help="collective: destroy the process group before each park, make a new one after",
    )
    g = p.add_argument_group("decode")
    g.add_argument("--tokens", type=int, default=300)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g = p.add_argument_group("deadlines (seconds)")
    g.add_argument("--peer-timeout-s", type=float, default=300.0)
    g.add_argument("--answer-timeout-s", type=float, default=300.0)
    g.add_argument("--park-timeout-s", type=float, default=600.0)
    a = p.parse_args(argv)
    if a.consumers < 1 or a.steps < 1 or a.elems < 1 or a.tokens < 1:
        p.error("--consumers, --steps, --elems and --tokens must be at least 1")
    if a.hidden % a.heads:
        p.error("--hidden must be a multiple of --heads")
    return {k.replace("-", "_"): v for k, v in vars(a).items()}


def start(cfg: dict, launch_t: float):
    """The job's ranks (stream: producer, consumer0..; decode: decoder, sink) and the queues
    between them (returned: kept alive by the caller)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    if cfg["job"] == "stream":
        specs = [("producer", lambda c: ctx.Process(target=stream.produce, args=(cfg, q, acks, c)))]
        specs += [
            (
                f"consumer{i}",
                lambda c, i=i: ctx.Process(target=stream.consume, args=(cfg, i, q, acks, c)),
            )
            for i in range(cfg["consumers"])
        ]
    elif cfg["job"] == "collective":
        store = os.path.join(os.getcwd(), f"torchmp-store-{os.getpid()}")
        specs = [("rank0", lambda c: ctx.Process(target=collective.run, args=(cfg, store, c)))]
    else:
        specs = [
            (
                "decoder",
                lambda c: ctx.Process(target=decode.decoder, args=(cfg, q, acks, c, launch_t)),
            ),
            ("sink", lambda c: ctx.Process(target=decode.sink, args=(cfg, q, acks, c))),
        ]
    return mpcontract.Ranks(cfg, ctx, specs), (q, acks)


def summary(cfg: dict, ranks: mpcontract.Ranks, quiesces: list[dict]) -> dict:
    problems = list(ranks.failed)
    out: dict = {"job": cfg["job"], "device": cfg["device"]}
    if cfg["job"] == "stream":
        sent = ranks.done.get("producer", {}).get("sent")
        got = sorted(
            s for r, d in ranks.done.items() if r != "producer" for s in d.get("received", [])
        )
        want = list(range(1, cfg["steps"] + 1))
        if sent != cfg["steps"]:
            problems.append(f"the producer sent {sent} tensors, not {cfg['steps']}")
        if got != want:
            missing = sorted(set(want) - set(got))[:8]
            problems.append(
                f"tensors received {len(got)} times ({len(got) - len(set(got))} "
                f"duplicated), missing {missing}"
            )
        failed = sum(d.get("failed", 0) for d in ranks.done.values())
        if failed:
            problems.append(
                f"{failed} payloads wrong: "
                + "; ".join(f for d in ranks.done.values() for f in d.get("failures", []))
            )
        out.update(sent=sent, received_once=got == want, failed_payloads=failed)
    elif cfg["job"] == "collective":
        r0 = ranks.done.get("rank0", {})
        if r0.get("steps") != cfg["steps"] or r0.get("wrong"):
            problems.append(
                f"all-reduce: {r0.get('steps')} of {cfg['steps']} steps, wrong at {r0.get('wrong_steps')}"
            )
        out.update(steps=r0.get("steps"), wrong=r0.get("wrong"), groups=r0.get("groups"))
    else:
        dec, snk = ranks.done.get("decoder", {}), ranks.done.get("sink", {})
        tokens = dec.get("tokens", [])
        if len(tokens) != cfg["tokens"]:
            problems.append(f"the decoder made {len(tokens)} tokens, not {cfg['tokens']}")
        if snk.get("tokens") != tokens:
            problems.append(
                "the sink's argmax of the logits it received differs from the "
                f"decoder's tokens ({snk.get('digest')} != {dec.get('digest')})"
            )
        problems += snk.get("gaps", [])
        out.update(tokens=tokens, digest=dec.get("digest"), sink_agrees=snk.get("tokens") == tokens)
    if not all(q["vas_identical"] for q in quiesces):
        problems.append("a tensor's address changed across a quiesce")
    exits = ranks.exits()
    problems += [f"{r} exited {c}" for r, c in exits.items() if c != 0]
    out.update(
        ok=not problems,
        problems=problems,
        quiesces=quiesces,
        restores_seen=sum(q["restored"] for q in quiesces),
        rank_exit=exits,
    )
    return out


def main(argv=None) -> int:
    launch_t = decode.proc_start_t(os.getpid())  # the interpreter's start: cold start counts it
    cfg = parse(argv)
    stacks.on_signal()
    if cfg["device"] == "cuda":  # deterministic cuBLAS (torch.use_deterministic_algorithms)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ranks, _queues = start(cfg, launch_t)
    emit(
        "setup",
        ranks=[{"role": r, "pid": p.pid} for r, p in zip(ranks.roles, ranks.procs)],
        config=cfg,
    )
    s = summary(cfg, ranks, mpcontract.serve(ranks))
    emit("summary", **s)
    return 0 if s["ok"] else 1


def emit(event: str, **kw) -> None:
    mpcontract.emit("launcher", event, **kw)
