"""What `--num-steps auto` costs when it always chooses plain decoding (vLLM's "K=0 tax", vLLM #49548): an adaptive
engine whose policy is pinned to plain decoding against a plain-only engine (no drafter), in-process, in lockstep.

The adaptive engine's plain segments keep the target states the drafter would need (`LoopState.aux_BSI`) and its
prefill feeds the drafter unless the policy says otherwise; this pins the policy to plain decoding and to feeding
nothing, so what is left is the price of being able to switch. 8 slots, batch buckets 1 and 8, 256 positions; c
clients send --requests greedy requests of --max-tokens tokens in all, --rounds times (the first discarded as warm);
tokens/s over each engine's own steps; same tokens asserted. With --temperature T > 0 the requests are sampled (request
i with seed i, so both engines draw the same tokens), and segments run the per-row program, as a client's default
temperature of 1 makes them.

    python benchmarks/serve_k0_tax.py      # writes benchmarks/results/serve_k0_tax.{json,md}
    python benchmarks/serve_k0_tax.py --temperature 1      # ... serve_k0_tax_sampled.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from serve_engine import Clients, as_served, lockstep, report  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--output", type=Path, help="default: benchmarks/results/serve_k0_tax[_sampled].json")
    p.add_argument("--int4-experts", default="auto", help="the target's INT4 experts: auto, packed, dense")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, request i seeded i")
    args = p.parse_args()
    left_out = as_served()
    if not args.temperature >= 0:
        p.error(f"--temperature: expected a number >= 0, got {args.temperature}")
    name = "serve_k0_tax_sampled.json" if args.temperature else "serve_k0_tax.json"
    args.output = args.output or ROOT / "benchmarks" / "results" / name
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.decoding.sampling import Sampling
    from jaxspec.decoding.sampling_params import RowSpec
    from jaxspec.serving.adaptive import Scripted
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair(int4_experts=args.int4_experts)
    prompts = [tokenizer.encode(p)[:128] for p in bundled.prompts()]
    config = EngineConfig(max_batch=8, max_context=256, draft=DraftShape(0), batch_buckets=(1, 8))
    engines = {
        "plain": Engine(target, None, config, stop_ids=tokenizer.stop_ids),
        "auto, plain only": Engine(
            target,
            drafter,
            dataclasses.replace(config, draft=DraftShape(4), adaptive=True),
            stop_ids=tokenizer.stop_ids,
        ),
    }
    for e in engines.values():
        e.warmup(lambda _: None)
    engines["auto, plain only"].scheduler.policy = Scripted((DraftShape(0),), feed=False)
    order, totals = np.random.default_rng(0), {}
    spec = (lambda i: RowSpec(Sampling(temperature=args.temperature), seed=i)) if args.temperature else None
    load_before = os.getloadavg()
    for c in (1, 8):
        for i in range(args.rounds):
            clients = {n: Clients(e, prompts, c, args.max_tokens, args.requests // c, spec) for n, e in engines.items()}
            lockstep(clients, order)
            assert clients["plain"].tokens == clients["auto, plain only"].tokens, f"c={c}: tokens differ"
            if i:  # the first round warms the programs up
                for name, client in clients.items():
                    t = totals.setdefault((name, c), np.zeros(2))
                    t += [sum(map(len, client.tokens)), client.seconds]
    results = {}
    for c in (1, 8):
        rate = {name: float(np.divide(*totals[(name, c)])) for name in engines}
        results[f"c={c}"] = {"tok_s": rate, "auto_over_plain": rate["auto, plain only"] / rate["plain"]}
        print(c, json.dumps(results[f"c={c}"]), flush=True)
    record = {
        "command": f"python benchmarks/serve_k0_tax.py --max-tokens {args.max_tokens} --requests {args.requests} "
        f"--rounds {args.rounds} --int4-experts {args.int4_experts}"
        + (f" --temperature {args.temperature:g}" if args.temperature else ""),
        "environment_left_out": left_out,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    table = ["| concurrency | plain tok/s | auto, plain only tok/s | auto / plain |", "|---|---|---|---|"]
    for name, r in results.items():
        m = r["tok_s"]
        table.append(f"| {name[2:]} | {m['plain']:.0f} | {m['auto, plain only']:.0f} | {r['auto_over_plain']:.3f} |")
    title = "The K=0 tax: `--num-steps auto` pinned to plain decoding vs a plain-only engine"
    how = f"sampled at temperature {args.temperature:g}, request i seeded i" if args.temperature else "greedy"
    report(args.output, record, title, f"{how}, in lockstep, the first of {args.rounds} rounds discarded", table)


if __name__ == "__main__":
    main()
