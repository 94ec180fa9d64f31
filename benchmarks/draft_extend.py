"""The draft-extend's drafter step at one position per row, against the whole step then picked, in one run.

A draft-extend (and a fed prefill chunk) runs the drafter's first step over T positions (a chain's k + 1 accepted
slots, or a prompt chunk) and needs its logits and h2 at one position per row only (the last accepted one, the
prompt's last). `Drafter.apply(..., at_B=)` writes every position's cache entry and runs the MLP and the head at that
position alone; until 2026-12-07 the step ran them at all T and `extend_logits` picked one. This times both, jitted,
on the bundled drafter (float32, one device) over its pool-less dense cache, for (rows, positions) = a chain of k = 4
over 1, 4 and 8 rows and a 64-token prefill chunk, alternating over --rounds rounds; the same logits and h2 are
asserted (to 1e-5).

    python benchmarks/draft_extend.py      # writes benchmarks/results/draft_extend.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((1, 5), (4, 5), (8, 5), (1, 64))  # (rows, positions)
POSITIONS = 512  # the dense cache's positions per row; each row's step starts at position 200


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=200, help="calls per shape, variant and round")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "draft_extend.json")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxspec import bundled
    from jaxspec.profiling.timing import alternating_seconds

    _, drafter, _ = bundled.load_pair()
    width = len(drafter.capture_layers) * drafter.config.target_hidden_size
    rng = np.random.default_rng(0)
    cases = {}
    for rows, T in SHAPES:
        cache = tuple(jnp.asarray(rng.standard_normal(c.shape), c.dtype) for c in drafter.init_cache(rows, POSITIONS))
        tokens = jnp.asarray(rng.integers(0, drafter.config.vocab_size, (rows, T)), jnp.int32)
        hidden = jnp.asarray(rng.standard_normal((rows, T, width)), jnp.float32)
        pos = jnp.asarray(200 + np.arange(T, dtype=np.int32)[None].repeat(rows, 0))
        at = jnp.asarray(rng.integers(0, T, rows), jnp.int32)

        def whole(cache, at, tokens=tokens, hidden=hidden, pos=pos):  # the step at every position, then picked
            logits, h2, cache = drafter.apply(drafter.params, tokens, hidden, pos, cache, first_step=True)
            pick = lambda x: jnp.take_along_axis(x, at[:, None, None], axis=1)[:, 0]  # noqa: E731
            return pick(logits), pick(h2), cache

        def one(cache, at, tokens=tokens, hidden=hidden, pos=pos):  # at one position per row
            logits, h2, cache = drafter.apply(drafter.params, tokens, hidden, pos, cache, first_step=True, at_B=at)
            return logits[:, 0], h2[:, 0], cache

        fns = {"whole step, picked": jax.jit(whole), "at one position": jax.jit(one)}
        outs = {name: jax.block_until_ready(fn(cache, at)) for name, fn in fns.items()}  # compile, and compare
        for a, b in zip(outs["whole step, picked"][:2], outs["at one position"][:2], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        cases[(rows, T)] = (fns, cache, at)
    seconds = {key: {name: [] for name in fns} for key, (fns, _, _) in cases.items()}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for key, (fns, cache, at) in cases.items():
            for name, s in alternating_seconds(fns, (cache, at), calls=args.calls, round_index=r).items():
                seconds[key][name].append(s)
    rows_out = []
    for (rows, T), per in seconds.items():
        ms = {name: 1e3 * float(np.median(v)) for name, v in per.items()}
        ratios = [w / o for w, o in zip(per["whole step, picked"], per["at one position"], strict=True)]
        rows_out.append({"rows": rows, "positions": T, "ms": ms, "speedup": float(np.median(ratios)),
                         "speedup_per_round": [round(x, 3) for x in ratios]})  # fmt: skip
    record = {
        "command": "python benchmarks/draft_extend.py"
        + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        + (f" --calls {args.calls}" if args.calls != 200 else ""),
        "rounds": args.rounds, "calls": args.calls, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "platform": jax.default_backend(), "jax": jax.__version__,
        "results": rows_out,
    }  # fmt: skip
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    table = [
        "| rows x positions | whole step, picked (ms) | at one position (ms) | speedup (median; per round) |",
        "|---|---|---|---|",
    ]
    for r in rows_out:
        per_round = ", ".join(f"{x:.2f}" for x in r["speedup_per_round"])
        table.append(
            f"| {r['rows']} x {r['positions']} | {r['ms']['whole step, picked']:.3f} | "
            f"{r['ms']['at one position']:.3f} | **{r['speedup']:.2f}x** ({per_round}) |"
        )
    md = [
        "# The draft-extend's drafter step at one position per row",
        "",
        f"Written by `{record['command']}`: the bundled drafter (float32, one CPU device, this project's shared 2-core "
        f"machine), its first step jitted two ways over a dense cache of {POSITIONS} positions per row, "
        f"{args.calls} calls per timing, {args.rounds} rounds alternating the order; load average "
        f"{tuple(round(x, 1) for x in load_before)} before, {tuple(round(x, 1) for x in record['load_average_after'])} "
        "after. Same logits and h2 (asserted to 1e-5).",
        "",
        *table,
        "",
    ]
    args.output.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
