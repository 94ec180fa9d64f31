"""Speculative vs plain decoding in one run, on the same weights: tokens/s for k = 0 (plain) and k = 1..K, with the
acceptance statistics. Prints a table and writes JSON.

    python benchmarks/spec_vs_plain.py --model TARGET_DIR --drafter DRAFTER_DIR [--tokenizer DIR] [--prompts FILE]
    python benchmarks/spec_vs_plain.py --preset tiny            # random weights + random drafter: machinery only

Every configuration is run once to compile (not timed) and then timed over --repeats runs (median). The ratio
`speedup` is measured tokens/s over plain decoding's tokens/s in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--drafter")
    p.add_argument("--tokenizer")
    p.add_argument("--prompts", help="text file, one prompt per line (text needs a tokenizer; else ids 'a,b,c')")
    p.add_argument("--max-k", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mesh", default=None)
    p.add_argument("--cpu-devices", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output", default="benchmarks/results/spec_vs_plain.json")
    args = p.parse_args()
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    import jax
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target, generate, load_target
    from jaxspec.io import load_drafter_or_random
    from sharding.mesh import make_mesh

    mesh, dtype = make_mesh(args.mesh) if args.mesh else None, jnp.dtype(args.dtype)
    if args.model:
        target = load_target(args.model, mesh=mesh, dtype=dtype)
        if not args.drafter:
            raise SystemExit("--model needs --drafter")
    else:
        target = Target.random(KimiConfig.preset(args.preset), mesh=mesh, dtype=dtype)
    drafter = load_drafter_or_random(args.drafter if args.model else None, target)  # in the target's dtype
    tokenizer = None
    if args.tokenizer or args.model:
        from jaxspec.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer or args.model)
        except FileNotFoundError:
            tokenizer = None
    if args.prompts:
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        prompts = lines if tokenizer else [[int(t) for t in ln.split(",")] for ln in lines]
    else:
        prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46]]

    rows = []
    for k in range(args.max_k + 1):
        run = lambda k=k: generate(
            target,
            drafter if k else None,
            prompts,
            max_new_tokens=args.max_new_tokens,
            num_steps=k,
            tokenizer=tokenizer,
        )
        run()  # compile
        results = [run() for _ in range(args.repeats)]
        seconds = statistics.median(r.stats["seconds"] for r in results)
        s = results[0].stats
        rows.append(
            {
                "k": k,
                "new_tokens": s["new_tokens"],
                "cycles": s["cycles"],
                "seconds": seconds,
                "tokens_per_second": s["new_tokens"] / seconds,
                "mean_accepted_length": s["mean_accepted_length"],
                "reached": s["reached"],
                "accepted": s["accepted"],
                "acceptance_rate": s["acceptance_rate"],
            }
        )
    base = rows[0]["tokens_per_second"]
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / base
    print(f"{'k':>2} | {'tok/s':>8} | {'speedup':>7} | {'cycles':>6} | {'accepted len':>12} | per-position acceptance")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_rate"])
        print(
            f"{r['k']:>2} | {r['tokens_per_second']:8.1f} | {r['speedup']:7.2f} | {r['cycles']:>6} | "
            f"{r['mean_accepted_length']:12.2f} | {acc}"
        )
    out = {
        "target": args.model or f"preset {args.preset} (random)",
        "drafter": args.drafter or "random",
        "mesh": dict(target.mesh.shape),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
