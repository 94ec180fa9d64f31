"""The depth tuner on the bundled pair, checked against its acceptance criteria: for every configuration swept (chain
depths k, and with --trees tree shapes) the cost model's predicted tokens/s is within 10% of the measured rate, and
the recommended configuration measures within 3% of the best.

    python benchmarks/tune_bundled.py                              # k = 0..4 -> benchmarks/results/tune_bundled/
    python benchmarks/tune_bundled.py --max-k 6 --output benchmarks/results/tune_bundled_k6
    python benchmarks/tune_bundled.py --trees default --output benchmarks/results/tune_bundled_trees

Runs `jaxspec tune`'s sweep on the bundled pair (8 prompts as one batch, 256 new tokens, 3 rounds; ~4 minutes on 2 CPU
cores with the held-out prompts) on --prompt-set (prompt_sets.py; default 8 HumanEval prompts of at most 256 tokens;
`jaxspec tune` itself takes the 8 held-out prompts, `--prompt-set held-out` here; the recorded runs predate the
option and used those), writes tune.json + tune.png, prints the table and the verdict, and exits with status 1
when a criterion fails (timing-dependent, so it lives here rather than in the test suite).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import prompt_sets  # this directory (run as a script)

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
    prompt_sets.add_arguments(p, count=8, max_tokens=256)
    args = p.parse_args()

    from jaxspec import bundled
    from jaxspec.profiling.tune import parse_trees, tune

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    drafts = [*range(args.max_k + 1), *(parse_trees(args.trees) if args.trees else ())]
    report = tune(target, drafter, prompt_set.ids, drafts, repeats=args.rounds, output_dir=args.output)
    report["prompt_set"] = prompt_set.describe() | {
        "command": f"python benchmarks/tune_bundled.py {prompt_sets.flags(args)}"
    }
    (args.output / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    misses = verdict(report)
    print(f"wrote {args.output / 'tune.json'}")
    print("criteria met" if not misses else "criteria missed:\n  " + "\n  ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
