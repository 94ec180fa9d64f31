"""Fixed and per-token cost of plain vs speculative decoding on the bundled pair, at batch 1.

    python benchmarks/marginal_cost.py [--num-steps 3] [--lengths 16,96,384] [--repeats 3]

Times `generate` on one held-out prompt at several max_new_tokens (compiled first; median of --repeats) for k = 0 and
k = --num-steps, then fits time = fixed + per-token * tokens over the lengths (least squares). The marginal speedup
(plain per-token / speculative per-token) is what long generations approach; the fixed part is per call.
Writes benchmarks/results/marginal_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--lengths", default="16,96,384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/marginal_cost.json"))
    args = p.parse_args()

    from jaxspec import bundled, generate

    target, drafter, tokenizer = bundled.load_pair()
    prompt = tokenizer.encode(bundled.prompts()[0])
    lengths = [int(n) for n in args.lengths.split(",")]
    result = {
        "command": "python benchmarks/marginal_cost.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in (("num_steps", args.num_steps), ("lengths", args.lengths), ("repeats", args.repeats))
        ),
        "modes": {},
    }
    for k in (0, args.num_steps):
        rows = []
        for n in lengths:
            run = lambda n=n, k=k: generate(target, drafter if k else None, [prompt], max_new_tokens=n, num_steps=k)
            run()  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = run()
                times.append(time.perf_counter() - t0)
            rows.append(
                {"tokens": len(out.tokens[0]), "seconds": statistics.median(times), "cycles": out.stats["cycles"]}
            )
        per_token, fixed = np.polyfit([r["tokens"] for r in rows], [r["seconds"] for r in rows], 1)
        result["modes"][f"k={k}"] = {"rows": rows, "fixed_ms": 1e3 * fixed, "per_token_ms": 1e3 * per_token}
        print(f"k={k}: fixed {1e3 * fixed:.1f} ms, {1e3 * per_token:.2f} ms per token", flush=True)
    plain, spec = result["modes"]["k=0"], result["modes"][f"k={args.num_steps}"]
    result["marginal_speedup"] = plain["per_token_ms"] / spec["per_token_ms"]
    print(f"marginal speedup {result['marginal_speedup']:.2f}x")
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
