"""The depth tuner on the bundled pair, checked against its acceptance criteria: for every configuration swept (chain
depths k, and with --trees tree shapes) the cost model's predicted tokens/s is within 10% of the measured rate, and
the recommended configuration measures within 3% of the best.

    python benchmarks/tune_bundled.py                              # k = 0..4 -> benchmarks/results/tune_bundled/
    python benchmarks/tune_bundled.py --max-k 6 --output benchmarks/results/tune_bundled_k6
    python benchmarks/tune_bundled.py --trees default --output benchmarks/results/tune_bundled_trees

Runs `jaxspec tune` on the bundled pair with its defaults (8 held-out prompts as one batch, 256 new tokens, 3 rounds;
~4 minutes on 2 CPU cores), writes tune.json + tune.png, prints the table and the verdict, and exits with status 1
when a criterion fails (timing-dependent, so it lives here rather than in the test suite).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAX_GAP = 0.10
RECOMMENDED_WITHIN = 0.03


def verdict(report: dict) -> list[str]:
    """The criteria a tuning report misses (empty when it meets them all)."""
    from jaxspec.profiling.tune import report_rows, row_shape

    rows = report_rows(report)
    label = lambda r: row_shape(r).label
    misses = [
        f"{label(r)}: predicted {r['predicted_tok_s']:.1f} vs measured {r['measured_tok_s']:.1f} tok/s "
        f"({r['gap']:+.1%}, over {MAX_GAP:.0%})"
        for r in rows
        if abs(r["gap"]) > MAX_GAP
    ]
    best = max(rows, key=lambda r: r["measured_tok_s"])
    rec = max(rows, key=lambda r: r["predicted_tok_s"])  # the recommendation
    if rec["measured_tok_s"] < (1 - RECOMMENDED_WITHIN) * best["measured_tok_s"]:
        misses.append(
            f"recommended {label(rec)} measured {rec['measured_tok_s']:.1f} tok/s, more than "
            f"{RECOMMENDED_WITHIN:.0%} below the measured best {label(best)} ({best['measured_tok_s']:.1f})"
        )
    return misses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trees", help="tree shapes to sweep too: STEPS:TOPK:TOKENS,... or 'default' (see jaxspec tune)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/tune_bundled"))
    args = p.parse_args()

    from jaxspec import bundled
    from jaxspec.profiling.tune import BUNDLED_PROMPTS, parse_trees, tune

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(text) for text in bundled.prompts()[:BUNDLED_PROMPTS]]
    drafts = [*range(args.max_k + 1), *(parse_trees(args.trees) if args.trees else ())]
    report = tune(target, drafter, prompts, drafts, repeats=args.rounds, output_dir=args.output)
    misses = verdict(report)
    print(f"wrote {args.output / 'tune.json'}")
    print("criteria met" if not misses else "criteria missed:\n  " + "\n  ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
