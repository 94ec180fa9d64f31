"""`first_argmax` (the maximum, then the lowest index holding it) against `jnp.argmax`, jitted, in one run.

The greedy paths pick tokens with it (the target's argmax head, a greedy drafter's draw, coupled sampling's
argmax(log p + g)): XLA:CPU runs argmax as one reduction over (value, index) pairs, which it does not vectorise.
Shapes: the bundled pair's verify of a 4-row k = 4 chain ([20, 4096]), its drafter's draw over 4 and 8 rows ([4, 2048],
[8, 2048]), one row's decode ([1, 4096]) and Kimi-K2.5's vocabulary over 4 rows ([4, 163840]); float32, one CPU
device, --rounds rounds alternating the order; the same ids asserted.

    python benchmarks/first_argmax.py      # writes benchmarks/results/first_argmax.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((20, 4096), (4, 2048), (8, 2048), (1, 4096), (4, 163840))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=300, help="calls per shape, variant and round")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "first_argmax.json")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxspec.profiling.timing import alternating_seconds
    from sharding.collectives import first_argmax

    fns = {
        "jnp.argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)),
        "first_argmax": jax.jit(first_argmax),
    }
    load_before, rows = os.getloadavg(), []
    for shape in SHAPES:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
        np.testing.assert_array_equal(*(np.asarray(f(x)) for f in fns.values()))
        per = {name: [] for name in fns}
        for r in range(args.rounds):
            for name, s in alternating_seconds(fns, (x,), calls=args.calls, round_index=r).items():
                per[name].append(1e6 * s)
        ratios = [a / b for a, b in zip(per["jnp.argmax"], per["first_argmax"], strict=True)]
        us = {name: float(np.median(v)) for name, v in per.items()}
        rows.append({"shape": list(shape), "us": us, "speedup": float(np.median(ratios))})
    record = {
        "command": "python benchmarks/first_argmax.py"
        + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        + (f" --calls {args.calls}" if args.calls != 300 else ""),
        "rounds": args.rounds,
        "calls": args.calls,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "results": rows,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    md = [
        "# `first_argmax` against `jnp.argmax` (XLA:CPU)",
        "",
        f"Written by `{record['command']}`: float32, one CPU device (this project's shared 2-core machine), "
        f"{args.calls} calls per timing, medians of {args.rounds} rounds alternating the order; load average "
        f"{tuple(round(x, 1) for x in load_before)} before. Same ids asserted.",
        "",
        "| logits | jnp.argmax (us) | first_argmax (us) | speedup |",
        "|---|---|---|---|",
        *(
            f"| {r['shape'][0]} x {r['shape'][1]} | {r['us']['jnp.argmax']:.1f} | {r['us']['first_argmax']:.1f} "
            f"| **{r['speedup']:.2f}x** |"
            for r in rows
        ),
        "",
    ]
    args.output.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
