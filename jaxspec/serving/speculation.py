"""What speculation did for one request (one choice): its counts, kept by the scheduler as the executor reads each
row back, and the `metrics.speculative_decoding` object a response carries them in (vLLM's names and shape, so
aiperf reads them; docs/serving.md). Plain Python (no jax).

A row's counters on the device (`LoopState.row_cycles_B`, `row_accepted_BJ`) run from its admission; the scheduler
reads them with the row's tokens after every step and adds what they gained to the request, under the draft shape of
the step's segment (the only cycles a step runs). A preempted request keeps what it had: its resumed row starts at
zero again, and recomputing its tokens is a prefill, which counts nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jaxspec.decoding.draft_shape import DraftShape


def shape_name(shape: DraftShape) -> str:
    """A draft shape as the response names it: "plain", "chain k=3" or "tree 4x2/8"."""
    return "plain" if shape.plain else shape.label if shape.tree else f"chain {shape.label}"


@dataclasses.dataclass(frozen=True)
class Speculation:
    """One request's speculation. A verify step is a cycle that drafted (plain cycles are counted under their shape
    only, as vLLM counts a step only when it scheduled drafts); `accepted[j]`: steps that accepted the draft at
    position j + 1 (so a step that accepted t drafts counts positions 1..t); `drafted`: draft tokens verified (a
    chain's k, a tree's nodes past the root, per step); `shapes`: cycles per draft shape (`shape_name`). Positions run
    to `depth`, the deepest draft the server runs."""

    depth: int
    steps: int = 0
    accepted: tuple[int, ...] = ()
    drafted: int = 0
    shapes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if not self.accepted:
            object.__setattr__(self, "accepted", (0,) * self.depth)
        if len(self.accepted) != self.depth:
            raise ValueError(f"Speculation.accepted: expected {self.depth} positions, got {self.accepted}")

    def plus(self, shape: DraftShape, cycles: int, accepted: Sequence[int]) -> Speculation:
        """These counts and `cycles` more cycles of `shape` that accepted `accepted` (per position) among them."""
        if cycles < 0 or len(accepted) != self.depth or min(accepted, default=0) < 0:
            raise ValueError(f"Speculation.plus: expected counts gained, got {cycles} cycles, accepted {accepted}")
        if not cycles:
            return self
        shapes = dict(self.shapes)
        name = shape_name(shape)
        shapes[name] = shapes.get(name, 0) + cycles
        steps = 0 if shape.plain else cycles
        return Speculation(
            self.depth,
            self.steps + steps,
            tuple(a + b for a, b in zip(self.accepted, accepted, strict=True)),
            self.drafted + steps * (shape.verify_tokens - 1),
            tuple(shapes.items()),
        )

    @classmethod
    def total(cls, parts: Iterable[Speculation]) -> Speculation:
        """The counts of several choices together (a response's root object)."""
        parts = list(parts)
        out = cls(parts[0].depth if parts else 0)
        for p in parts:
            shapes = dict(out.shapes)
            for name, cycles in p.shapes:
                shapes[name] = shapes.get(name, 0) + cycles
            accepted = tuple(a + b for a, b in zip(out.accepted, p.accepted, strict=True))
            out = cls(out.depth, out.steps + p.steps, accepted, out.drafted + p.drafted, tuple(shapes.items()))
        return out

    @property
    def histogram(self) -> list[int]:
        """Steps that accepted exactly t drafts, t = 0..depth (exact: a step accepted at least t drafts iff it
        accepted position t's)."""
        at_least = [self.steps, *self.accepted, 0]
        return [at_least[t] - at_least[t + 1] for t in range(self.depth + 1)]

    def to_dict(self) -> dict[str, Any]:
        """vLLM's `metrics.speculative_decoding` object (its summary level), plus `num_accepted_tokens_per_pos` (the
        name of vLLM's per-position counter) and `draft_shapes` (cycles per draft shape, plain ones included)."""
        accepted = sum(self.accepted)
        return {
            "mean_acceptance_length": 1 + accepted / self.steps if self.steps else 1.0,
            "draft_acceptance_rate": accepted / self.drafted if self.drafted else 0.0,
            "acceptance_histogram": self.histogram,
            "num_spec_steps": self.steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": self.drafted,
            "num_spec_tokens": self.depth,
            "num_accepted_tokens_per_pos": list(self.accepted),
            "draft_shapes": dict(self.shapes),
        }
