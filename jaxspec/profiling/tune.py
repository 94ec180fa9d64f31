"""`jaxspec tune`: sweep draft shapes (`DraftShape`s: chains of depth k, and tree shapes), run the real loop for each,
time every phase alone, fit the cost model and recommend the shape of highest predicted throughput (`recommended`;
`recommended_k` is the best chain).

Measurement design (timings on shared machines drift by 10-20% over seconds, far more than the model's terms):
- Each k runs `jaxspec.generate` with a progress hook every `stream_cycles` cycles. Right after each chunk of cycles,
  the phases of that k (verify and draft-extend of k+1 tokens, a drafter step; a plain decode step for k = 0) are
  timed alone, so every measured chunk has its phase times taken under the same machine conditions.
- Only steady chunks count: after the first (which holds prefill and the first cycles) and while every prompt is
  still generating (a finished prompt leaves its batch row idle, which the model does not describe). The time spent
  timing phases is excluded from the chunk's seconds.
- E(k) comes from the per-position acceptance counters of those same steady chunks, pooled over all k (a_j is a
  property of the drafter on this text, not of k).
- The sweep runs `repeats` rounds over all k, alternating the order, so slow drift hits every k alike; per k the
  chunks of all rounds are pooled.
- Trees are swept the same way, in the same rounds, with their own phases (cost_model.py's module docstring): the
  whole tree draft, verify of its nodes under the tree mask, draft-extend over its deepest path, its bookkeeping. A
  tree's per-depth acceptance comes from its own steady chunks (it depends on topk and num_draft_tokens, so it is not
  pooled with the chains' or other trees'); its prediction tests the cycle-time side of the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.generate import MIN_PROMPT_BUCKET, LoopCache, bucket, generate
from jaxspec.profiling.cost_model import (
    DEFAULT_TREES,
    GAP_TOLERANCE,
    CostModel,
    conditional_acceptance,
    draft_steps,
    explain_gap,
    pool_counters,
    relative_gap,
)
from jaxspec.profiling.timing import PhaseTimer

DEFAULT_PROMPTS = ((1, 17, 42, 7, 99, 3, 56, 12), (5, 8, 13, 21, 34, 55, 89, 144))
BUNDLED_PROMPTS = 8  # held-out prompts of the bundled pair swept together (one batch)
TABLE_COLUMNS = (
    "draft",
    "draft tokens",
    "verify ms",
    "cycle ms",
    "E(k)",
    "predicted tok/s",
    "measured tok/s",
    "gap",
)


@dataclasses.dataclass
class Chunk:
    """`stream_cycles` cycles of the loop at one shape, all prompts running, and the phases timed right after."""

    seconds: float
    cycles: int
    tokens: int
    reached: np.ndarray
    accepted: np.ndarray
    phases: dict[str, float]  # seconds per call: "other", and "decode" (k = 0) or "verify", "extend" (+ "draft")


def time_phases_of(timer: PhaseTimer, shape: DraftShape, *, reps: int = 1) -> dict[str, float]:
    """Seconds per call of the phases a cycle of `shape` runs (compiled on first use): "other", and "decode" (plain
    decoding) or "verify", "extend" and "draft" (a chain's one drafter step, when it runs one; a tree's whole draft)."""
    T, once = shape.verify_tokens, dict(warmup=0, reps=reps)
    if shape.tree:
        return {
            "other": timer.tree_bookkeeping(shape, **once),
            "draft": timer.tree_draft(shape, **once),
            "verify": timer.tree_verify(T, **once),
            "extend": timer.extend(shape.num_steps + 1, **once),
        }
    out = {"other": timer.bookkeeping(T, **once)}
    if shape.plain:
        return out | {"decode": timer.decode(**once)}
    out |= {"verify": timer.verify(T, **once), "extend": timer.extend(T, **once)}
    if draft_steps(shape):
        out["draft"] = timer.draft_step(**once)
    return out


def steady_chunks(marks: Sequence[tuple[float, Any, dict[str, float], float]]) -> list[Chunk]:
    """Chunks between consecutive progress marks `(chunk end time, Progress, phases timed, time the loop resumed)`:
    from the second mark on (the first chunk holds prefill) up to the first mark at which a prompt has finished.
    A chunk's seconds run from the loop resuming to its end, so the phase timing in between is not counted."""
    chunks = []
    for (_, prev, _, resumed), (end, cur, phases, _) in zip(marks, marks[1:], strict=False):
        if any(cur.done):
            break
        chunks.append(
            Chunk(
                seconds=end - resumed,
                cycles=cur.cycles - prev.cycles,
                tokens=sum(map(len, cur.tokens)) - sum(map(len, prev.tokens)),
                reached=np.asarray(cur.reached) - np.asarray(prev.reached),
                accepted=np.asarray(cur.accepted) - np.asarray(prev.accepted),
                phases=phases,
            )
        )
    return chunks


def run_depth(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    shape: DraftShape,
    timer: PhaseTimer,
    *,
    max_new_tokens: int,
    stream_cycles: int,
    reps: int = 1,
    loops: LoopCache | None = None,
) -> tuple[list[Chunk], dict[str, Any]]:
    """One `generate` run at `shape` with its phases timed after every chunk; returns its steady chunks (see the
    module docstring) and the run's stats. `loops`: the compiled loops to reuse (see `LoopCache`)."""

    marks = []

    def hook(progress) -> None:
        end = time.perf_counter()
        phases = time_phases_of(timer, shape, reps=reps)
        marks.append((end, progress, phases, time.perf_counter()))

    stats = generate(
        target,
        None if shape.plain else drafter,
        prompts,
        draft=shape,
        max_new_tokens=max_new_tokens,
        stream_cycles=stream_cycles,
        on_progress=hook,
        loops=loops,
    ).stats
    return steady_chunks(marks), stats


def parse_trees(text: str) -> list[DraftShape]:
    """`STEPS:TOPK:TOKENS,...` (or labels such as `4x2/8`) as tree shapes, or `default` (DEFAULT_TREES). A field may be
    a range `A-B`: the entry then stands for every tree shape of the product that `DraftShape` accepts (at most
    topk + (steps - 1) topk^2 candidates plus the root, and MAX_DRAFT_TOKENS), e.g. `3-4:2:6-8`. ValueError naming a
    bad entry."""
    if text.strip() == "default":
        return list(DEFAULT_TREES)
    shapes: list[DraftShape] = []
    for part in filter(str.strip, text.split(",")):
        fields = part.strip().split(":")
        if len(fields) != 3 or not any("-" in f for f in fields):
            shape = DraftShape.parse(part)
            if not shape.tree:
                raise ValueError(f"tree shapes {part.strip()!r}: topk = 1 is a chain (chains are swept by depth)")
            shapes.append(shape)
            continue
        fit = [shape for spec in itertools.product(*(_span(f, part) for f in fields)) if (shape := _tree(*spec))]
        if not fit:
            raise ValueError(f"tree shapes {part.strip()!r}: no shape in this range holds its token count")
        shapes += fit
    if not shapes:
        raise ValueError(f"expected STEPS:TOPK:TOKENS,... or 'default', got {text!r}")
    return list(dict.fromkeys(shapes))


def _tree(num_steps: int, topk: int, tokens: int) -> DraftShape | None:
    """The tree shape, or None where DraftShape refuses it or it is a chain."""
    try:
        shape = DraftShape(num_steps, topk, tokens)
    except ValueError:
        return None
    return shape if shape.tree else None


def _span(field: str, part: str) -> range:
    """`A` or `A-B` (inclusive) as a range of positive integers."""
    try:
        low, _, high = field.partition("-")
        low, high = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"tree shapes {part.strip()!r}: expected STEPS:TOPK:TOKENS, each a number or A-B") from None
    if not 1 <= low <= high:
        raise ValueError(f"tree shapes {part.strip()!r}: range {field!r} must be 1 <= A <= B")
    return range(low, high + 1)


def row_shape(row: dict[str, Any]) -> DraftShape:
    """The draft shape of a report row: its `num_steps`/`topk`/`num_draft_tokens` (a chain row of a tune.json from
    before draft shapes holds `k` only)."""
    return DraftShape.from_dict(row) if "num_steps" in row else DraftShape(int(row["k"]))


def report_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of a tuning report (a tune.json from before draft shapes kept its trees in `tree_rows`)."""
    return report["rows"] + report.get("tree_rows", [])


def _phase(chunks: Sequence[Chunk], name: str) -> float:
    """Mean seconds of one phase over the chunks (the measured side is a mean over the same chunks too)."""
    return float(np.mean([c.phases[name] for c in chunks]))


def tune(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    drafts: Iterable[DraftShape | int] = range(0, 5),
    *,
    max_new_tokens: int = 256,
    output_dir: str | Path | None = None,
    collective_preset: str | dict | None = None,
    stream_cycles: int = 4,
    reps: int = 1,
    inner: int = 4,
    repeats: int = 3,
    verbose: bool = True,
) -> dict[str, Any]:
    """Sweep the draft shapes `drafts` (`DraftShape`s, or chain depths as ints) and return (and with `output_dir`,
    write `tune.json` + `tune.png`) the tuning report.

    `repeats` rounds over all shapes; each phase is timed `reps` x `inner` calls after every chunk of
    `stream_cycles` cycles. Raises ValueError when a shape has no steady chunk (every prompt must run at least two
    chunks), or naming the bad argument."""
    shapes, prompts = _check_sweep(drafts, drafter, prompts, repeats)
    sweep = _Sweep(target, drafter, prompts, max_new_tokens, stream_cycles, reps, LoopCache())
    bar = tqdm(total=(repeats + 1) * len(shapes), desc="jaxspec tune", unit="run", disable=not verbose)
    timer_of = sweep.compile(shapes, inner, bar)
    chunks: dict[DraftShape, list[Chunk]] = {s: [] for s in shapes}
    last_stats: dict[DraftShape, dict] = {}
    for round_ in range(repeats):
        for s in shapes if round_ % 2 == 0 else shapes[::-1]:
            bar.set_postfix(draft=s.label, round=round_ + 1)
            got, last_stats[s] = sweep.run(s, timer_of[s])
            chunks[s] += got
            bar.update()
    bar.close()
    empty = [s.label for s in shapes if not chunks[s]]
    if empty:
        raise ValueError(
            f"{', '.join(empty)}: no steady chunk (after the first {stream_cycles} cycles and before any prompt "
            f"finished); raise max_new_tokens (now {max_new_tokens}) or lower stream_cycles"
        )
    counters = {s: pool_counters((c.reached, c.accepted) for c in chunks[s]) for s in shapes}  # per shape
    model = _fit(chunks, counters, timer_of, reps, len(prompts))
    rows = [_row(s, model, _measured(chunks[s], counters[s], last_stats[s], len(prompts))) for s in shapes]
    settings = {"rounds": repeats, "stream_cycles": stream_cycles, "phase_calls_per_chunk": reps * inner}
    setup = _setup(timer_of[shapes[-1]], len(prompts), target, max_new_tokens, collective_preset)
    report = _report(rows, model, _chain_counters(counters), settings) | setup
    if verbose:
        print(format_table(report))
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
        report["plot"] = plot(report, out / "tune.png")
    return report


def _check_sweep(drafts, drafter, prompts, repeats: int) -> tuple[list[DraftShape], list[list[int]]]:
    """The distinct shapes (chains by depth, then trees; the ties of the recommendation go to the first) and the
    prompts as lists of ints, or ValueError naming the bad argument."""
    shapes = []
    for d in drafts:
        try:
            shapes.append(DraftShape.of(d))
        except ValueError as e:
            raise ValueError(f"drafts: {d!r}: {e}") from None
    shapes = sorted(set(shapes), key=lambda s: (s.tree, s))
    if not shapes:
        raise ValueError("drafts: nothing to sweep (give draft shapes or chain depths)")
    if any(not s.plain for s in shapes) and drafter is None:
        raise ValueError("drafts: chains of k > 0 and trees need a drafter (only k = 0 runs without one)")
    for s in shapes if drafter is not None else ():
        try:
            s.check_drafter(drafter.config.draft_vocab_size)
        except ValueError as e:
            raise ValueError(f"drafts: {s.label}: {e}") from None
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt of token ids")
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1 rounds, got {repeats}")
    return shapes, prompts


@dataclasses.dataclass
class _Sweep:
    """What every run of one sweep shares: the pair, the prompts, the run settings and the compiled loops."""

    target: Any
    drafter: Any
    prompts: list[list[int]]
    max_new_tokens: int
    stream_cycles: int
    reps: int
    loops: LoopCache

    def compile(self, shapes: Sequence[DraftShape], inner: int, bar) -> dict[DraftShape, PhaseTimer]:
        """Compile every loop and phase program first: one phase timer per (batch, buffer) bucket the loops use."""
        target, drafter, prompts = self.target, self.drafter, self.prompts
        context = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET) + self.max_new_tokens // 2
        timers: dict[tuple[int, int], PhaseTimer] = {}
        timer_of: dict[DraftShape, PhaseTimer] = {}
        for s in shapes:
            bar.set_postfix(draft=s.label, round="compile")
            first = generate(
                target,
                None if s.plain else drafter,
                prompts,
                draft=s,
                max_new_tokens=self.max_new_tokens,
                loops=self.loops,
            )
            key = (first.stats["buckets"]["batch"], first.stats["buckets"]["buffer"])
            if key not in timers:
                timers[key] = PhaseTimer(target, drafter, batch=key[0], cache_len=key[1], context=context, inner=inner)
            timer_of[s] = timers[key]
            time_phases_of(timer_of[s], s)
            bar.update()
        return timer_of

    def run(self, shape: DraftShape, timer: PhaseTimer) -> tuple[list[Chunk], dict[str, Any]]:
        return run_depth(
            self.target,
            self.drafter,
            self.prompts,
            shape,
            timer,
            max_new_tokens=self.max_new_tokens,
            stream_cycles=self.stream_cycles,
            reps=self.reps,
            loops=self.loops,
        )


def _chain_counters(counters: dict[DraftShape, tuple]) -> tuple[np.ndarray, np.ndarray]:
    """The chains' acceptance counters pooled: position j over every chain of depth >= j."""
    return pool_counters(c for s, c in counters.items() if not s.tree)


def _fit(chunks, counters, timer_of, reps: int, batch: int) -> CostModel:
    """The cost model from the phase times of the steady chunks. A phase's seconds are pooled over the chunks of every
    shape that runs the same program (`_pooled`); a chain's drafter step over every chain that runs one (each of its
    S - 1 steps costs that). The chains' acceptance is pooled over all chains, each tree's is its own."""
    shapes = list(chunks)
    plain = DraftShape(0)
    if plain in chunks:
        t_decode = _phase(chunks[plain], "decode")
    else:
        t_decode = next(iter(timer_of.values())).decode(reps=max(3, reps))
    drafting = [c for s in shapes if not s.tree and draft_steps(s) for c in chunks[s]]
    step = _phase(drafting, "draft") if drafting else 0.0
    verify = _pooled(chunks, "verify", lambda s: (s.tree, s.verify_tokens))  # one program per mask and token count
    extend = _pooled(chunks, "extend", lambda s: s.num_steps + 1)  # a chain's or a tree's path: one program
    tree_draft = _pooled(chunks, "draft", lambda s: (s.num_steps, s.topk), lambda s: s.tree)
    phases = {
        s: {
            "draft": tree_draft[s] if s.tree else draft_steps(s) * step,
            "verify": t_decode if s.plain else verify[s],
            "extend": 0.0 if s.plain else extend[s],
            "other": _phase(chunks[s], "other"),
        }
        for s in shapes
    }
    chain_rates = conditional_acceptance(*_chain_counters(counters))
    acceptance = {s: chain_rates if not s.tree else conditional_acceptance(*counters[s]) for s in shapes}
    return CostModel(t_decode, phases, acceptance, batch)


def _pooled(chunks, phase: str, key, runs=lambda s: not s.plain) -> dict[DraftShape, float]:
    """Per shape that `runs` the phase: its mean seconds over the chunks of every such shape sharing `key(shape)`."""
    groups: dict[Any, list[Chunk]] = {}
    for s in filter(runs, chunks):
        groups.setdefault(key(s), []).extend(chunks[s])
    return {s: _phase(groups[key(s)], phase) for s in filter(runs, chunks)}


def _measured(chunks: list[Chunk], counters, stats: dict[str, Any], prompts: int) -> dict[str, Any]:
    """What the steady chunks of one shape measured."""
    seconds = sum(c.seconds for c in chunks)
    cycles = sum(c.cycles for c in chunks)
    tokens = sum(c.tokens for c in chunks)
    return {
        "acceptance": [float(a) for a in np.nan_to_num(conditional_acceptance(*counters))],
        "stats": stats,
        "chunks": len(chunks),
        "cycle_s": seconds / cycles,
        "tokens_per_cycle": tokens / cycles / prompts,
        "tok_s": tokens / seconds,
        "cycles": cycles,
    }


def _row(shape: DraftShape, model: CostModel, run: dict[str, Any]) -> dict[str, Any]:
    """One row of the report: the model's terms and prediction for the shape next to what was measured."""
    terms = model.terms(shape)
    e_pred, t_pred, r_pred = model.expected_tokens(shape), model.cycle_time(shape), model.predict(shape)
    explanation = explain_gap(
        r_pred,
        run["tok_s"],
        {"tokens per cycle E(k)": (e_pred, run["tokens_per_cycle"]), "cycle time T(k)": (t_pred, run["cycle_s"])},
    )
    return {"draft": shape.label} | shape.to_dict() | {
        "draft_tokens": shape.verify_tokens - 1,
        "draft_steps": draft_steps(shape),
        "draft_ms": terms["draft"] * 1e3,
        "verify_ms": terms["verify"] * 1e3,
        "extend_ms": terms["extend"] * 1e3,
        "other_ms": terms["other"] * 1e3,
        "cycle_ms": t_pred * 1e3,
        "measured_cycle_ms": run["cycle_s"] * 1e3,
        "E": e_pred,
        "measured_E": run["tokens_per_cycle"],
        "predicted_tok_s": r_pred,
        "measured_tok_s": run["tok_s"],
        "predicted_speedup": model.speedup(shape),
        "gap": relative_gap(r_pred, run["tok_s"]),
        "gap_explanation": explanation,
        "measured_acceptance": run["acceptance"],
        "steady_chunks": run["chunks"],
        "steady_cycles": run["cycles"],
        "new_tokens": run["stats"]["new_tokens"],
    }  # fmt: skip


def _report(rows, model: CostModel, chain_counters, settings) -> dict:
    """The tuning report's results (tune.json): the rows, the recommendations and the phases."""
    chains = [r for r in rows if not row_shape(r).tree]
    best = max(rows, key=lambda r: r["predicted_tok_s"])  # the first on ties: chains before trees
    measured_best = max(rows, key=lambda r: r["measured_tok_s"])
    report = {
        "rows": rows,
        "recommended": _named(row_shape(best)),
        "measured_best": _named(row_shape(measured_best)),
        "recommended_within_3pct": best["measured_tok_s"] >= 0.97 * measured_best["measured_tok_s"],
        "gap_tolerance": GAP_TOLERANCE,
        "all_within_tolerance": all(abs(r["gap"]) <= GAP_TOLERANCE for r in rows),
    }
    if chains:  # the best chain (what tune.json files from before tree sweeps held; --presets ranks by it)
        report["recommended_k"] = model.best(row_shape(r) for r in chains).num_steps
        report["measured_best_k"] = row_shape(max(chains, key=lambda r: r["measured_tok_s"])).num_steps
        reached, accepted = chain_counters
        rates = conditional_acceptance(reached, accepted)
        report["acceptance"] = {
            "reached": reached.tolist(),
            "accepted": accepted.tolist(),
            "rate": [None if np.isnan(a) else float(a) for a in rates],
        }
    report["phases_ms"] = {
        "decode": model.t_decode * 1e3,
        "shapes": {s.label: {p: t * 1e3 for p, t in phases.items()} for s, phases in model.phases.items()},
    }
    report["measurement"] = settings | {"pairing": "phases of a shape timed right after every steady chunk"}
    report["baseline_tok_s"] = model.baseline()
    return report


def _named(shape: DraftShape) -> dict[str, Any]:
    """A shape as tune.json records it (what `generate` takes, and its label)."""
    return shape.to_dict() | {"label": shape.label}


def _setup(timer: PhaseTimer, prompts: int, target, max_new_tokens: int, preset) -> dict:
    """What the report was measured on: batch, mesh, --dcp, collective preset, platform and versions."""
    import jaxlib

    return {
        "batch": {"prompts": prompts, "padded": timer.batch, "buffer": timer.cache_len},
        "max_new_tokens": max_new_tokens,
        "mesh": {str(name): int(size) for name, size in target.mesh.shape.items()},
        "dcp": target.dcp,  # the target cache's striping (--dcp)
        "collective_preset": preset.get("name") if isinstance(preset, dict) else preset,
        "collective_preset_record": preset if isinstance(preset, dict) else None,
        "platform": jax.devices()[0].platform,
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__},
    }


def format_table(report: dict[str, Any]) -> str:
    """The sweep as a text table, with the recommendation and any unexplained gaps underneath (also for a tune.json
    from before draft shapes)."""
    lines = [" | ".join(TABLE_COLUMNS)]
    rows = report_rows(report)
    for r in rows:
        lines.append(
            f"{row_shape(r).label} | {r['draft_tokens']} | {r['verify_ms']:.3f} | {r['cycle_ms']:.3f} | {r['E']:.3f} | "
            f"{r['predicted_tok_s']:.1f} | {r['measured_tok_s']:.1f} | {r['gap']:+.1%}"
        )
    if "recommended_k" in report:
        lines.append(f"recommended k = {report['recommended_k']} (measured best k = {report['measured_best_k']})")
    if any(row_shape(r).tree for r in rows):
        best, measured = (DraftShape.from_dict(report[key]).label for key in ("recommended", "measured_best"))
        lines.append(f"recommended: {best} (measured best: {measured})")
    if "acceptance" in report:
        rates = ", ".join("-" if a is None else f"{a:.2f}" for a in report["acceptance"]["rate"])
        lines.append(f"acceptance by position: [{rates}]")
    lines += [f"{row_shape(r).label}: {r['gap_explanation']}" for r in rows if r["gap_explanation"]]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> str | None:
    """tune.png: tokens/s against draft tokens per cycle (predicted, measured; chains as lines, trees as points) and
    the chains' acceptance by position. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    every = report_rows(report)
    rows, trees = [r for r in every if not row_shape(r).tree], [r for r in every if row_shape(r).tree]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ks = [r["draft_tokens"] for r in rows]
    ax1.plot(ks, [r["predicted_tok_s"] for r in rows], "o--", label="chain, predicted")
    ax1.plot(ks, [r["measured_tok_s"] for r in rows], "s-", label="chain, measured")
    if trees:
        x = [r["draft_tokens"] for r in trees]
        ax1.plot(x, [r["predicted_tok_s"] for r in trees], "^", mfc="none", label="tree, predicted")
        ax1.plot(x, [r["measured_tok_s"] for r in trees], "^", label="tree, measured")
        for r in trees:
            ax1.annotate(row_shape(r).label, (r["draft_tokens"], r["measured_tok_s"]), fontsize=7, xytext=(3, 3),
                         textcoords="offset points")  # fmt: skip
    if "recommended_k" in report:
        ax1.axvline(report["recommended_k"], color="gray", lw=0.8, ls=":", label=f"k* = {report['recommended_k']}")
    title = f"recommended: {DraftShape.from_dict(report['recommended']).label}"
    ax1.set(xlabel="draft tokens per cycle", ylabel="tokens/s", title=title)
    ax1.legend(fontsize=8)
    rates = [np.nan if a is None else a for a in report.get("acceptance", {}).get("rate", [])]
    pos = np.arange(1, len(rates) + 1)
    ax2.plot(pos, rates, "o-", label="a_j (conditional)")
    ax2.plot(pos, np.cumprod(np.nan_to_num(rates)), "s--", label="P(first j accepted)")
    ax2.set(xlabel="draft position j", ylabel="rate", ylim=(0, 1.05), title="chain acceptance by position")
    if len(pos):
        ax2.set_xticks(pos)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
