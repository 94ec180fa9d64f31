"""`jaxspec tune`: sweep the draft depth k, run the real loop for each, time every phase alone, fit the cost model
and recommend k* = argmax of the predicted throughput.

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
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxspec.decoding.generate import MIN_PROMPT_BUCKET, LoopCache, bucket, generate
from jaxspec.profiling.cost_model import (
    GAP_TOLERANCE,
    CostModel,
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


def time_phases_of(timer: PhaseTimer, k: int, *, reps: int = 1) -> dict[str, float]:
    """Seconds per call of the phases a cycle of depth k runs (compiled on first use)."""
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
    k: int,
    timer: PhaseTimer,
    *,
    max_new_tokens: int,
    stream_cycles: int,
    reps: int = 1,
    loops: LoopCache | None = None,
) -> tuple[list[Chunk], dict[str, Any]]:
    """One `generate` run at depth k with the phases of k timed after every chunk; returns its steady chunks (see the
    module docstring) and the run's stats. `loops`: the compiled loops to reuse (see `LoopCache`)."""

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
        num_steps=k,
        stream_cycles=stream_cycles,
        on_progress=hook,
        loops=loops,
    ).stats
    return steady_chunks(marks), stats


def _phase(chunks: Sequence[Chunk], name: str) -> float:
    """Mean seconds of one phase over the chunks (the measured side is a mean over the same chunks too)."""
    return float(np.mean([c.phases[name] for c in chunks]))


def tune(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    ks: Iterable[int] = range(0, 5),
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
    """Sweep draft depths `ks` and return (and with `output_dir`, write `tune.json` + `tune.png`) the tuning report.

    `repeats` rounds over all k; each phase is timed `reps` x `inner` calls after every chunk of `stream_cycles`
    cycles. Raises ValueError when some k has no steady chunk (every prompt must run at least two chunks)."""
    ks, prompts = _check_sweep(ks, drafter, prompts, repeats)
    sweep = _Sweep(target, drafter, prompts, max_new_tokens, stream_cycles, reps, LoopCache())
    bar = tqdm(total=(repeats + 1) * len(ks), desc="jaxspec tune", unit="run", disable=not verbose)
    timer_of = sweep.compile(ks, inner, bar)
    chunks: dict[int, list[Chunk]] = {k: [] for k in ks}
    last_stats: dict[int, dict] = {}
    for round_ in range(repeats):
        for k in ks if round_ % 2 == 0 else ks[::-1]:
            bar.set_postfix(k=k, round=round_ + 1)
            got, last_stats[k] = sweep.run(k, timer_of[k])
            chunks[k] += got
            bar.update()
    bar.close()
    empty = [k for k in ks if not chunks[k]]
    if empty:
        raise ValueError(
            f"k = {empty}: no steady chunk (after the first {stream_cycles} cycles and before any prompt finished); "
            f"raise max_new_tokens (now {max_new_tokens}) or lower stream_cycles"
        )
    counters = {k: pool_counters((c.reached, c.accepted) for c in chunks[k]) for k in ks}  # per k, its chunks
    model = _fit(chunks, counters, timer_of, ks, reps, len(prompts))
    rows = [_row(k, model, _measured(chunks[k], counters[k], last_stats[k], len(prompts))) for k in ks]
    settings = {"rounds": repeats, "stream_cycles": stream_cycles, "phase_calls_per_chunk": reps * inner}
    report = _report(rows, model, counters, settings, timer_of[ks[-1]], target, max_new_tokens, collective_preset)
    if verbose:
        print(format_table(report))
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
        report["plot"] = plot(report, out / "tune.png")
    return report


def _check_sweep(ks: Iterable[int], drafter, prompts, repeats: int) -> tuple[list[int], list[list[int]]]:
    """The sorted distinct depths and the prompts as lists of ints, or ValueError naming the bad argument."""
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 0:
        raise ValueError(f"ks: expected non-negative draft depths, got {ks}")
    if ks[-1] > 0 and drafter is None:
        raise ValueError(f"ks up to {ks[-1]} need a drafter (only k = 0 runs without one)")
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt of token ids")
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1 rounds, got {repeats}")
    return ks, prompts


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

    def compile(self, ks: Sequence[int], inner: int, bar) -> dict[int, PhaseTimer]:
        """Compile every loop and phase program first: one phase timer per (batch, buffer) bucket the loops use."""
        target, drafter, prompts = self.target, self.drafter, self.prompts
        context = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET) + self.max_new_tokens // 2
        timers: dict[tuple[int, int], PhaseTimer] = {}
        timer_of: dict[int, PhaseTimer] = {}
        for k in ks:
            bar.set_postfix(k=k, round="compile")
            first = generate(
                target,
                drafter if k else None,
                prompts,
                max_new_tokens=self.max_new_tokens,
                num_steps=k,
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

    def run(self, k: int, timer: PhaseTimer) -> tuple[list[Chunk], dict[str, Any]]:
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


def _fit(chunks, counters, timer_of, ks: list[int], reps: int, batch: int) -> CostModel:
    """The cost model from the phase times of the steady chunks and the acceptance pooled over all k."""
    reached, accepted = pool_counters(counters.values())  # position j over every k >= j
    drafting = [c for k in ks if k >= 2 for c in chunks[k]]
    if 0 in ks:
        t_decode = _phase(chunks[0], "decode")
    else:
        t_decode = timer_of[ks[0]].decode(reps=max(3, reps))
    return CostModel(
        t_draft=_phase(drafting, "draft") if drafting else 0.0,
        t_verify={k + 1: _phase(chunks[k], "verify") for k in ks if k},
        t_extend={k + 1: _phase(chunks[k], "extend") for k in ks if k},
        t_decode=t_decode,
        acceptance=conditional_acceptance(reached, accepted),
        t_other={k + 1: _phase(chunks[k], "other") for k in ks},
        batch=batch,
    )


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


def _row(k: int, model: CostModel, run: dict[str, Any]) -> dict[str, Any]:
    """One row of the report: the model's terms and prediction at k next to what was measured."""
    terms = model.terms(k)
    e_pred, t_pred, r_pred = model.expected_tokens(k), model.cycle_time(k), model.predict(k)
    explanation = explain_gap(
        r_pred,
        run["tok_s"],
        {"tokens per cycle E(k)": (e_pred, run["tokens_per_cycle"]), "cycle time T(k)": (t_pred, run["cycle_s"])},
    )
    return {
        "k": k,
        "draft_tokens": k,
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


def _report(rows, model: CostModel, counters, settings, timer: PhaseTimer, target, max_new_tokens, preset) -> dict:
    """The tuning report (tune.json): the rows, the recommendation, the phases and the run's setup."""
    import jax
    import jaxlib

    reached, accepted = pool_counters(counters.values())
    ks = [r["k"] for r in rows]
    measured_best = max(rows, key=lambda r: r["measured_tok_s"])
    recommended = model.best_k(ks)
    rec_row = next(r for r in rows if r["k"] == recommended)
    return {
        "rows": rows,
        "recommended_k": recommended,
        "measured_best_k": measured_best["k"],
        "recommended_within_3pct": rec_row["measured_tok_s"] >= 0.97 * measured_best["measured_tok_s"],
        "gap_tolerance": GAP_TOLERANCE,
        "all_within_tolerance": all(abs(r["gap"]) <= GAP_TOLERANCE for r in rows),
        "acceptance": {
            "reached": reached.tolist(),
            "accepted": accepted.tolist(),
            "rate": [None if np.isnan(a) else float(a) for a in model.acceptance],
        },
        "phases_ms": {
            "draft": model.t_draft * 1e3,
            "verify": {str(t): v * 1e3 for t, v in model.t_verify.items()},
            "extend": {str(t): v * 1e3 for t, v in model.t_extend.items()},
            "decode": model.t_decode * 1e3,
            "other": {str(t): v * 1e3 for t, v in model.t_other.items()},
        },
        "measurement": settings | {"pairing": "phases of k timed right after every steady chunk of the loop at k"},
        "baseline_tok_s": model.baseline(),
        "batch": {"prompts": model.batch, "padded": timer.batch, "buffer": timer.cache_len},
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
    for r in report["rows"]:
        lines.append(
            f"{r['k']} | {r['draft_tokens']} | {r['verify_ms']:.3f} | {r['cycle_ms']:.3f} | {r['E']:.3f} | "
            f"{r['predicted_tok_s']:.1f} | {r['measured_tok_s']:.1f} | {r['gap']:+.1%}"
        )
    lines.append(f"recommended k = {report['recommended_k']} (measured best k = {report['measured_best_k']})")
    rates = ", ".join("-" if a is None else f"{a:.2f}" for a in report["acceptance"]["rate"])
    lines.append(f"acceptance by position: [{rates}]")
    lines += [f"k={r['k']}: {r['gap_explanation']}" for r in report["rows"] if r["gap_explanation"]]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> str | None:
    """tune.png: tokens/s vs k (predicted, measured) and acceptance by position. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ks = [r["k"] for r in report["rows"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ks, [r["predicted_tok_s"] for r in report["rows"]], "o--", label="predicted")
    ax1.plot(ks, [r["measured_tok_s"] for r in report["rows"]], "s-", label="measured")
    ax1.axvline(report["recommended_k"], color="gray", lw=0.8, ls=":", label=f"k* = {report['recommended_k']}")
    ax1.set(xlabel="draft tokens k", ylabel="tokens/s", title="throughput vs draft depth", xticks=ks)
    ax1.legend()
    rates = [np.nan if a is None else a for a in report["acceptance"]["rate"]]
    pos = np.arange(1, len(rates) + 1)
    ax2.plot(pos, rates, "o-", label="a_j (conditional)")
    ax2.plot(pos, np.cumprod(np.nan_to_num(rates)), "s--", label="P(first j accepted)")
    ax2.set(xlabel="draft position j", ylabel="rate", ylim=(0, 1.05), title="acceptance by position")
    if len(pos):
        ax2.set_xticks(pos)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
