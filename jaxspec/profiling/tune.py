"""`jaxspec tune`: sweep draft configurations (chain depths k, and with `trees` tree shapes (num_steps, topk,
num_draft_tokens)), run the real loop for each, time every phase alone, fit the cost model and recommend the
configuration of highest predicted throughput (`recommended`; `recommended_k` is the best chain).

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

import numpy as np
from tqdm.auto import tqdm

from jaxspec.decoding.generate import MIN_PROMPT_BUCKET, LoopCache, bucket, generate
from jaxspec.profiling.cost_model import (
    DEFAULT_TREES,
    GAP_TOLERANCE,
    Config,
    CostModel,
    TreeShape,
    conditional_acceptance,
    explain_gap,
    pool_counters,
    relative_gap,
)
from jaxspec.profiling.timing import PhaseTimer

DEFAULT_PROMPTS = ((1, 17, 42, 7, 99, 3, 56, 12), (5, 8, 13, 21, 34, 55, 89, 144))
BUNDLED_PROMPTS = 8  # held-out prompts of the bundled pair swept together (one batch)
TABLE_COLUMNS = (
    "k",
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
    """`stream_cycles` cycles of the loop at one depth, all prompts running, and the phases timed right after."""

    seconds: float
    cycles: int
    tokens: int
    reached: np.ndarray
    accepted: np.ndarray
    phases: dict[str, float]  # seconds per call: "other", and "decode" (k = 0) or "verify", "extend" (+ "draft")


def time_phases_of(timer: PhaseTimer, k: Config, *, reps: int = 1) -> dict[str, float]:
    """Seconds per call of the phases a cycle of depth k (or a tree) runs (compiled on first use)."""
    if isinstance(k, TreeShape):
        S, K, T = k.num_steps, k.topk, k.num_draft_tokens
        return {
            "other": timer.tree_bookkeeping(S, K, T, warmup=0, reps=reps),
            "draft": timer.tree_draft(S, K, warmup=0, reps=reps),
            "verify": timer.tree_verify(T, warmup=0, reps=reps),
            "extend": timer.extend(S + 1, warmup=0, reps=reps),
        }
    out = {"other": timer.bookkeeping(k + 1, warmup=0, reps=reps)}
    if k == 0:
        return out | {"decode": timer.decode(warmup=0, reps=reps)}
    out |= {"verify": timer.verify(k + 1, warmup=0, reps=reps), "extend": timer.extend(k + 1, warmup=0, reps=reps)}
    if k >= 2:
        out["draft"] = timer.draft_step(warmup=0, reps=reps)
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
    k: Config,
    timer: PhaseTimer,
    *,
    max_new_tokens: int,
    stream_cycles: int,
    reps: int = 1,
    loops: LoopCache | None = None,
) -> tuple[list[Chunk], dict[str, Any]]:
    """One `generate` run at depth k (or a tree) with its phases timed after every chunk; returns its steady chunks
    (see the module docstring) and the run's stats. `loops`: the compiled loops to reuse (see `LoopCache`)."""

    marks = []

    def hook(progress) -> None:
        end = time.perf_counter()
        phases = time_phases_of(timer, k, reps=reps)
        marks.append((end, progress, phases, time.perf_counter()))

    stats = generate(
        target,
        drafter if k else None,
        prompts,
        max_new_tokens=max_new_tokens,
        **loop_settings(k),
        stream_cycles=stream_cycles,
        on_progress=hook,
        loops=loops,
    ).stats
    return steady_chunks(marks), stats


def parse_trees(text: str) -> list[TreeShape]:
    """`STEPS:TOPK:TOKENS,...` as tree shapes, or `default` (DEFAULT_TREES). A field may be a range `A-B`: the entry
    then stands for every shape in the product whose tree holds that many tokens (at most topk + (steps - 1) topk^2
    candidates plus the root, and MAX_DRAFT_TOKENS), e.g. `3-4:2:6-8`. ValueError naming a bad entry."""
    from jaxspec.decoding.generate import MAX_DRAFT_TOKENS
    from jaxspec.decoding.tree import num_candidates

    if text.strip() == "default":
        return list(DEFAULT_TREES)
    shapes: list[TreeShape] = []
    for part in filter(str.strip, text.split(",")):
        fields = part.strip().split(":")
        if len(fields) != 3 or not any("-" in f for f in fields):
            shapes.append(TreeShape.parse(part))
            continue
        grid = [_span(f, part) for f in fields]
        fit = [
            TreeShape(s, k, t)
            for s, k, t in itertools.product(*grid)
            if k >= 2 and 2 <= t <= min(num_candidates(k, s) + 1, MAX_DRAFT_TOKENS)
        ]
        if not fit:
            raise ValueError(f"tree shapes {part.strip()!r}: no shape in this range holds its token count")
        shapes += fit
    if not shapes:
        raise ValueError(f"expected STEPS:TOPK:TOKENS,... or 'default', got {text!r}")
    return list(dict.fromkeys(shapes))


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


def loop_settings(k: Config) -> dict[str, Any]:
    """`generate`'s draft settings for a chain depth or a tree."""
    if isinstance(k, TreeShape):
        return {"num_steps": k.num_steps, "topk": k.topk, "num_draft_tokens": k.num_draft_tokens}
    return {"num_steps": k}


def label(k: Config) -> str:
    """A configuration's name in tables and messages: k=3, or tree 4x2/8."""
    return f"tree {k.label}" if isinstance(k, TreeShape) else f"k={k}"


def row_label(row: dict[str, Any]) -> str:
    """`label` of a report row (chains have "k", trees "tree")."""
    return f"tree {row['tree']}" if "tree" in row else f"k={row['k']}"


def _phase(chunks: Sequence[Chunk], name: str) -> float:
    """Mean seconds of one phase over the chunks (the measured side is a mean over the same chunks too)."""
    return float(np.mean([c.phases[name] for c in chunks]))


def tune(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    ks: Iterable[int] = range(0, 5),
    *,
    trees: Iterable[TreeShape | tuple[int, int, int]] = (),
    max_new_tokens: int = 256,
    output_dir: str | Path | None = None,
    collective_preset: str | dict | None = None,
    stream_cycles: int = 4,
    reps: int = 1,
    inner: int = 4,
    repeats: int = 3,
    verbose: bool = True,
) -> dict[str, Any]:
    """Sweep draft depths `ks` and tree shapes `trees` ((num_steps, topk, num_draft_tokens) each) and return (and
    with `output_dir`, write `tune.json` + `tune.png`) the tuning report.

    `repeats` rounds over all configurations; each phase is timed `reps` x `inner` calls after every chunk of
    `stream_cycles` cycles. Raises ValueError when a configuration has no steady chunk (every prompt must run at
    least two chunks), or naming the bad argument."""
    ks, trees, prompts = _check_sweep(ks, trees, drafter, prompts, repeats)
    configs: list[Config] = [*ks, *trees]
    sweep = _Sweep(target, drafter, prompts, max_new_tokens, stream_cycles, reps, LoopCache())
    bar = tqdm(total=(repeats + 1) * len(configs), desc="jaxspec tune", unit="run", disable=not verbose)
    timer_of = sweep.compile(configs, inner, bar)
    chunks: dict[Config, list[Chunk]] = {k: [] for k in configs}
    last_stats: dict[Config, dict] = {}
    for round_ in range(repeats):
        for k in configs if round_ % 2 == 0 else configs[::-1]:
            bar.set_postfix(config=label(k), round=round_ + 1)
            got, last_stats[k] = sweep.run(k, timer_of[k])
            chunks[k] += got
            bar.update()
    bar.close()
    empty = [label(k) for k in configs if not chunks[k]]
    if empty:
        raise ValueError(
            f"{', '.join(empty)}: no steady chunk (after the first {stream_cycles} cycles and before any prompt "
            f"finished); raise max_new_tokens (now {max_new_tokens}) or lower stream_cycles"
        )
    counters = {k: pool_counters((c.reached, c.accepted) for c in chunks[k]) for k in configs}  # per config
    model = _fit(chunks, counters, timer_of, ks, trees, reps, len(prompts))
    rows = [_row(k, model, _measured(chunks[k], counters[k], last_stats[k], len(prompts))) for k in configs]
    settings = {"rounds": repeats, "stream_cycles": stream_cycles, "phase_calls_per_chunk": reps * inner}
    setup = _setup(timer_of[configs[-1]], len(prompts), target, max_new_tokens, collective_preset)
    report = _report(rows, model, {k: counters[k] for k in ks}, settings) | setup
    if verbose:
        print(format_table(report))
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
        report["plot"] = plot(report, out / "tune.png")
    return report


def _check_sweep(ks, trees, drafter, prompts, repeats: int) -> tuple[list[int], list[TreeShape], list[list[int]]]:
    """The sorted distinct depths and tree shapes and the prompts as lists of ints, or ValueError naming the bad
    argument."""
    from jaxspec.decoding.generate import check_tree

    ks = sorted(set(int(k) for k in ks))
    trees = sorted(set(t if isinstance(t, TreeShape) else TreeShape(*t) for t in trees))
    if not ks and not trees:
        raise ValueError("ks, trees: nothing to sweep (give draft depths, tree shapes or both)")
    if ks and ks[0] < 0:
        raise ValueError(f"ks: expected non-negative draft depths, got {ks}")
    if (ks and ks[-1] > 0 or trees) and drafter is None:
        raise ValueError("ks > 0 and trees need a drafter (only k = 0 runs without one)")
    for t in trees:
        try:
            check_tree(t.num_steps, t.topk, t.num_draft_tokens, drafter)
        except ValueError as e:
            raise ValueError(f"trees: {t.label}: {e}") from None
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt of token ids")
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1 rounds, got {repeats}")
    return ks, trees, prompts


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

    def compile(self, configs: Sequence[Config], inner: int, bar) -> dict[Config, PhaseTimer]:
        """Compile every loop and phase program first: one phase timer per (batch, buffer) bucket the loops use."""
        target, drafter, prompts = self.target, self.drafter, self.prompts
        context = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET) + self.max_new_tokens // 2
        timers: dict[tuple[int, int], PhaseTimer] = {}
        timer_of: dict[Config, PhaseTimer] = {}
        for k in configs:
            bar.set_postfix(config=label(k), round="compile")
            first = generate(
                target,
                drafter if k else None,
                prompts,
                max_new_tokens=self.max_new_tokens,
                **loop_settings(k),
                loops=self.loops,
            )
            shape = (first.stats["buckets"]["batch"], first.stats["buckets"]["buffer"])
            if shape not in timers:
                timers[shape] = PhaseTimer(
                    target, drafter, batch=shape[0], cache_len=shape[1], context=context, inner=inner
                )
            timer_of[k] = timers[shape]
            time_phases_of(timer_of[k], k)
            bar.update()
        return timer_of

    def run(self, k: Config, timer: PhaseTimer) -> tuple[list[Chunk], dict[str, Any]]:
        return run_depth(
            self.target,
            self.drafter,
            self.prompts,
            k,
            timer,
            max_new_tokens=self.max_new_tokens,
            stream_cycles=self.stream_cycles,
            reps=self.reps,
            loops=self.loops,
        )


def _fit(chunks, counters, timer_of, ks: list[int], trees: list[TreeShape], reps: int, batch: int) -> CostModel:
    """The cost model from the phase times of the steady chunks: the chains' acceptance pooled over all k, each
    tree's its own."""
    reached, accepted = pool_counters(counters[k] for k in ks)  # position j over every k >= j
    drafting = [c for k in ks if k >= 2 for c in chunks[k]]
    if 0 in ks:
        t_decode = _phase(chunks[0], "decode")
    else:
        t_decode = next(iter(timer_of.values())).decode(reps=max(3, reps))
    # Draft-extend over n tokens is one program whether a chain (k = n - 1) or a tree (num_steps = n - 1) runs it.
    span = lambda k: k.num_steps + 1 if isinstance(k, TreeShape) else k + 1  # noqa: E731
    return CostModel(
        t_draft=_phase(drafting, "draft") if drafting else 0.0,
        t_verify={k + 1: _phase(chunks[k], "verify") for k in ks if k},
        t_extend=_per([k for k in chunks if k], chunks, "extend", span),
        t_decode=t_decode,
        acceptance=conditional_acceptance(reached, accepted) if ks else (),
        t_other={k + 1: _phase(chunks[k], "other") for k in ks},
        batch=batch,
        t_tree_draft=_per(trees, chunks, "draft", lambda t: (t.num_steps, t.topk)),
        t_tree_verify=_per(trees, chunks, "verify", lambda t: t.num_draft_tokens),
        t_tree_other={t: _phase(chunks[t], "other") for t in trees},
        tree_acceptance={t: conditional_acceptance(*counters[t]) for t in trees},
    )


def _per(configs: Sequence[Config], chunks, phase: str, key) -> dict:
    """A phase's mean seconds per `key(config)`, over the chunks of every configuration sharing that key."""
    groups: dict[Any, list[Chunk]] = {}
    for t in configs:
        groups.setdefault(key(t), []).extend(chunks[t])
    return {g: _phase(cs, phase) for g, cs in groups.items()}


def _measured(chunks: list[Chunk], counters, stats: dict[str, Any], prompts: int) -> dict[str, Any]:
    """What the steady chunks of one k measured."""
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


def _row(k: Config, model: CostModel, run: dict[str, Any]) -> dict[str, Any]:
    """One row of the report: the model's terms and prediction for k (or a tree) next to what was measured."""
    terms = model.terms(k)
    e_pred, t_pred, r_pred = model.expected_tokens(k), model.cycle_time(k), model.predict(k)
    explanation = explain_gap(
        r_pred,
        run["tok_s"],
        {"tokens per cycle E(k)": (e_pred, run["tokens_per_cycle"]), "cycle time T(k)": (t_pred, run["cycle_s"])},
    )
    if isinstance(k, TreeShape):
        head = {"tree": k.label} | dataclasses.asdict(k) | {"draft_tokens": k.num_draft_tokens - 1}
    else:
        head = {"k": k, "draft_tokens": k}
    return head | {
        "draft_steps": model.draft_steps(k),
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
        "predicted_speedup": model.speedup(k),
        "gap": relative_gap(r_pred, run["tok_s"]),
        "gap_explanation": explanation,
        "measured_acceptance": run["acceptance"],
        "steady_chunks": run["chunks"],
        "steady_cycles": run["cycles"],
        "new_tokens": run["stats"]["new_tokens"],
    }


def _config_of(row: dict[str, Any]) -> dict[str, Any]:
    """The `generate` settings of a row (chains: topk 1, num_steps + 1 verified tokens)."""
    if "tree" in row:
        return {"num_steps": row["num_steps"], "topk": row["topk"], "num_draft_tokens": row["num_draft_tokens"]}
    return {"num_steps": row["k"], "topk": 1, "num_draft_tokens": row["k"] + 1}


def _report(rows, model: CostModel, chain_counters, settings) -> dict:
    """The tuning report's results (tune.json): the rows, the recommendations and the phases."""
    chains, trees = [r for r in rows if "k" in r], [r for r in rows if "tree" in r]
    best = max(rows, key=lambda r: r["predicted_tok_s"])  # the first on ties: chains before trees
    measured_best = max(rows, key=lambda r: r["measured_tok_s"])
    report = {
        "rows": chains,
        "tree_rows": trees,
        "recommended": _config_of(best) | {"label": best.get("tree", f"k={best.get('k')}")},
        "measured_best": _config_of(measured_best),
        "recommended_within_3pct": best["measured_tok_s"] >= 0.97 * measured_best["measured_tok_s"],
        "gap_tolerance": GAP_TOLERANCE,
        "all_within_tolerance": all(abs(r["gap"]) <= GAP_TOLERANCE for r in rows),
    }
    if chains:  # the best chain (what tune.json files from before tree sweeps held; --presets ranks by it)
        report["recommended_k"] = model.best_k([r["k"] for r in chains])
        report["measured_best_k"] = max(chains, key=lambda r: r["measured_tok_s"])["k"]
        reached, accepted = pool_counters(chain_counters.values())
        report["acceptance"] = {
            "reached": reached.tolist(),
            "accepted": accepted.tolist(),
            "rate": [None if np.isnan(a) else float(a) for a in model.acceptance],
        }
    report["phases_ms"] = {
        "draft": model.t_draft * 1e3,
        "verify": {str(t): v * 1e3 for t, v in model.t_verify.items()},
        "extend": {str(t): v * 1e3 for t, v in model.t_extend.items()},
        "decode": model.t_decode * 1e3,
        "other": {str(t): v * 1e3 for t, v in model.t_other.items()},
        "tree_draft": {f"{s}x{k}": v * 1e3 for (s, k), v in model.t_tree_draft.items()},
        "tree_verify": {str(t): v * 1e3 for t, v in model.t_tree_verify.items()},
        "tree_other": {t.label: v * 1e3 for t, v in model.t_tree_other.items()},
    }
    report["measurement"] = settings | {"pairing": "phases of a configuration timed right after every steady chunk"}
    report["baseline_tok_s"] = model.baseline()
    return report


def _setup(timer: PhaseTimer, prompts: int, target, max_new_tokens: int, preset) -> dict:
    """What the report was measured on: batch, mesh, collective preset, platform and versions."""
    import jax
    import jaxlib

    return {
        "batch": {"prompts": prompts, "padded": timer.batch, "buffer": timer.cache_len},
        "max_new_tokens": max_new_tokens,
        "mesh": {str(name): int(size) for name, size in target.mesh.shape.items()},
        "collective_preset": preset.get("name") if isinstance(preset, dict) else preset,
        "collective_preset_record": preset if isinstance(preset, dict) else None,
        "platform": jax.devices()[0].platform,
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__},
    }


def format_table(report: dict[str, Any]) -> str:
    """The sweep as a text table, with the recommendation and any unexplained gaps underneath."""
    lines = [" | ".join(TABLE_COLUMNS)]
    rows = report["rows"] + report.get("tree_rows", [])
    for r in rows:
        name = r.get("tree", r.get("k"))
        lines.append(
            f"{name} | {r['draft_tokens']} | {r['verify_ms']:.3f} | {r['cycle_ms']:.3f} | {r['E']:.3f} | "
            f"{r['predicted_tok_s']:.1f} | {r['measured_tok_s']:.1f} | {r['gap']:+.1%}"
        )
    if "recommended_k" in report:
        lines.append(f"recommended k = {report['recommended_k']} (measured best k = {report['measured_best_k']})")
    if report.get("tree_rows"):
        best = report["measured_best"]
        lines.append(
            f"recommended: {report['recommended']['label']} (measured best: num_steps {best['num_steps']}, "
            f"topk {best['topk']}, {best['num_draft_tokens']} draft tokens)"
        )
    if "acceptance" in report:
        rates = ", ".join("-" if a is None else f"{a:.2f}" for a in report["acceptance"]["rate"])
        lines.append(f"acceptance by position: [{rates}]")
    lines += [f"{row_label(r)}: {r['gap_explanation']}" for r in rows if r["gap_explanation"]]
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
    rows, trees = report["rows"], report.get("tree_rows", [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ks = [r["k"] for r in rows]
    ax1.plot(ks, [r["predicted_tok_s"] for r in rows], "o--", label="chain, predicted")
    ax1.plot(ks, [r["measured_tok_s"] for r in rows], "s-", label="chain, measured")
    if trees:
        x = [r["draft_tokens"] for r in trees]
        ax1.plot(x, [r["predicted_tok_s"] for r in trees], "^", mfc="none", label="tree, predicted")
        ax1.plot(x, [r["measured_tok_s"] for r in trees], "^", label="tree, measured")
        for r in trees:
            ax1.annotate(r["tree"], (r["draft_tokens"], r["measured_tok_s"]), fontsize=7, xytext=(3, 3),
                         textcoords="offset points")  # fmt: skip
    if "recommended_k" in report:
        ax1.axvline(report["recommended_k"], color="gray", lw=0.8, ls=":", label=f"k* = {report['recommended_k']}")
    ax1.set(xlabel="draft tokens per cycle", ylabel="tokens/s", title=f"recommended: {report['recommended']['label']}")
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
