"""The cache pool and the prefix cache in-process (no HTTP), on the bundled pair (k = 4, greedy):

1. time to first token, cold against warm, for requests that share a prefix of about 1,200 tokens (the bundled
   prompts, repeated) and differ in a short question after it: one slot of 2,048 positions, prefill chunks of 64.
   Cold: the prefix cache is emptied before each request; warm: the prefix is cached. The rounds interleave them and
   the medians are reported; warm and cold give the same tokens (asserted);
2. requests served at once by today's slots against a pool of the same positions: 4 slots x 1,024 positions, and
   16 slots sharing a pool of 4,096 positions (`--kv-cache-tokens 4096`), serving the same 16 requests; each
   request's tokens are the same (asserted);
3. requests that together need more positions than the pool: 8 slots sharing 1,024 positions, 8 requests of about
   300 positions each; they all complete, preempted and resumed, each with its tokens from (2) (asserted).

With --block-sizes it measures only the block size's cost instead: 16 requests sharing a 256-token prefix (96 of
their own tokens, 48 new) on 8 slots x 512 positions, for each block size (prefill chunks of 64), interleaved over
the rounds; median tokens/s, the same tokens for every size (asserted).

    python benchmarks/serve_prefix.py --rounds 5      # writes benchmarks/results/serve_prefix.json
    python benchmarks/serve_prefix.py --rounds 3 --block-sizes 16,32,64 \
        --output benchmarks/results/serve_prefix_blocks.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def serve(engine, requests) -> tuple[float, int]:
    """Submit `requests` together and step until they finish; returns (seconds, the most slots held at once)."""
    for r in requests:
        engine.submit(r)
    start, peak = time.perf_counter(), 0
    while engine.step():
        peak = max(peak, engine.occupancy)
    assert all(r.finish_reason in ("stop", "length") for r in requests)
    return time.perf_counter() - start, peak


def ttft(engine, prompt: list[int], cold: bool) -> tuple[float, list[int], int]:
    from jaxspec.serving.engine import Request

    if cold:
        engine.scheduler.tables.pool.clear()
    r = Request(prompt, 8)
    serve(engine, [r])
    return r.first_token_at - r.arrival, r.tokens, r.cached_tokens


def prefix_ttft(pair, text: list[int], rounds: int) -> dict:
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = pair
    config = EngineConfig(max_batch=1, max_context=2048, batch_buckets=(1,))
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    prefix = (text * 4)[:1200]
    questions = [text[i * 7 : i * 7 + 12] for i in range(rounds)]
    times = {"cold": [], "warm": []}
    cached = []
    for q in questions:
        t_cold, cold_tokens, _ = ttft(engine, prefix + q, cold=True)
        t_warm, warm_tokens, hit = ttft(engine, prefix + q, cold=False)
        assert warm_tokens == cold_tokens, "a prefix hit changed the tokens"
        times["cold"].append(t_cold)
        times["warm"].append(t_warm)
        cached.append(hit)
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    print(f"TTFT cold {cold * 1e3:.1f} ms, warm {warm * 1e3:.1f} ms: warm/cold {warm / cold:.3f}")
    return {
        "prompt_tokens": len(prefix) + len(questions[0]),
        "cached_tokens": cached,
        "ttft_s": times,
        "median_cold_s": cold,
        "median_warm_s": warm,
        "warm_over_cold": warm / cold,
    }


def at_once(pair, text: list[int]) -> dict:
    from jaxspec.serving.engine import Engine, EngineConfig, Request

    target, drafter, tokenizer = pair
    prompts = [(text * 2)[i * 29 : i * 29 + 100 + 7 * (i % 4)] for i in range(16)]
    shapes = {
        "slots 4 x 1024": EngineConfig(max_batch=4, max_context=1024, batch_buckets=(4,)),
        "pool 4096, 16 slots": EngineConfig(max_batch=16, max_context=1024, batch_buckets=(16,), kv_cache_tokens=4096),
        "pool 1024, 8 slots": EngineConfig(max_batch=8, max_context=1024, batch_buckets=(8,), kv_cache_tokens=1024),
    }
    out, reference, engines = {}, None, {}
    for name, config in shapes.items():
        engine = engines[name] = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
        engine.warmup(lambda _: None)
        mine = prompts if "1024, 8" not in name else [(text * 2)[i * 31 : i * 31 + 250] for i in range(8)]
        requests = [Request(p, 48) for p in mine]
        seconds, peak = serve(engine, requests)
        tokens = [r.tokens for r in requests]
        if "1024, 8" in name:  # each against the same request alone on today's slots
            alone = engines["slots 4 x 1024"]
            for p, t in zip(mine, tokens, strict=True):
                single = Request(p, 48)
                serve(alone, [single])
                assert single.tokens == t, "a preempted request's tokens differ from its single-request tokens"
        else:
            reference = reference or tokens
            assert tokens == reference, f"{name}: different tokens"
        positions = sum(len(p) + len(t) for p, t in zip(mine, tokens, strict=True))
        out[name] = {
            "requests": len(requests),
            "positions_needed": positions,
            "pool_positions": config.pool_blocks * config.block,
            "served_at_once": peak,
            "preemptions": engine.scheduler.preemptions,
            "seconds": seconds,
            "tok_s": sum(map(len, tokens)) / seconds,
        }
        print(name, json.dumps(out[name]))
    return out


def block_sizes(pair, text: list[int], sizes: list[int], rounds: int) -> dict:
    from jaxspec.serving.engine import Engine, EngineConfig, Request

    target, drafter, tokenizer = pair
    engines = {}
    for b in sizes:
        config = EngineConfig(max_batch=8, max_context=512, batch_buckets=(8,), block_size=b)
        engines[b] = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
        engines[b].warmup(lambda _: None)
    prefix, rates, outputs = (text * 2)[:256], {b: [] for b in sizes}, None
    for _ in range(rounds):
        for b in sizes:
            requests = [Request(prefix + (text * 2)[i * 23 : i * 23 + 96], 48) for i in range(16)]
            seconds, _ = serve(engines[b], requests)
            rates[b].append(sum(len(r.tokens) for r in requests) / seconds)
            outputs = outputs or [r.tokens for r in requests]
            assert [r.tokens for r in requests] == outputs, f"block size {b}: different tokens"
    out = {str(b): {"tok_s": rates[b], "median_tok_s": statistics.median(rates[b])} for b in sizes}
    print(json.dumps({b: round(v["median_tok_s"], 1) for b, v in out.items()}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-sizes", help="comma-separated block sizes: measure only their cost (see above)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/serve_prefix.json"))
    args = p.parse_args()
    from jaxspec import bundled

    pair = bundled.load_pair()
    text = [t for prompt in bundled.prompts() for t in pair[2].encode(prompt)]
    if args.block_sizes:
        sizes = [int(b) for b in args.block_sizes.split(",")]
        record = {
            "command": f"python benchmarks/serve_prefix.py --rounds {args.rounds} --block-sizes {args.block_sizes}"
            f" --output {args.output}",
            "load_average": os.getloadavg(),
            "block_sizes": block_sizes(pair, text, sizes, args.rounds),
        }
        args.output.write_text(json.dumps(record, indent=2) + "\n")
        return
    record = {
        "command": f"python benchmarks/serve_prefix.py --rounds {args.rounds}",
        "load_average": os.getloadavg(),
        "prefix_ttft": prefix_ttft(pair, text, args.rounds),
        "at_once": at_once(pair, text),
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
