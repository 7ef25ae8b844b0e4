"""The ``decode`` job: a small decoder-only transformer (transformers' ``LlamaForCausalLM``
built from a config, weights from ``torch.manual_seed(seed)``: nothing downloaded) decodes
greedily, token by token with its KV cache, in the ``decoder`` process; each step's last-position
logits (float32 [vocab], on the device) go to the ``sink`` process through a
``torch.multiprocessing`` queue, which takes their argmax. Both report the token sequence; they
must agree, and a run cut and restored must equal an uninterrupted one, token for token.

Events of the decoder: ``cold`` once, before its first token (wall-clock seconds since the epoch
of: the launcher's start ``launch_t``, this process's start ``proc_t``, after ``import torch``
and transformers ``import_t``, after the device context ``ctx_t``, after the model build
``build_t``, after one warm-up forward ``warm_t``); ``token`` for every token (``i``, ``token``,
``t`` wall clock).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time

from .rank import Rank

PROMPT = [1, 17, 42, 7, 99, 3, 250, 12]  # token ids of the fixed prompt


def proc_start_t(pid: int) -> float:
    """Wall-clock start of process ``pid`` (proc(5): stat field 22 in clock ticks after boot)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def kv_cache(out):
    """The KV cache a forward returned, by either name (``cache``, formerly ``past_key_values``:
    the output's field and the forward's argument were renamed in one release, but a version
    that renamed only one must not fail here)."""
    for name in ("cache", "past_key_values"):
        got = getattr(out, name, None)
        if got is not None:
            return got
    raise KeyError(f"no KV cache in the model's output (fields: {list(out.keys())})")


def build(torch, cfg: dict, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["hidden"] * 2,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=len(PROMPT) + cfg["tokens"] + 8,
        # weights 5x the default spread: the greedy tokens wander (283 distinct of 300 on the
        # CPU with the default seed) instead of repeating a few, so a cut that lost state shows
        initializer_range=0.1,
    )
    torch.manual_seed(cfg["seed"])
    return LlamaForCausalLM(mc).to(device=dev, dtype=torch.float32).eval()


def decoder(cfg: dict, q, acks, conn, launch_t: float) -> None:
    Rank(cfg, "decoder", conn).main(lambda rank: _decode(rank, cfg, q, acks, launch_t))


def _decode(rank: Rank, cfg: dict, q, acks, launch_t: float) -> dict:
    torch = rank.torch
    cold = {"launch_t": launch_t, "proc_t": proc_start_t(os.getpid())}
    import transformers  # noqa: F401  (timed with torch's import)

    cold["import_t"] = time.time()
    torch.zeros(1, device=rank.dev).add_(1)  # the context (CUDA: the primary context)
    rank.synchronize()
    cold["ctx_t"] = time.time()
    model = build(torch, cfg, rank.dev)
    cold["build_t"] = time.time()
    tokens: list[int] = []
    # transformers 5.x renamed the KV cache argument and output from ``past_key_values`` to
    # ``cache`` (the old name warns, then goes): use whichever this version's forward takes
    new_name = "cache" in inspect.signature(model.forward).parameters
    key = "cache" if new_name else "past_key_values"
    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=rank.dev)
        model(input_ids=ids, use_cache=True)  # warm-up: the kernels' first launch
        rank.synchronize()
        cold["warm_t"] = time.time()
        rank.emit("cold", **cold)
        out = model(input_ids=ids, use_cache=True)
        while len(tokens) < cfg["tokens"]:
            if not rank.ready(len(tokens), cfg["hold_at"]):
                continue
            logits = out.logits[0, -1].detach().clone()
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            q.put((len(tokens), logits))
            rank.sent = len(tokens)
            rank.emit("token", i=len(tokens), token=tok, t=time.time(), restored=rank.restored)
            nxt = torch.tensor([[tok]], device=rank.dev)
            out = model(input_ids=nxt, use_cache=True, **{key: kv_cache(out)})
            rank.progressed()
    q.put(None)
    rank.await_ends(acks, 1, "the sink to end")  # the logits' producer outlives their use
    rank.synchronize()
    return {"tokens": tokens, "digest": tokens_digest(tokens)}


def sink(cfg: dict, q, acks, conn) -> None:
    Rank(cfg, "sink", conn).main(lambda rank: _sink(rank, q, acks))


def _sink(rank: Rank, q, acks) -> dict:
    torch = rank.torch
    tokens: list[int] = []
    gaps = []
    while True:
        item = rank.next_item(q, what="the decoder's next logits")
        if item is None:
            break
        i, logits = item
        if i != len(tokens) + 1:
            gaps.append(f"logits {i} after {len(tokens)}")
        tokens.append(int(torch.argmax(logits)))
        del logits, item  # the decoder's memory: released before the next one comes
        rank.received = len(tokens)
    rank.synchronize()
    acks.put(rank.role)
    return {"tokens": tokens, "digest": tokens_digest(tokens), "gaps": gaps[:8]}
