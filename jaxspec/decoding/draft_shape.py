"""The draft shape: how many tokens a speculative cycle drafts and verifies, as one value.

A cycle runs `num_steps` drafter steps. Each step expands the `topk` best children of every frontier node
(`topk` = 1: a chain), and the target verifies `num_draft_tokens` nodes of the resulting tree in one forward, the
root (the last committed token) included. A chain is the case `topk` == 1, where `num_draft_tokens` is always
`num_steps` + 1; `num_steps` == 0 is plain decoding (one target step per cycle, no drafter).

This module is plain Python (no jax), so the serving scheduler can hold and serialise shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_NUM_STEPS = 16
MAX_TOPK = 16
MAX_DRAFT_TOKENS = 64  # tree nodes verified per cycle (the root included)


def num_candidates(topk: int, num_steps: int) -> int:
    """Candidates a draft of `num_steps` steps holds: topk from the root, then topk**2 per further step."""
    return topk + (num_steps - 1) * topk * topk if num_steps else 0


def _int(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an integer in [{low}, {high}]{hint}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, order=True)
class DraftShape:
    """A cycle's static draft shape. `DraftShape(3)` is a chain of depth 3, `DraftShape(0)` plain decoding,
    `DraftShape(4, topk=2, num_draft_tokens=8)` a tree. `num_draft_tokens=None` means: a chain's num_steps + 1, or
    every candidate of a tree (capped at MAX_DRAFT_TOKENS). After construction `num_draft_tokens` is always set."""

    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self):
        steps = _int("num_steps", self.num_steps, 0, MAX_NUM_STEPS, " (0 = plain decoding)")
        topk = _int("topk", self.topk, 1, MAX_TOPK, " (1 = a chain)")
        if topk > 1 and steps == 0:
            raise ValueError(f"topk={topk} drafts a tree: it needs num_steps >= 1 (num_steps=0 is plain decoding)")
        tokens = self.num_draft_tokens
        if topk == 1:
            if tokens is not None and tokens != steps + 1:
                raise ValueError(
                    f"num_draft_tokens: a chain (topk=1) verifies num_steps + 1 = {steps + 1} tokens, got {tokens!r} "
                    f"(set topk > 1 for a tree)"
                )
            tokens = steps + 1
        else:
            most = min(num_candidates(topk, steps) + 1, MAX_DRAFT_TOKENS)
            if tokens is None:
                tokens = most
            _int(
                "num_draft_tokens",
                tokens,
                2,
                most,
                f" (the root plus at most topk + (num_steps - 1) * topk**2 = {num_candidates(topk, steps)} "
                f"candidates, verified tokens capped at {MAX_DRAFT_TOKENS})",
            )
        object.__setattr__(self, "num_draft_tokens", tokens)

    @classmethod
    def of(cls, value: DraftShape | int) -> DraftShape:
        """A shape, or a chain's depth as an int."""
        return value if isinstance(value, DraftShape) else cls(value)

    @property
    def tree(self) -> bool:
        return self.topk > 1

    @property
    def plain(self) -> bool:
        """No drafting: one target step per cycle."""
        return self.num_steps == 0

    @property
    def verify_tokens(self) -> int:
        """Tokens one verify step takes: num_steps + 1 for a chain, num_draft_tokens for a tree."""
        return self.num_draft_tokens  # type: ignore[return-value]  # always set by __post_init__

    @property
    def lookahead(self) -> int:
        """Cache slots past a row's committed length that one cycle may write (verify, draft-extend)."""
        return max(self.num_steps + 1, self.verify_tokens)

    def reach(self, tokens: int, budget: int, cycles: int | None = None) -> int:
        """Positions [0, reach) a row drafting this shape can touch: the one rule for what a row needs (serving's
        admission and block growth, the HTTP layer's default budget, `generate`'s buffer and its
        context check). `tokens`: the row's prompt and generated tokens (its pending token included); `budget`: its
        prompt plus its max new tokens; `cycles`: the cycles to come (None: as many as its budget takes). A cycle
        commits at most num_steps + 1 tokens and writes `lookahead` cache slots past its row's length; a row at its
        budget writes no further."""
        whole = budget + self.lookahead + 1
        if cycles is None:
            return whole
        return min(tokens + (cycles - 1) * (self.num_steps + 1) + self.lookahead + 1, whole)

    @property
    def label(self) -> str:
        """The shape's name in tables, messages and metrics: `k=3` for a chain, `tree 4x2/8` for a tree."""
        return f"tree {self.num_steps}x{self.topk}/{self.num_draft_tokens}" if self.tree else f"k={self.num_steps}"

    @property
    def spec(self) -> str:
        """The `STEPS:TOPK:TOKENS` form `parse` reads back."""
        return f"{self.num_steps}:{self.topk}:{self.num_draft_tokens}"

    def check_drafter(self, draft_vocab_size: int) -> DraftShape:
        """Refuse a tree whose `topk` exceeds the drafter's vocabulary; returns self."""
        if self.tree and self.topk > draft_vocab_size:
            raise ValueError(f"topk: expected at most the draft vocabulary ({draft_vocab_size}), got {self.topk}")
        return self

    @classmethod
    def parse(cls, text: str) -> DraftShape:
        """`K` (a chain), `STEPS:TOPK:TOKENS`, or a label (`k=3`, `tree 4x2/8`, `4x2/8`)."""
        raw = text.strip().removeprefix("tree").removeprefix("k=").strip()
        parts = raw.replace("x", ":").replace("/", ":").split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"draft shape {text!r}: expected K or STEPS:TOPK:TOKENS, e.g. 3 or 4:2:8") from None
        if len(values) == 1:
            return cls(values[0])
        if len(values) != 3:
            raise ValueError(f"draft shape {text!r}: expected K or STEPS:TOPK:TOKENS, e.g. 3 or 4:2:8")
        return cls(*values)

    def to_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps, "topk": self.topk, "num_draft_tokens": self.verify_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftShape:
        return cls(int(d["num_steps"]), int(d.get("topk", 1)), d.get("num_draft_tokens"))
