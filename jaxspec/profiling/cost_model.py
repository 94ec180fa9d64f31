"""The step-count calculus (see shared/spec/cost-model.md): how many draft tokens per cycle pay off.

Pure numpy. With a_j the conditional acceptance of draft position j (given positions 1..j-1 were accepted):

    E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i           expected tokens per cycle and sequence
    T(k) = steps(k) t_draft + t_verify(k+1) + t_extend(k+1) + t_other
    R(k) = batch E(k) / T(k),   speedup S(k) = R(k) / R0,   R0 = batch / t_decode,   k* = argmax_k R(k)

In jaxspec's loop the first draft token of a cycle comes out of the previous cycle's draft-extend pass, so a cycle
runs k-1 drafter steps (`steps(k) = max(k-1, 0)`), not k as in the spec's formula, and k = 0 (plain decoding) runs
neither draft steps nor draft-extend and verifies one token without capturing target states (= a decode step).

Trees (`TreeShape`: num_steps S, topk K, num_draft_tokens T, the root included) have their own terms:

    T(tree) = t_tree_draft(S, K) + t_tree_verify(T) + t_extend(S + 1) + t_tree_other(S, K, T)
    E(tree) = 1 + sum_{d<=S} prod_{i<=d} a_i(tree)      a_d(tree): P(the accepted path reaches depth d | depth d-1)

The tree draft is timed whole (the root's top-K, then S - 1 drafter steps over the K frontier nodes, each expanding
it); verify is a function of the node count T (affine between measured counts, like a chain's); draft-extend runs
over the S + 1 slots of the longest path (the chain's extend of S + 1 tokens); t_tree_other is the tree's
bookkeeping (keep the T best nodes, accept a path, commit, compact the target cache, count). A tree's per-depth rates
are its own: they depend on K and T, so unlike a chain's they are not pooled across configurations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

GAP_TOLERANCE = 0.10


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


def acceptance_from_throughput(tok_s: Sequence[float], cycle_s: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Invert measurements of depths k = 1, 2, .. (tokens/s and cycle seconds at each depth) into tokens per cycle E(k)
    and the implied conditional rates a_k = (E(k) - E(k-1)) / (E(k-1) - E(k-2)) (with E(0) = 1, E(-1) = 0)."""
    e = np.asarray(tok_s, np.float64) * np.asarray(cycle_s, np.float64)
    prev = np.concatenate([[0.0, 1.0], e])
    marginal = np.diff(prev)[1:]  # prod_{i<=k} a_i = E(k) - E(k-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = marginal / np.concatenate([[1.0], marginal[:-1]])
    return e, rates


PhaseTime = Mapping[int, float] | Callable[[int], float]


@dataclasses.dataclass(frozen=True, order=True)
class TreeShape:
    """A tree draft's static shape: `num_steps` drafter levels, `topk` children per frontier node, `num_draft_tokens`
    nodes verified (the root included)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        if self.num_steps < 1 or self.topk < 2 or self.num_draft_tokens < 2:
            raise ValueError(
                f"TreeShape: expected num_steps >= 1, topk >= 2 and num_draft_tokens >= 2 (topk = 1 is a chain: give "
                f"its depth k), got {self.num_steps}, {self.topk}, {self.num_draft_tokens}"
            )

    @property
    def label(self) -> str:
        """`steps x topk / tokens`, e.g. 4x2/8."""
        return f"{self.num_steps}x{self.topk}/{self.num_draft_tokens}"

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`STEPS:TOPK:TOKENS` (or the label form `STEPSxTOPK/TOKENS`)."""
        parts = text.strip().replace("x", ":").replace("/", ":").split(":")
        try:
            steps, topk, tokens = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"tree shape {text!r}: expected STEPS:TOPK:TOKENS, e.g. 4:2:8") from None
        return cls(steps, topk, tokens)


Config = int | TreeShape  # a chain's depth k (0 = plain decoding), or a tree
# `jaxspec tune --trees default`: the shapes that did best per verified token on the bundled pair at batch 1
# (benchmarks/results/tree_vs_chain.md).
DEFAULT_TREES = (TreeShape(3, 2, 5), TreeShape(3, 2, 7), TreeShape(4, 2, 8), TreeShape(3, 3, 8))


def _lookup(table: float | PhaseTime, n: int, name: str) -> float:
    if isinstance(table, int | float):  # the same at every token count
        return float(table)
    if callable(table):
        return float(table(n))
    if n in table:
        return float(table[n])
    keys = sorted(table)
    if len(keys) < 2:
        raise ValueError(f"{name}: no time for {n} tokens (have {keys}); give at least two to interpolate")
    # Affine fit through the measured token counts (collective latency makes the intercept large).
    slope, intercept = np.polyfit(keys, [table[x] for x in keys], 1)
    return float(intercept + slope * n)


def _lookup_steps(table: Mapping[tuple[int, int], float], shape: TreeShape) -> float:
    """A tree draft's seconds: measured at (num_steps, topk), or affine in num_steps over the measured ones of that
    topk (each step costs the same: one drafter pass over the topk frontier nodes)."""
    key = (shape.num_steps, shape.topk)
    if key in table:
        return float(table[key])
    same_k = {s: t for (s, k), t in table.items() if k == shape.topk}
    if len(same_k) < 2:
        raise ValueError(
            f"t_tree_draft: no time for {key} (have {sorted(table)}); give two step counts of topk {key[1]}"
        )
    return _lookup(same_k, shape.num_steps, "t_tree_draft")


@dataclasses.dataclass
class CostModel:
    """Measured phase times (seconds) and per-position acceptance; predicts throughput per draft configuration
    (a chain depth k, or a `TreeShape`).

    `t_verify` / `t_extend`: seconds as a function of the token count (a dict {tokens: s}, affine extrapolation
    outside it, or a callable). `t_decode`: one plain decode step (also k = 0's verify). `t_other`: per-cycle cost
    outside the model calls (accept, commit, counters): seconds, or like `t_verify` a function of k+1 tokens.
    `batch`: sequences per cycle the times were measured at.

    Trees (the module docstring): `t_tree_draft` {(num_steps, topk): s}, `t_tree_verify` like `t_verify` but of the
    node count under the tree mask, `t_tree_other` {TreeShape: s}, `tree_acceptance` {TreeShape: per-depth rates}.
    """

    t_draft: float
    t_verify: PhaseTime
    t_extend: PhaseTime
    t_decode: float
    acceptance: Sequence[float] = ()
    t_other: float | PhaseTime = 0.0
    batch: int = 1
    t_tree_draft: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    t_tree_verify: PhaseTime = dataclasses.field(default_factory=dict)
    t_tree_other: Mapping[TreeShape, float] = dataclasses.field(default_factory=dict)
    tree_acceptance: Mapping[TreeShape, Sequence[float]] = dataclasses.field(default_factory=dict)

    def draft_steps(self, k: Config) -> int:
        """Drafter steps per cycle: the first draft token (a tree's first level) comes out of the previous
        draft-extend."""
        if isinstance(k, TreeShape):
            return k.num_steps - 1
        return max(k - 1, 0)

    def expected_tokens(self, k: Config) -> float:
        if isinstance(k, TreeShape):
            if k not in self.tree_acceptance:
                raise ValueError(
                    f"tree {k.label}: no acceptance measured (have {[t.label for t in self.tree_acceptance]})"
                )
            return expected_tokens(self.tree_acceptance[k], k.num_steps)
        return expected_tokens(self.acceptance, k)

    def terms(self, k: Config) -> dict[str, float]:
        """The cycle-time terms of a chain of depth k or a tree, in seconds."""
        if isinstance(k, TreeShape):
            draft = _lookup_steps(self.t_tree_draft, k)
            if k not in self.t_tree_other:
                raise ValueError(f"t_tree_other: no time for tree {k.label}")
            return {
                "draft": draft,
                "verify": _lookup(self.t_tree_verify, k.num_draft_tokens, "t_tree_verify"),
                "extend": _lookup(self.t_extend, k.num_steps + 1, "t_extend"),
                "other": float(self.t_tree_other[k]),
            }
        if k < 0:
            raise ValueError(f"k: expected >= 0 draft tokens, got {k}")
        return {
            "draft": self.draft_steps(k) * self.t_draft,
            "verify": _lookup(self.t_verify, k + 1, "t_verify") if k else self.t_decode,
            "extend": _lookup(self.t_extend, k + 1, "t_extend") if k else 0.0,
            "other": _lookup(self.t_other, k + 1, "t_other"),
        }

    def cycle_time(self, k: Config) -> float:
        """T(k) in seconds."""
        return sum(self.terms(k).values())

    def predict(self, k: Config) -> float:
        """R(k): tokens per second (all `batch` sequences together)."""
        return self.batch * self.expected_tokens(k) / self.cycle_time(k)

    def baseline(self) -> float:
        """R0 = batch / t_decode."""
        return self.batch / self.t_decode

    def speedup(self, k: Config) -> float:
        return self.predict(k) / self.baseline()

    def best_k(self, ks: Iterable[int]) -> int:
        """k* = argmax R(k) over the chain depths `ks` (the smallest k on ties)."""
        ks = list(ks)
        if not ks:
            raise ValueError("best_k: no depths given")
        return self.best(ks)

    def best(self, configs: Iterable[Config]) -> Config:
        """The configuration (chain depth or tree) of highest predicted throughput; the first given on ties."""
        configs = list(configs)
        if not configs:
            raise ValueError("best: no configurations given")
        rates = [self.predict(c) for c in configs]
        return configs[int(np.argmax(rates))]


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
