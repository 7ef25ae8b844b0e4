"""Run configuration and geometry profiles (docs/afdwin.md "Command line", ``--profile``).

Profiles (per-rank sizes; F = number of FFN ranks):

- ``ci``: 4 experts per FFN rank, token_cap 16, hidden 64, 2-byte items, topk 2, shared experts
  (shared_cap = ceil(token_cap / F)); slots of a few KiB.
- ``gpu``: DeepSeek-V2-Lite-like 1A1F sizes: 64 experts in total (64 / F per rank), token_cap 512,
  hidden 2048, 2-byte items (bf16-sized), topk 6, shared experts; ~4 MiB slots.
"""

from __future__ import annotations

import dataclasses

from .layout import SlotLayout, WindowLayout

PROFILES = {
    "ci": dict(
        total_experts=None,
        experts_per_rank=4,
        token_cap=16,
        hidden_size=64,
        payload_itemsize=2,
        topk=2,
        shared=True,
    ),
    "gpu": dict(
        total_experts=64,
        experts_per_rank=None,
        token_cap=512,
        hidden_size=2048,
        payload_itemsize=2,
        topk=6,
        shared=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a rank needs to build its window and run the protocol.

    world: number of ranks (N); attention: attention ranks (world ranks 0..attention-1), the
    rest are FFN ranks; steps: dispatch steps per attention rank (S); ring_depth: D;
    step_delay_ms: minimum gap between two steps issued by one attention rank; seed: payload seed.
    Raises ``ValueError`` for an unknown profile or a world without both roles.
    """

    world: int = 2
    attention: int = 1
    steps: int = 100
    ring_depth: int = 2
    profile: str = "ci"
    step_delay_ms: float = 0.0
    seed: int = 0
    stages: int = 0  # live stages K (0 = ring_depth); stage k owns rings r = k mod K
    # diagnostic knobs (documented CLI flags, docs/afdwin.md "Diagnostic flags")
    no_drain: int = 0  # 1: quiesce without the drain (FFN parks at once, attention parks
    # with a reply wait enqueued): the checkpoint must fail, not corrupt
    pending_at_cut: int = 0  # 1: at a quiesce each attention rank dispatches its next step and
    # stops before its combine: the cut carries a landed, unread reply
    delay_zero_ms: float = 0.0  # delay this rank's window zeroing (fence test)
    multicast: int = 0  # 1: also a multicast region over the ranks (docs/afdwin.md
    # "--multicast"): written by rank 0, read back by every rank
    hold_at: tuple = ()  # --hold-at: an attention rank issues step hold_at[k] + 1 only once it
    # has seen quiesce k + 1 (docs/afdwin.md "--hold-at"); () = never hold
    # test-only knobs (set per rank with the launcher's hidden --test-override RANK:FIELD=N)
    corrupt_step: int = 0  # attention: write step N with magic 0 (expect torn, exit 1)
    no_fence: int = 0  # 1: skip the fence barrier (zero + sync only, as pre-review);
    # with delay_zero_ms on one rank a peer's first write is erased

    def __post_init__(self):
        object.__setattr__(self, "hold_at", tuple(int(h) for h in self.hold_at))  # JSON: a list
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; choose from {sorted(PROFILES)}")
        if not (1 <= self.attention < self.world):
            raise ValueError(
                f"need 1 <= attention < ranks, got attention={self.attention} ranks={self.world}"
            )
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.ring_depth < 1:
            raise ValueError(f"ring_depth must be >= 1, got {self.ring_depth}")
        if self.stages < 0:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.num_stages > self.ring_depth:
            raise ValueError(
                f"ring_depth {self.ring_depth} < stages {self.num_stages}: stages "
                f"own disjoint rings, so ring_depth must be >= stages"
            )
        if self.ring_depth % self.num_stages:
            raise ValueError(
                f"ring_depth {self.ring_depth} is not a multiple of stages "
                f"{self.num_stages}: stage k owns the rings r = k mod stages and "
                f"step s uses ring (s - 1) mod ring_depth"
            )
        if self.no_drain and self.pending_at_cut:
            raise ValueError("no_drain and pending_at_cut are exclusive")
        if self.delay_zero_ms < 0:
            raise ValueError(f"delay_zero_ms must be >= 0, got {self.delay_zero_ms}")
        holds = self.hold_at
        if any(not 1 <= h <= self.steps for h in holds) or list(holds) != sorted(set(holds)):
            raise ValueError(
                f"--hold-at needs increasing steps within 1..{self.steps} (the steps), "
                f"got {','.join(map(str, holds))}"
            )

    def hold_before(self, s: int, quiesces: int) -> int | None:
        """The hold step that keeps step ``s`` from being issued by a rank that has seen
        ``quiesces`` quiesces: the first hold_at[k] < s with k >= quiesces; None if none."""
        for k, h in enumerate(self.hold_at):
            if h < s and quiesces <= k:
                return h
        return None

    @property
    def num_stages(self) -> int:
        """K: live stages per attention rank (``stages``, or ring_depth when 0)."""
        return self.stages or self.ring_depth

    def stage_of(self, s: int) -> int:
        """Stage that issues step ``s`` (>= 1): (s - 1) mod K."""
        return (s - 1) % self.num_stages

    def stage_rings(self, k: int) -> list[int]:
        """Rings owned by stage ``k``: r = k mod K (disjoint across stages)."""
        return [r for r in range(self.ring_depth) if r % self.num_stages == k]

    @property
    def ffn(self) -> int:
        return self.world - self.attention

    def role(self, rank: int) -> str:
        """ "attention" or "ffn" for a world rank."""
        return "attention" if rank < self.attention else "ffn"

    def role_rank(self, rank: int) -> int:
        """Index within the rank's role (attention role rank, or FFN role rank)."""
        return rank if rank < self.attention else rank - self.attention

    @property
    def experts_per_rank(self) -> int:
        p = PROFILES[self.profile]
        if p["experts_per_rank"] is not None:
            return p["experts_per_rank"]
        return -(-p["total_experts"] // self.ffn)

    @property
    def topk(self) -> int:
        return min(PROFILES[self.profile]["topk"], self.experts_per_rank * self.ffn)

    def window_layout(self) -> WindowLayout:
        """The window every rank of this run allocates (num_regions = max(attention, ffn))."""
        p = PROFILES[self.profile]
        token_cap = p["token_cap"]
        shared_cap = -(-token_cap // self.ffn) if p["shared"] else 0
        slot = SlotLayout(
            experts_per_rank=self.experts_per_rank,
            partial_cap=token_cap * self.topk,
            token_cap=token_cap,
            shared_cap=shared_cap,
            hidden_size=p["hidden_size"],
            payload_itemsize=p["payload_itemsize"],
        )
        return WindowLayout(
            slot=slot, num_regions=max(self.attention, self.ffn), ring_depth=self.ring_depth
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
