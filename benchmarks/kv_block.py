"""Attention's live-prefix block on the CPU: the platform default (`mla.CPU_KV_BLOCK`, one pool block) against the
accelerators' `mla.KV_BLOCK` (what the CPU read by until 2026-12-05), engines in lockstep in one process.

Two `Engine`s per draft shape over the bundled pair at the serving defaults (8 slots x 1,024 positions, batch
buckets 1, 2, 4, 8, 64-position pool blocks): one whose target (and so its drafter) reads the live prefix in blocks
of KV_BLOCK positions (a copy of the target whose `kv_block` is KV_BLOCK), one at the platform's default; for a
fixed k = 4 chain and for plain decoding. Concurrency c: c clients send --requests greedy requests of --max-tokens
tokens in all, --rounds times (the first discarded as warm), the engines of a shape stepped in lockstep
(serve_engine.py's `lockstep`); tokens/s over each engine's own steps (prefill included). Both engines' tokens must
be equal (asserted: the block only changes the order of the softmax's sums). Prompts: --prompt-set (prompt_sets.py;
default 16 HumanEval prompts of at most 256 tokens).

    python benchmarks/kv_block.py      # writes benchmarks/results/kv_block.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_engine import Clients, lockstep, report  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent
SHAPES = (4, 0)  # the chain's steps (0: plain decoding)


def engines(target, drafter, tokenizer, steps: int) -> dict:
    """{"KV_BLOCK": engine, "default": engine} for a draft of `steps` (0: plain, no drafter), each warmed up: the
    first over a copy of the target (and of the drafter on it) that reads by KV_BLOCK, the second over the pair."""
    from jaxspec import Target
    from jaxspec.decoding import DraftShape
    from jaxspec.models.mla import KV_BLOCK
    from jaxspec.serving.engine import Engine, EngineConfig

    class ReadsByKvBlock(Target):
        kv_block = KV_BLOCK  # in place of the platform's (Target.kv_block)

    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}
    wide = ReadsByKvBlock(**fields)  # another object: its own compiled programs (LoopCache.of)
    pairs = {"KV_BLOCK": (wide, dataclasses.replace(drafter, target=wide)), "default": (target, drafter)}
    config = EngineConfig(draft=DraftShape(steps))
    made = {}
    for name, (t, d) in pairs.items():
        made[name] = Engine(t, d if steps else None, config, stop_ids=tokenizer.stop_ids)
        made[name].warmup(lambda _: None)
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "kv_block.json")
    prompt_sets.add_arguments(p, count=16, max_tokens=256)
    args = p.parse_args()
    from jaxspec import bundled
    from jaxspec.models.mla import KV_BLOCK

    target, drafter, tokenizer = bundled.load_pair()
    prompts = prompt_sets.from_args(args, tokenizer).ids
    levels = [int(c) for c in args.concurrency.split(",")]
    order, results, load_before = np.random.default_rng(0), {}, os.getloadavg()
    for steps in SHAPES:
        pair = engines(target, drafter, tokenizer, steps)
        for c in levels:
            totals = {name: np.zeros(2) for name in pair}
            for i in range(args.rounds):
                clients = {n: Clients(e, prompts, c, args.max_tokens, args.requests // c) for n, e in pair.items()}
                lockstep(clients, order)
                assert clients["KV_BLOCK"].tokens == clients["default"].tokens, f"k={steps} c={c}: tokens differ"
                for name, client in clients.items() if i else ():  # the first round warms up
                    totals[name] += [sum(map(len, client.tokens)), client.seconds]
            rate = {name: float(np.divide(*t)) for name, t in totals.items()}
            results[f"k={steps} c={c}"] = {"tok_s": rate, "default_over_kv_block": rate["default"] / rate["KV_BLOCK"]}
            print(f"k={steps} c={c}", results[f"k={steps} c={c}"], flush=True)
    record = {
        "command": f"python benchmarks/kv_block.py --max-tokens {args.max_tokens} --requests {args.requests} "
        f"--rounds {args.rounds} --concurrency {args.concurrency} {prompt_sets.flags(args)}",
        "kv_block": {"KV_BLOCK": KV_BLOCK, "default": target.kv_block},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    columns = f"KV_BLOCK ({KV_BLOCK}) tok/s | default ({target.kv_block}) tok/s"
    table = [f"| shape, concurrency | {columns} | default / KV_BLOCK |", "|---|---|---|---|"]
    for name, r in results.items():
        m = r["tok_s"]
        table.append(f"| {name} | {m['KV_BLOCK']:.0f} | {m['default']:.0f} | {r['default_over_kv_block']:.3f} |")
    title = "Attention's live-prefix block on the CPU: the platform default against KV_BLOCK"
    note = f"greedy, in lockstep, the first of {args.rounds} rounds discarded; CPU only, the shared 2-core machine"
    report(args.output, record, title, note, table)


if __name__ == "__main__":
    main()
