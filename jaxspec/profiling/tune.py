"""`jaxspec tune`: sweep the draft depth k, run the real loop for each, time every phase alone, fit the cost model
and recommend k* = argmax of the predicted throughput.

Measured throughput is the loop's steady state: the run streams every `stream_cycles` cycles and only the chunks
after the first (which holds prefill) and before the last (partial) are counted, so prefill and compile time are
excluded; runs too short for that fall back to the whole run (`steady: false` in the row).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.profiling.cost_model import (
    GAP_TOLERANCE,
    CostModel,
    conditional_acceptance,
    explain_gap,
    pool_counters,
    relative_gap,
)
from jaxspec.profiling.timing import PhaseTimer, PhaseTimes

DEFAULT_PROMPTS = ((1, 17, 42, 7, 99, 3, 56, 12), (5, 8, 13, 21, 34, 55, 89, 144))
BUNDLED_PROMPTS = 4  # held-out prompts of the bundled pair swept together (one batch)
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


def measure_loop(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    k: int,
    *,
    max_new_tokens: int,
    stream_cycles: int = 16,
    repeats: int = 3,
) -> dict[str, Any]:
    """Run `jaxspec.generate` at depth k once to compile, then `repeats` times; the run with the median steady-state
    throughput is returned (tokens, cycles and seconds of its steady chunks, and the loop's own stats)."""
    from jaxspec.decoding.generate import generate

    kwargs = dict(max_new_tokens=max_new_tokens, num_steps=k, stream_cycles=stream_cycles)
    generate(target, drafter if k else None, prompts, **kwargs, on_cycles=lambda _: None)
    results = []
    for _ in range(max(repeats, 1)):
        marks: list[tuple[float, int]] = []

        def mark(tokens: list[list[int]], marks=marks) -> None:
            marks.append((time.perf_counter(), sum(len(t) for t in tokens)))

        stats = generate(target, drafter if k else None, prompts, **kwargs, on_cycles=mark).stats
        if len(marks) >= 3:  # chunks 2 .. n-1: full chunks of stream_cycles cycles, no prefill
            seconds, tokens = marks[-2][0] - marks[0][0], marks[-2][1] - marks[0][1]
            cycles, steady = stream_cycles * (len(marks) - 2), True
        else:
            seconds, tokens, cycles, steady = stats["seconds"], stats["new_tokens"], stats["cycles"], False
        results.append(
            {
                "stats": stats,
                "steady": steady,
                "seconds": seconds,
                "tokens": tokens,
                "cycles": cycles,
                "cycle_s": seconds / max(cycles, 1),
                "tokens_per_cycle": tokens / max(cycles, 1) / len(prompts),
                "tok_s": tokens / seconds,
            }
        )
    return sorted(results, key=lambda r: r["tok_s"])[len(results) // 2]


def tune(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    ks: Iterable[int] = range(0, 5),
    *,
    max_new_tokens: int = 96,
    output_dir: str | Path | None = None,
    collective_preset: str | dict | None = None,
    stream_cycles: int = 16,
    reps: int = 7,
    inner: int = 16,
    repeats: int = 3,
    calibrate_other: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Sweep draft depths `ks` and return (and with `output_dir`, write `tune.json` + `tune.png`) the tuning report.

    `calibrate_other`: take the per-cycle cost outside the timed phases (accept, commit, loop bookkeeping) from the
    k = 0 run (its cycle is one decode step plus that cost); otherwise it is 0."""
    import jax
    import jaxlib

    from jaxspec.decoding.generate import MIN_PROMPT_BUCKET, _bucket

    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 0:
        raise ValueError(f"ks: expected non-negative draft depths, got {ks}")
    if ks[-1] > 0 and drafter is None:
        raise ValueError(f"ks up to {ks[-1]} need a drafter (only k = 0 runs without one)")
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt of token ids")

    # Phases are timed right after the loop run of each k, so both see the same machine load.
    prompt_bucket = _bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    runs, timer = {}, None
    t_verify, t_extend, t_draft, t_decode = {}, {}, [], []
    for k in ks:
        runs[k] = measure_loop(
            target, drafter, prompts, k, max_new_tokens=max_new_tokens, stream_cycles=stream_cycles, repeats=repeats
        )
        buckets = runs[k]["stats"]["buckets"]
        if timer is None or (timer.batch, timer.cache_len) != (buckets["batch"], buckets["buffer"]):
            timer = PhaseTimer(
                target,
                drafter,
                batch=buckets["batch"],
                cache_len=buckets["buffer"],
                context=prompt_bucket + max_new_tokens // 2,
                inner=inner,
            )
        if k == 0 or k == ks[0]:
            t_decode.append(timer.decode(reps=reps))
        if k >= 1:
            t_verify[k + 1], t_extend[k + 1] = timer.verify(k + 1, reps=reps), timer.extend(k + 1, reps=reps)
        if k >= 2:
            t_draft.append(timer.draft_step(reps=reps))
    phases = PhaseTimes(
        float(np.median(t_draft)) if t_draft else 0.0,
        t_verify,
        t_extend,
        float(np.median(t_decode)),
        timer.batch,
        timer.cache_len,
        timer.context,
    )
    reached, accepted = pool_counters((r["stats"]["reached"], r["stats"]["accepted"]) for r in runs.values())
    acceptance = conditional_acceptance(reached, accepted)
    t_other = 0.0
    if calibrate_other and 0 in ks:
        t_other = max(runs[0]["cycle_s"] - phases.t_decode, 0.0)
    model = CostModel(
        t_draft=phases.t_draft,
        t_verify=phases.t_verify,
        t_extend=phases.t_extend,
        t_decode=phases.t_decode,
        acceptance=acceptance,
        t_other=t_other,
        batch=len(prompts),
    )

    rows = []
    for k in ks:
        run, terms = runs[k], model.terms(k)
        e_pred, t_pred, r_pred = model.expected_tokens(k), model.cycle_time(k), model.predict(k)
        explanation = explain_gap(
            r_pred,
            run["tok_s"],
            {"tokens per cycle E(k)": (e_pred, run["tokens_per_cycle"]), "cycle time T(k)": (t_pred, run["cycle_s"])},
        )
        rows.append(
            {
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
                "measured_e2e_tok_s": run["stats"]["tokens_per_second"],
                "predicted_speedup": model.speedup(k),
                "gap": relative_gap(r_pred, run["tok_s"]),
                "gap_explanation": explanation,
                "steady": run["steady"],
                "cycles": run["stats"]["cycles"],
                "new_tokens": run["stats"]["new_tokens"],
            }
        )
    measured_best = max(rows, key=lambda r: r["measured_tok_s"])
    recommended = model.best_k(ks)
    rec_row = next(r for r in rows if r["k"] == recommended)
    preset = collective_preset
    report = {
        "rows": rows,
        "recommended_k": recommended,
        "measured_best_k": measured_best["k"],
        "recommended_within_3pct": rec_row["measured_tok_s"] >= 0.97 * measured_best["measured_tok_s"],
        "gap_tolerance": GAP_TOLERANCE,
        "all_within_tolerance": all(abs(r["gap"]) <= GAP_TOLERANCE for r in rows),
        "acceptance": {
            "reached": reached.tolist(),
            "accepted": accepted.tolist(),
            "rate": [None if np.isnan(a) else float(a) for a in acceptance],
        },
        "phases_ms": {
            "draft": phases.t_draft * 1e3,
            "verify": {str(t): s * 1e3 for t, s in phases.t_verify.items()},
            "extend": {str(t): s * 1e3 for t, s in phases.t_extend.items()},
            "decode": phases.t_decode * 1e3,
            "other": t_other * 1e3,
            "other_source": "k=0 loop cycle minus decode step" if calibrate_other and 0 in ks else "assumed 0",
        },
        "baseline_tok_s": model.baseline(),
        "batch": {"prompts": len(prompts), "padded": phases.batch, "buffer": phases.cache_len},
        "max_new_tokens": max_new_tokens,
        "mesh": {str(name): int(size) for name, size in target.mesh.shape.items()},
        "collective_preset": preset.get("name") if isinstance(preset, dict) else preset,
        "collective_preset_record": preset if isinstance(preset, dict) else None,
        "platform": jax.devices()[0].platform,
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__},
    }
    if verbose:
        print(format_table(report))
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
        report["plot"] = plot(report, out / "tune.png")
    return report


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


# ----------------------------------------------------------------------------------------------- CLI
def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `jaxspec tune` (register with `sub.add_parser("tune", ...)`, dispatch to `cmd_tune`)."""
    p.add_argument("--model", help="HF-layout checkpoint directory (config.json + safetensors)")
    p.add_argument("--preset", default=None, help="a named config instead of --model: tiny, tiny-dsv3, kimi-k2.5")
    p.add_argument("--mesh", default=None, help="mesh shape DATAxMODEL, e.g. 1x8 (default: all devices on MODEL)")
    p.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default: bfloat16; float32 for the bundled pair"
    )
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (default with --preset: random drafter)")
    p.add_argument("--max-k", type=int, default=4, help="sweep k = 0..MAX_K draft tokens (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt and k (%(default)s)")
    p.add_argument(
        "--prompts-file",
        type=Path,
        help="one prompt per line: comma-separated token ids (default: fixed ids; with the bundled pair, its held-out "
        "prompts)",
    )
    p.add_argument("--output", type=Path, help="write DIR/tune.json and DIR/tune.png")


def read_prompts(path: str | Path) -> list[list[int]]:
    """Prompts from a file: one per non-empty line, comma-separated token ids."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append([int(t) for t in line.split(",")])
        except ValueError:
            raise ValueError(f"{path}:{n}: expected comma-separated token ids, got {line.strip()!r}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one line of comma-separated token ids per prompt)")
    return prompts


def cmd_tune(args: argparse.Namespace) -> int:
    """`jaxspec tune`: build target + drafter from the arguments, sweep, print the table, write the outputs."""
    from jaxspec.cli import _target, use_bundled_pair
    from jaxspec.drafter import Drafter, load_drafter
    from jaxspec.models.eagle3 import draft_config_for

    if args.max_k < 0:
        raise SystemExit(f"jaxspec tune: --max-k must be >= 0, got {args.max_k}")
    prompts = None
    if use_bundled_pair(args):  # the bundled trained pair, on its held-out prompts
        from jaxspec import bundled
        from jaxspec.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        prompts = [tokenizer.encode(p) for p in bundled.prompts()[:BUNDLED_PROMPTS]]
    if args.model and not args.drafter and args.max_k > 0:
        raise SystemExit("jaxspec tune: --model needs --drafter DIR (random drafters are only for --preset)")
    try:
        if args.prompts_file:
            prompts = read_prompts(args.prompts_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"jaxspec tune: --prompts-file: {e}") from None
    prompts = prompts or [list(p) for p in DEFAULT_PROMPTS]
    target, source = _target(args, abstract=False)
    if args.drafter:
        drafter = load_drafter(args.drafter, target, dtype=target.dtype)
    else:
        drafter = Drafter.random(draft_config_for(target.config), target, dtype=target.dtype, seed=0)
    print(f"target: {source}; drafter: {args.drafter or 'random'}; mesh {dict(target.mesh.shape)}")
    tune(
        target,
        drafter,
        prompts,
        range(0, args.max_k + 1),
        max_new_tokens=args.max_new_tokens,
        output_dir=args.output,
        collective_preset=getattr(args, "preset_record", None),
    )
    if args.output:
        print(f"wrote {args.output / 'tune.json'}")
    return 0
