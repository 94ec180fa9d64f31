"""Adaptive speculation per context range: acceptance and tokens/s of a fixed chain, plain decoding and auto
(`--num-steps auto`) as the rows' live context grows (in-process, no HTTP).

Three engines over the bundled pair (--concurrency slots, batch buckets 1 and --concurrency, 2,048 positions per slot:
the pair's context; its target's original context is 512, YaRN past it; its drafter trained on 176-token sequences):
fixed k = 4 (the chain the bundled tune.json recommends), plain decoding (k = 0, no drafter), and auto (per segment
plain or the chain, from tune.json's recorded acceptance and the warm-up's times, as `jaxspec serve` starts). The same
engines then serve one load per context range in turn (the auto policy keeps what it learned, as a server does): c
clients send --requests greedy requests of --max-tokens tokens in all, each prompt a held-out standard-library file of
the pair's split cut to --prompts tokens (so a row's live length stays in one of adaptive.py's context ranges: <= 256,
257-1,024, 1,025-4,096 positions). The three engines serve a load in lockstep (serve_engine.py's `lockstep`: one step
each in a shuffled order, so other work on this shared machine falls on every engine alike); tokens/s is each engine's
tokens over its own steps' seconds, prefill included. Per range: the chain's acceptance (accepted drafts per row-cycle
and a_1..a_4, from the k = 4 engine's counters over that load), each engine's tokens/s, auto / the best fixed shape, and
auto's segments per shape. Every engine must produce the same tokens (asserted: greedy output does not depend on the
draft). The prompts must pass prompt_sets.py's diversity check. They stay the held-out files, not --prompt-set: the
ranges need prompts of 768 and 1,792 tokens, and no HumanEval problem has more than 487 (ShareGPT's long turns are
English the pair never saw).

    python benchmarks/serve_long_context.py      # writes benchmarks/results/serve_long_context.{json,md}
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_engine import Clients, acceptance, as_served, load_text, lockstep

ROOT = Path(__file__).resolve().parent.parent


class Counted(Clients):
    """`Clients` that also count the engine's segments per draft shape."""

    def __init__(self, *args):
        super().__init__(*args)
        self.segments = collections.Counter()

    def step(self) -> None:
        super().step()
        segment = self.engine.scheduler._segment_run
        if segment is not None:
            self.segments[segment.draft.label] += 1


def long_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the bundled pair's held-out standard-library files (never trained on; this
    Python's copies), each prompt from a different file on, the next ones joined while it is too short."""
    from jaxspec import bundled

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = json.loads((bundled.ROOT / "prompts.json").read_text())["held_out_files"]
    ids = [tokenizer.encode((stdlib / f).read_text()) for f in files if (stdlib / f).is_file()]
    prompts = []
    for i in range(count):
        tokens, j = [], i
        while len(tokens) < length:
            tokens, j = tokens + ids[j % len(ids)], j + 1
        prompts.append(tokens[:length])
    prompt_sets.check_prompts(prompts, [f"{length}-token prompt {i}" for i in range(count)])
    return prompts


def serve_range(engines: dict, prompts, args, order) -> dict:
    """The three engines serving one load in lockstep: their tokens/s, the chain's acceptance, auto's segments."""
    before = engines["k=4"].executor.counters()
    clients = {
        name: Counted(e, prompts, args.concurrency, args.max_tokens, args.requests // args.concurrency)
        for name, e in engines.items()
    }
    lockstep(clients, order)
    tokens = {name: c.tokens for name, c in clients.items()}
    assert tokens["auto"] == tokens["k=4"] == tokens["plain"], "the engines' tokens differ"
    rates = {name: c.rate for name, c in clients.items()}
    best = max(rates["k=4"], rates["plain"])
    return {
        "tok_s": rates,
        "auto_over_best": rates["auto"] / best,
        "chain": acceptance(engines["k=4"].executor.counters().minus(before)),
        "auto_segments": dict(clients["auto"].segments),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="128,768,1792", help="prompt tokens per range (comma-separated)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_long_context.json")
    args = p.parse_args()
    left_out = as_served()
    from jaxspec import bundled
    from jaxspec.cli.serve import _recorded_acceptance
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.adaptive import context_range
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    tune = ROOT / "benchmarks" / "results" / "tune_bundled" / "tune.json"
    buckets = (1, args.concurrency) if args.concurrency > 1 else (1,)
    config = EngineConfig(
        max_batch=max(args.concurrency, 1), max_context=2048, draft=DraftShape(4), batch_buckets=buckets
    )
    stop = tokenizer.stop_ids
    load_before = os.getloadavg()
    engines = {
        "k=4": Engine(target, drafter, config, stop_ids=stop),
        "plain": Engine(target, None, dataclasses.replace(config, draft=DraftShape(0)), stop_ids=stop),
        "auto": Engine(
            target,
            drafter,
            dataclasses.replace(config, adaptive=True),
            stop_ids=stop,
            acceptance=_recorded_acceptance(tune),
        ),
    }
    for e in engines.values():
        e.warmup(lambda _: None)
    order, results = np.random.default_rng(0), {}
    for length in (int(x) for x in args.prompts.split(",")):
        prompts = long_prompts(tokenizer, length, args.requests)
        span = context_range(length + args.max_tokens)
        assert span == context_range(length), f"--prompts {length}: its rows would cross a context range"
        results[f"{length}"] = serve_range(engines, prompts, args, order) | {"context_range": span}
        print(length, json.dumps(results[f"{length}"]), flush=True)
    command = (
        f"python benchmarks/serve_long_context.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
        f"--requests {args.requests} --concurrency {args.concurrency}"
    )
    record = {
        "command": command,
        "environment_left_out": left_out,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    write_table(record, args.output.with_suffix(".md"))


def write_table(record: dict, path: Path) -> None:
    load = load_text(record["load_average_before"], record["load_average_after"])
    lines = [
        "# Adaptive speculation per context range: auto vs a fixed chain and plain decoding",
        "",
        f"Written by `{record['command']}` (the same three engines serve the ranges in turn). CPU only, the project's "
        f"shared {record['cpus']}-core machine: {load}.",
        "",
        "| prompt tokens | range | k=4 accepted / cycle | k=4 a_j | k=4 tok/s | plain tok/s | auto tok/s | "
        "auto / the best | auto's segments |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for length, r in record["results"].items():
        m, chain = r["tok_s"], r["chain"]
        a_j = ", ".join("-" if a is None else f"{a:.2f}" for a in chain["a_j"])
        segments = ", ".join(f"{k} {v}" for k, v in sorted(r["auto_segments"].items()))
        lines.append(
            f"| {length} | {r['context_range']} | {chain['accepted_per_cycle']:.2f} | {a_j} | {m['k=4']:.0f} | "
            f"{m['plain']:.0f} | {m['auto']:.0f} | {r['auto_over_best']:.3f} | {segments} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
