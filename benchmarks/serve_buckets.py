"""What each compiled segment bucket buys: a segment's time in the batch bucket the scheduler picks against larger
ones.

`jaxspec serve` compiles one segment program per batch bucket x draft shape x (greedy, per-row) program, and every
program costs start-up time and, on XLA:CPU, about 1,500 of the process's memory maps (docs/serving.md#start-up).
This measures what a bucket saves at run time, so the defaults keep only the buckets that pay: with n live rows
(bundled prompts, ~100 positions each, greedy), the device time of one segment (--cycles cycles) over rows [0, b),
for b in the batch buckets that hold n rows, for plain decoding (k = 0) and the k = 4 chain; and for one row the
static-greedy program against the per-row one. (Segments had context buckets too before attention read each row's
blocks in place: benchmarks/results/serve_buckets.md from then measured them.) Every variant starts from the same
saved state; variants are interleaved, --repeats times, and the median is reported with its ratio to the smallest
bucket's (ratios in one run: the machine is shared).

    python benchmarks/serve_buckets.py      # writes benchmarks/results/serve_buckets.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--live", default="1,2,4", help="live row counts to measure (comma-separated)")
    p.add_argument("--cycles", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_buckets.json")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxspec import bundled
    from jaxspec.decoding.draft_shape import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig, Request
    from jaxspec.serving.plan import Segment

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(p)[:64] for p in bundled.prompts()]
    chain, plain = DraftShape(4), DraftShape(0)
    cfg = EngineConfig(max_batch=args.max_batch, max_context=args.max_context, draft=chain, adaptive=True)
    rows_buckets = [b for b in (1, 2, 4, 8, 16) if b <= args.max_batch]
    results = []
    for n in (int(x) for x in args.live.split(",")):
        engine = Engine(target, drafter, cfg, stop_ids=tokenizer.stop_ids)
        for i in range(n):
            engine.submit(Request(prompts[i % len(prompts)], args.max_context // 2))
        prefill(engine)
        ex = engine.executor
        saved = jax.tree.map(jnp.copy, (ex.state, ex.pool))
        variants = [(b, shape, True) for b in rows_buckets if b >= n for shape in (plain, chain)]
        if n == 1:
            variants += [(1, shape, False) for shape in (plain, chain)]
        times = {v: [] for v in variants}
        for repeat in range(args.repeats + 1):  # the first round compiles
            for v in variants:
                b, shape, greedy = v
                ex.state, ex.pool = jax.tree.map(jnp.copy, saved)
                ex._q_stale = False
                jax.block_until_ready((ex.state, ex.pool))
                start = time.perf_counter()
                ex.segment(Segment(b, shape, greedy, args.cycles))
                jax.block_until_ready(ex.state)
                if repeat:
                    times[v].append(time.perf_counter() - start)
            print(f"live {n}: round {repeat} done", flush=True)
        for (b, shape, greedy), ts in times.items():
            base = times[(min(x for x in rows_buckets if x >= n), shape, True)]
            median = statistics.median(ts)
            results.append(
                dict(
                    live=n,
                    rows=b,
                    draft=shape.label,
                    greedy=greedy,
                    median_ms=1e3 * median,
                    ratio=median / statistics.median(base),
                )
            )
            print(results[-1], flush=True)
        del engine, ex, saved
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args) | {"output": str(args.output.relative_to(ROOT))}, jax=jax.__version__)
    args.output.write_text(json.dumps(dict(config=meta, results=results), indent=1) + "\n")
    lines = [
        "| live rows | segment rows | draft | program | median ms | / smallest bucket |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        program = "greedy" if r["greedy"] else "per-row"
        lines.append(
            f"| {r['live']} | {r['rows']} | {r['draft']} | {program} | {r['median_ms']:.1f} | {r['ratio']:.2f} |"
        )
    args.output.with_suffix(".md").write_text(
        "# serve_buckets\n\n`python benchmarks/serve_buckets.py`\n\n" + "\n".join(lines) + "\n"
    )


def prefill(engine) -> None:
    """Step `engine` until every submitted request is admitted and prefilled (generating)."""
    slots = engine.scheduler.slots
    while engine.scheduler.queue_depth or any(s is not None and s.next_chunk is not None for s in slots):
        engine.step()


if __name__ == "__main__":
    main()
