"""Prefill beside the segment program, in-process (no HTTP): what stand-alone prefill costs the running streams.

One `Engine` over the bundled pair (8 slots, fixed k = 3, batch buckets 1 and 8, 512 positions per slot, prefill
chunk 64, the prefix cache off so every round prefills every prompt), driven by `Engine.step` in this thread:
(a) concurrency 8 (8 clients, each sending 2 greedy requests of --max-tokens tokens one after the other, short
    bundled prompts): the share of wall time spent in stand-alone prefill programs, i.e. the executor's
    gather -> `SpecLoop.prefill_slot` -> scatter of one chunk of one row run as programs of their own (timed here,
    in the benchmark only, by wrapping those calls with `block_until_ready` before and after; a chunk run inside
    the segment program is part of the segment, not counted);
(b) 4 streaming requests (short prompts, --stream-tokens tokens each) generating while 4 long prompts (--long
    tokens each, --long // 64 prefill chunks) arrive, one every 2 steps: the p90 inter-token latency of the streams
    over the window from the first long prompt's arrival to the last one's first token, from the requests'
    `on_update` times (each token of an update counts the mean gap since the stream's previous update, as the
    engine's ITL metric does), and the p90 of the gaps between updates themselves.
Rounds repeat both; medians are reported, with the warm-up seconds.

    python benchmarks/serve_prefill.py --rounds 3 --label before   # writes benchmarks/results/serve_prefill.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
from serve_engine import load  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def prefill_timer(engine):
    """Time the stand-alone prefill programs the engine's executor runs (gather of one row over every position ->
    prefill_slot -> scatter); yields a one-entry list with the seconds so far."""
    import jax

    from jaxspec.serving import executor as module

    total, started = [0.0], []
    gather, scatter = module._gather, module._scatter
    concrete = lambda x: not isinstance(jax.tree.leaves(x)[0], jax.core.Tracer)  # noqa: E731

    def timed_gather(state, pool, tables, start, rows, positions):
        if positions is None and concrete(state):  # a prefill chunk's window (a segment names its positions)
            jax.block_until_ready((state, pool))
            started.append(time.perf_counter())
        return gather(state, pool, tables, start, rows, positions)

    def timed_scatter(*args):
        out = scatter(*args)
        if started and concrete(args[0]):
            jax.block_until_ready(out)
            total[0] += time.perf_counter() - started.pop()
        return out

    module._gather, module._scatter = timed_gather, timed_scatter
    try:
        yield total
    finally:
        module._gather, module._scatter = gather, scatter


def prefill_share(engine, prompts, max_tokens: int) -> tuple[float, float, float]:
    """(a): (share of wall time in stand-alone prefill, wall seconds, tokens/s) at concurrency 8."""
    with prefill_timer(engine) as prefill:
        start = time.perf_counter()
        rate, _ = load(engine, prompts, 8, max_tokens)
        wall = time.perf_counter() - start
    return prefill[0] / wall, wall, rate


def streams_under_prefill(engine, prompts, long_prompts, stream_tokens: int) -> dict:
    """(b): 4 streams generating while the long prompts arrive, one every 2 steps; the streams' p90 ITL."""
    from jaxspec.serving.engine import Request

    updates = {i: [] for i in range(4)}

    def on_update(i):
        return lambda r, new: new and updates[i].append((time.perf_counter(), len(new)))

    streams = [Request(prompts[i], stream_tokens, on_update=on_update(i)) for i in range(4)]
    for r in streams:
        engine.submit(r)
    while not all(r.tokens for r in streams):
        engine.step()
    longs, pending = [], list(long_prompts)
    first_arrival, steps = None, 0
    while not all(r.finished for r in streams + longs):
        if pending and steps % 2 == 0:
            longs.append(Request(pending.pop(0), 8))
            engine.submit(longs[-1])
            first_arrival = first_arrival or longs[-1].arrival
        engine.step()
        steps += 1
    window_end = max(r.first_token_at for r in longs)
    per_token, gaps = [], []
    for ups in updates.values():
        for (before, _), (at, n) in zip(ups, ups[1:], strict=False):
            if first_arrival <= at <= window_end:
                per_token += [(at - before) / n] * n
                gaps.append(at - before)
    return {
        "itl_p90_ms": 1e3 * float(np.percentile(per_token, 90)),
        "itl_p50_ms": 1e3 * float(np.percentile(per_token, 50)),
        "update_gap_p90_ms": 1e3 * float(np.percentile(gaps, 90)),
        "stream_tokens_in_window": len(per_token),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=320)
    p.add_argument("--long", type=int, default=384)
    p.add_argument("--label", default="before")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_prefill.json")
    args = p.parse_args()
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(p) for p in bundled.prompts()]
    text = [t for prompt in prompts for t in prompt]
    long_prompts = [(text[i * 7 :] + text)[: args.long] for i in range(4)]  # distinct from their first token
    config = EngineConfig(8, 512, DraftShape(3), batch_buckets=(1, 8), prefix_cache=False)
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    warmup = engine.warmup(lambda _: None)
    print(f"warm-up {warmup:.1f}s", flush=True)
    load_before = os.getloadavg()
    shares, itl = [], []
    for _ in range(args.rounds):
        shares.append(prefill_share(engine, prompts, args.max_tokens))
        itl.append(streams_under_prefill(engine, prompts, long_prompts, args.stream_tokens))
        print(json.dumps({"prefill_share": shares[-1][0], "tok_s": shares[-1][2], **itl[-1]}), flush=True)
    median = lambda xs: float(np.median(xs))  # noqa: E731
    result = {
        "warmup_s": warmup,
        "c8_prefill_share": median([s[0] for s in shares]),
        "c8_tok_s": median([s[2] for s in shares]),
        **{k: median([r[k] for r in itl]) for k in itl[0]},
        "rounds": [{"prefill_share": s[0], "tok_s": s[2], **r} for s, r in zip(shares, itl, strict=True)],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    print(args.label, json.dumps({k: v for k, v in result.items() if k != "rounds"}), flush=True)
    record = json.loads(args.output.read_text()) if args.output.exists() else {}
    record["command"] = (
        f"python benchmarks/serve_prefill.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
        f"--stream-tokens {args.stream_tokens} --long {args.long} --label LABEL"
    )
    record["cpus"] = os.cpu_count()
    record[args.label] = result
    args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
