"""What feeding the drafter a prompt buys and costs: a k = 4 chain on rows fed the drafter at prefill against rows
that are not (`DraftPolicy.feeds_drafter`), in-process, in lockstep.

An adaptive engine drafts from the drafter's cache, which prefill fills over the whole prompt for a fed row; for an
unfed one the first chain segment runs the drafter from the prompt's last position on (spec_loop's
`_prompt_extend`). Two engines over the bundled pair (8 slots, batch buckets 1 and 8, 256 positions), their policy
pinned to the k = 4 chain (adaptive.py's `Scripted`), one feeding every row and one none, serve the same greedy
requests one at a time (c = 1): per prompt set, the drafter's conditional acceptance a_j per draft position and the
tokens per cycle E the chain reached on each, the tokens/s of --max-tokens-token requests, and the seconds of the
prompts' prefill alone (the same prompts as 1-token requests). Same tokens asserted (greedy output does not
depend on the drafter's cache).

    python benchmarks/serve_feed.py      # writes benchmarks/results/serve_feed.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_engine import Clients, acceptance, lockstep, report

ROOT = Path(__file__).resolve().parent.parent
SETS = {"humaneval": 16, "held-out": 15}  # the held-out files give 15 distinct prompts


def serve(engines: dict, prompts, max_tokens: int, order) -> dict:
    """Every engine serves `prompts` one at a time, in lockstep: {name: (tokens/s, seconds, counters' delta)}."""
    before = {name: e.executor.counters() for name, e in engines.items()}
    clients = {name: Clients(e, prompts, 1, max_tokens, len(prompts)) for name, e in engines.items()}
    lockstep(clients, order)
    tokens = [c.tokens for c in clients.values()]
    assert all(t == tokens[0] for t in tokens), "fed and unfed rows gave different tokens"
    return {n: (c.rate, c.seconds, engines[n].executor.counters().minus(before[n])) for n, c in clients.items()}


def chain_figures(delta) -> dict:
    """The conditional acceptance a_j per draft position and the tokens per row-cycle E a segment's counters hold."""
    counted = acceptance(delta)
    return {"a_j": counted["a_j"], "E": 1 + counted["accepted_per_cycle"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt at most (default %(default)s)")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_feed.json")
    args = p.parse_args()
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.adaptive import Scripted
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    config = EngineConfig(max_batch=8, max_context=256, draft=DraftShape(4), batch_buckets=(1, 8), adaptive=True)
    engines = {}
    for name, feed in (("fed", True), ("unfed", False)):
        engines[name] = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
        engines[name].warmup(lambda _: None)
        engines[name].scheduler.policy = Scripted((DraftShape(4),), feed)
    order, results, load_before = np.random.default_rng(0), {}, os.getloadavg()
    serve(engines, prompt_sets.load("humaneval", tokenizer, 4, max_tokens=args.prompt_tokens).ids, 8, order)  # warm
    for name, count in SETS.items():
        prompts = prompt_sets.load(name, tokenizer, count, max_tokens=args.prompt_tokens).ids
        decode = serve(engines, prompts, args.max_tokens, order)
        prefill = serve(engines, prompts, 1, order)
        results[name] = {
            e: {**chain_figures(decode[e][2]), "tok_s": decode[e][0], "prefill_s": prefill[e][1]} for e in engines
        }
        print(name, json.dumps(results[name]), flush=True)
    record = {
        "command": f"python benchmarks/serve_feed.py --max-tokens {args.max_tokens} "
        f"--prompt-tokens {args.prompt_tokens}",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    table = [
        "| prompts | rows | a_j | E | tok/s | prefill s | unfed / fed: E, tok/s, prefill s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        fed, unfed = r["fed"], r["unfed"]
        ratio = ", ".join(f"{unfed[k] / fed[k]:.3f}" for k in ("E", "tok_s", "prefill_s"))
        for e, m in r.items():
            a = ", ".join("-" if x is None else f"{x:.2f}" for x in m["a_j"])
            tail = ratio if e == "unfed" else ""
            table.append(f"| {name} | {e} | {a} | {m['E']:.2f} | {m['tok_s']:.0f} | {m['prefill_s']:.3f} | {tail} |")
    title = "Feeding the drafter a prompt: a k = 4 chain on fed rows vs unfed rows"
    report(args.output, record, title, "c = 1, greedy; prefill: the same prompts as 1-token requests", table)


if __name__ == "__main__":
    main()
