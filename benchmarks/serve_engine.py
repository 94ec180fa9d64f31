"""The serving engine in-process (no HTTP): the engine's scheduling options A/B, interleaved in one run.

Each variant is an `Engine` over the bundled pair (8 slots, batch buckets 1 and 8, 512 positions per slot), for the
speculative (k = 4) and plain (k = 0) loops. Concurrency c: c clients, each sending 2 greedy requests of 64 tokens
one after the other (a client's next request is submitted when its previous one finishes), driven by `Engine.step`
in this thread. Rounds interleave the variants; the median tokens/s per (variant, k, c) is reported, and every
variant must produce the same tokens (asserted).

Variants: "old": one context (every segment over all 512 positions) and the per-row program always (the engine
before context buckets and the static-greedy program); "new": the defaults. With --tree STEPS:TOPK:TOKENS the
variants are "new" and "tree": the defaults drafting that tree instead of the k = 4 chain (plain decoding has no
tree, so the tree's k = 0 figures are "new"'s).

    python benchmarks/serve_engine.py --rounds 2        # writes benchmarks/results/serve_engine.json
    python benchmarks/serve_engine.py --rounds 2 --tree 4:2:8 --output benchmarks/results/serve_engine_tree.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

VARIANTS = {"old": dict(greedy_program=False, context_buckets=(512,)), "new": {}}


def load(engine, prompts, c: int, max_tokens: int, per_client: int = 2):
    """`c` clients, each sending `per_client` requests of `max_tokens` one after the other, driven by `engine.step`
    here (Python's garbage collector paused while timed); returns (tokens/s, every request's tokens)."""
    from jaxspec.serving.engine import Request

    reqs = [Request(prompts[i % len(prompts)], max_tokens) for i in range(per_client * c)]
    gc.collect()
    with paused_gc():
        return _drive(engine, reqs, c)


@contextlib.contextmanager
def paused_gc():
    """Python's garbage collector off inside (timeit's default: a collection is not the code's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _drive(engine, reqs, c: int):
    start = time.perf_counter()
    pending = list(reqs)
    active = [pending.pop(0) for _ in range(c)]
    for r in active:
        engine.submit(r)
    while any(not r.finished for r in reqs):
        engine.step()
        for r in list(active):
            if r.finished:
                active.remove(r)
                if pending:
                    active.append(pending.pop(0))
                    engine.submit(active[-1])
    return sum(len(r.tokens) for r in reqs) / (time.perf_counter() - start), [r.tokens for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tree", help="also a tree variant: STEPS:TOPK:TOKENS (see `jaxspec tune --trees`)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/serve_engine.json"))
    args = p.parse_args()
    if args.tree:
        from jaxspec.decoding import DraftShape

        shape = DraftShape.parse(args.tree)
        if not shape.tree:
            p.error(f"--tree: {args.tree!r} is a chain (topk 1); give STEPS:TOPK:TOKENS with TOPK > 1")
        VARIANTS.pop("old")
        VARIANTS["tree"] = dict(draft=shape)
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(p) for p in bundled.prompts()]
    engines, warmup = {}, {}
    for k in (4, 0):
        for name, options in VARIANTS.items():
            if name == "tree" and not k:
                continue
            options = dict(options)
            draft = options.pop("draft", DraftShape(k))
            config = EngineConfig(max_batch=8, max_context=512, draft=draft, batch_buckets=(1, 8), **options)
            engine = Engine(target, None if draft.plain else drafter, config, stop_ids=tokenizer.stop_ids)
            warmup[f"{name} k={k}"] = engine.warmup(lambda _: None)
            engines[(k, name)] = engine
    rates, outputs = collections.defaultdict(list), {}
    for _ in range(args.rounds):
        for c in (1, 8):
            for k in (4, 0):
                for name in VARIANTS:
                    if (k, name) not in engines:
                        continue
                    rate, tokens = load(engines[(k, name)], prompts, c, args.max_tokens)
                    rates[(name, k, c)].append(rate)
                    assert outputs.setdefault((k, c), tokens) == tokens, f"{name} k={k} c={c}: different tokens"
    table = {}
    for name in VARIANTS:
        m = {
            (k, c): float(np.median(rates[(name if (k, name) in engines else "new", k, c)]))
            for k in (4, 0)
            for c in (1, 8)
        }
        table[name] = {
            "tok_s": {f"k={k} c={c}": v for (k, c), v in m.items()},
            "speculative_c8_over_c1": m[(4, 8)] / m[(4, 1)],
            "plain_c8_over_c1": m[(0, 8)] / m[(0, 1)],
            "speculative_over_plain_c1": m[(4, 1)] / m[(0, 1)],
        }
        print(name, json.dumps(table[name]))
    record = {
        "command": f"python benchmarks/serve_engine.py --rounds {args.rounds} --max-tokens {args.max_tokens}"
        + (f" --tree {args.tree}" if args.tree else ""),
        "load_average": os.getloadavg(),
        "warmup_s": warmup,
        "variants": table,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
