"""The step-count calculus: which draft shape pays off.

Pure numpy. With a_j the conditional acceptance of draft position j (given positions 1..j-1 were accepted; for a tree,
P(the accepted path reaches depth j | it reached depth j-1)):

    E(shape) = 1 + sum_{j<=num_steps} prod_{i<=j} a_i   expected tokens per cycle and sequence
    T(shape) = t_draft + t_verify + t_extend + t_other   the cycle's phases, each timed alone
    R(shape) = batch E / T,   speedup S = R / R0,   R0 = batch / t_decode,   shape* = argmax R

The phases of a shape (`DraftShape`: num_steps S, topk K, verify_tokens T, the root included):
- draft: a chain runs S - 1 drafter steps (its first draft token comes out of the previous cycle's draft-extend, so
  not S as in the spec's formula); a tree's whole draft (the root's top-K, then S - 1 drafter steps over the K
  frontier nodes, each expanding it).
- verify: one target forward over the T tokens (a tree's under its ancestor mask); plain decoding (S = 0) verifies one
  token without capturing target states, i.e. a decode step.
- extend: draft-extend over the S + 1 slots of the accepted path (the same program for a chain and a tree); none for
  plain decoding.
- other: the bookkeeping outside the model calls (accept, commit, counters; a tree also keeps its T best nodes and
  compacts the target cache).

The model is one table keyed by shape (`CostModel.phases`, `CostModel.acceptance`). A shape that was not measured is
fitted phase by phase: affine in the number that phase scales with, over the measured shapes that run the same
program (`_FITS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxspec.decoding.draft_shape import DraftShape

GAP_TOLERANCE = 0.10
PHASES = ("draft", "verify", "extend", "other")
# `jaxspec tune --trees default`: the shapes that did best per verified token on the bundled pair at batch 1
# (benchmarks/results/tree_vs_chain.md).
DEFAULT_TREES = (DraftShape(3, 2, 5), DraftShape(3, 2, 7), DraftShape(4, 2, 8), DraftShape(3, 3, 8))


def conditional_acceptance(reached: Sequence[int], accepted: Sequence[int]) -> np.ndarray:
    """a_j = accepted_j / reached_j per draft position (the loop's on-device counters); NaN where never reached."""
    r, a = np.asarray(reached, np.float64), np.asarray(accepted, np.float64)
    if r.shape != a.shape or r.ndim != 1:
        raise ValueError(f"reached/accepted: expected two 1-D arrays of equal length, got {r.shape} and {a.shape}")
    if np.any(a > r) or np.any(a < 0):
        raise ValueError(
            f"accepted must be in [0, reached] per position; got reached={r.tolist()}, accepted={a.tolist()}"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(r > 0, a / np.where(r > 0, r, 1), np.nan)


def pool_counters(runs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum (reached, accepted) counters of several runs (of any depths) position by position."""
    runs = list(runs)
    depth = max((len(r) for r, _ in runs), default=0)
    reached, accepted = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
    for r, a in runs:
        reached[: len(r)] += np.asarray(r, np.int64)
        accepted[: len(a)] += np.asarray(a, np.int64)
    return reached, accepted


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i. Positions without a measurement (NaN) or beyond the given ones count
    as never accepted."""
    if k < 0:
        raise ValueError(f"k: expected >= 0 draft tokens, got {k}")
    a = np.nan_to_num(np.asarray(acceptance, np.float64)[:k], nan=0.0)
    a = np.pad(a, (0, k - len(a)))
    return float(1.0 + np.cumprod(a).sum())


def draft_steps(shape: DraftShape) -> int:
    """Drafter steps per cycle: the first draft token (a tree's first level) comes out of the previous draft-extend."""
    return max(shape.num_steps - 1, 0)


# For a shape missing from the table, each phase is fitted over the measured shapes that run the same program:
# phase -> (does a measured shape run the same program, the number the phase's seconds are affine in).
_FITS: dict[str, tuple[Callable[[DraftShape, DraftShape], bool], Callable[[DraftShape], int]]] = {
    "draft": (lambda m, s: not m.plain and m.topk == s.topk, lambda s: s.num_steps),  # one step of K nodes each
    "verify": (lambda m, s: not m.plain and m.tree == s.tree, lambda s: s.verify_tokens),  # causal or tree mask
    "extend": (lambda m, s: not m.plain, lambda s: s.num_steps),  # over the num_steps + 1 path slots
    "other": (lambda m, s: m.tree == s.tree, lambda s: s.verify_tokens),
}


@dataclasses.dataclass
class CostModel:
    """Measured phase seconds and acceptance per draft shape; predicts throughput for any shape.

    `phases`: {DraftShape: {"draft": s, "verify": s, "extend": s, "other": s}}, one cycle of that shape (the module
    docstring says what each phase holds). `acceptance`: {DraftShape: conditional rates per draft position (a chain)
    or depth (a tree)}; a chain missing there takes the rates of the deepest chain there (a chain's a_j is a property
    of the drafter on the text, not of k: the tuner pools every chain's counters), a tree must be measured.
    `t_decode`: one plain decode step (R0; also plain decoding's verify when DraftShape(0) is not in `phases`).
    `batch`: sequences per cycle the times were measured at.
    """

    t_decode: float
    phases: Mapping[DraftShape, Mapping[str, float]]
    acceptance: Mapping[DraftShape, Sequence[float]] = dataclasses.field(default_factory=dict)
    batch: int = 1

    def expected_tokens(self, shape: DraftShape | int) -> float:
        shape = DraftShape.of(shape)
        if shape.plain:
            return 1.0
        rates = self.acceptance.get(shape)
        if rates is None and not shape.tree:
            chains = [m for m in self.acceptance if not m.tree and not m.plain]
            rates = self.acceptance[max(chains)] if chains else None
        if rates is None:
            have = [m.label for m in self.acceptance]
            raise ValueError(f"{shape.label}: no acceptance measured (have {have})")
        return expected_tokens(rates, shape.num_steps)

    def terms(self, shape: DraftShape | int) -> dict[str, float]:
        """The cycle-time terms of a shape, in seconds: measured, or fitted over the measured shapes (`_FITS`)."""
        shape = DraftShape.of(shape)
        if shape in self.phases:
            return {phase: float(self.phases[shape][phase]) for phase in PHASES}
        fixed = {"draft": 0.0, "verify": self.t_decode, "extend": 0.0} if shape.plain else {}
        return {phase: fixed[phase] if phase in fixed else self._fit(shape, phase) for phase in PHASES}

    def _fit(self, shape: DraftShape, phase: str) -> float:
        same, x = _FITS[phase]
        points = {x(m): float(t[phase]) for m, t in self.phases.items() if same(m, shape)}
        if len(points) < 2:
            raise ValueError(
                f"{phase}: no time for {shape.label} (measured: {[m.label for m in self.phases]}); give two shapes "
                f"that run its program to fit it"
            )
        # Affine through the measured points (collective latency makes the intercept large).
        slope, intercept = np.polyfit(list(points), list(points.values()), 1)
        return float(intercept + slope * x(shape))

    def cycle_time(self, shape: DraftShape | int) -> float:
        """T(shape) in seconds."""
        return sum(self.terms(shape).values())

    def predict(self, shape: DraftShape | int) -> float:
        """R(shape): tokens per second (all `batch` sequences together)."""
        return self.batch * self.expected_tokens(shape) / self.cycle_time(shape)

    def baseline(self) -> float:
        """R0 = batch / t_decode."""
        return self.batch / self.t_decode

    def speedup(self, shape: DraftShape | int) -> float:
        return self.predict(shape) / self.baseline()

    def best(self, shapes: Iterable[DraftShape | int]) -> DraftShape:
        """The shape of highest predicted throughput; the first given on ties."""
        shapes = [DraftShape.of(s) for s in shapes]
        if not shapes:
            raise ValueError("best: no draft shapes given")
        rates = [self.predict(s) for s in shapes]
        return shapes[int(np.argmax(rates))]


def relative_gap(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    if not measured > 0:
        raise ValueError(f"measured: expected a positive value, got {measured}")
    return (predicted - measured) / measured


def explain_gap(
    predicted: float,
    measured: float,
    terms: Mapping[str, tuple[float, float]],
    tolerance: float = GAP_TOLERANCE,
) -> str | None:
    """None when |predicted - measured| / measured <= tolerance; otherwise a sentence naming the term whose predicted
    value is furthest (relatively) from its measured value. `terms`: name -> (predicted, measured), e.g.
    {"tokens per cycle E(k)": (E_pred, E_meas), "cycle ms T(k)": (T_pred, T_meas)}."""
    gap = relative_gap(predicted, measured)
    if abs(gap) <= tolerance:
        return None
    if not terms:
        return f"predicted {predicted:.4g} vs measured {measured:.4g} ({gap:+.1%}); no terms given to attribute it"
    rel = {name: (p - m) / m if m else float("inf") for name, (p, m) in terms.items()}
    worst = max(rel, key=lambda n: abs(rel[n]))
    p, m = terms[worst]
    return (
        f"predicted {predicted:.4g} vs measured {measured:.4g} ({gap:+.1%}): {worst} is off "
        f"(model {p:.4g}, measured {m:.4g}, {rel[worst]:+.1%})"
    )
