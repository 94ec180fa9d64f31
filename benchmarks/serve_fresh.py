"""A fresh server's first requests: adaptive speculation (`--num-steps auto`) against a fixed chain and plain
decoding, each engine new, nothing discarded (in-process, no HTTP).

What a user of a just-started `jaxspec serve` gets: per case and concurrency c, three engines are built and warmed
up anew (8 slots, batch buckets 1 and 8, 256 positions per slot, the k = 4 chain the bundled tune.json recommends):
fixed k = 4, plain decoding (k = 0, no drafter), and auto (per segment plain or the chain; its warm-up times every
shape over live rows of every bucket, and with the bundled pair it starts from tune.json's recorded acceptance, as
`jaxspec serve` does). c clients then send 16 greedy requests of --max-tokens tokens in all (16 / c each, one after
the other), the three engines served in lockstep (serve_engine.py's `lockstep`: one step each in a shuffled order,
so other work on this shared machine falls on every engine alike); tokens/s is each engine's tokens over its own
steps' seconds, from its first request. Each case and concurrency runs in a process of its own, as a server starts
in one (until 2026-12-05 they ran one after another in one process), in each of --rounds rounds (every case once per
round, its lockstep order drawn from the round's seed: auto / plain decoding at 8 rows moved from 0.938 to 0.977
between two orders of the same three engines, ad hoc, one run each), and the report gives every round and their
median. Cases: the bundled pair, and the bundled target with a scrambled drafter (serve_adaptive.py's `scrambled`:
it accepts almost nothing; no tune.json, so no recorded acceptance). Every engine of a case must produce the same
tokens (asserted: greedy output does not depend on the draft). Prompts: --prompt-set (prompt_sets.py; default 16
HumanEval prompts of at most 128 tokens).

    python benchmarks/serve_fresh.py --rounds 3     # writes benchmarks/results/serve_fresh.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_adaptive import scrambled  # this directory (run as a script)
from serve_engine import Clients, as_served, load_text, lockstep

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 16


CASES = ("bundled pair", "poor drafter")
CONCURRENCY = (1, 8)  # clients per case (the batch buckets: 1 and 8 rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_fresh.json")
    p.add_argument("--int4-experts", default="auto", help="the target's INT4 experts: auto, packed, dense")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each case in a fresh process per round")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process (the children)
    p.add_argument("--concurrency", type=int, choices=CONCURRENCY, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the round's lockstep order
    prompt_sets.add_arguments(p, count=16, max_tokens=128)  # + --max-tokens: inside the 256 positions of a slot
    args = p.parse_args()
    left_out = as_served()  # the children (one per case and round) inherit it
    if args.case:
        print(json.dumps(run_case(args, args.case, args.concurrency, args.seed)), flush=True)
        return
    if args.rounds < 1:
        p.error(f"--rounds: expected at least 1, got {args.rounds}")
    rounds, load_before = {f"{case} c={c}": [] for case in CASES for c in CONCURRENCY}, os.getloadavg()
    for seed in range(args.rounds):  # rounds outermost: a drift in the machine's load falls on every case alike
        for case in CASES:
            for c in CONCURRENCY:
                child = in_child("--case", case, "--concurrency", str(c), "--seed", str(seed))
                loops, prompt_set = child.pop("output_loops"), child.pop("prompt_set")
                rounds[f"{case} c={c}"].append(child)
                print(f"round {seed + 1}", case, c, json.dumps(child), flush=True)
    results = {name: summary(runs) for name, runs in rounds.items()}
    record = {
        "command": f"python benchmarks/serve_fresh.py --max-tokens {args.max_tokens} --rounds {args.rounds} "
        f"--int4-experts {args.int4_experts} {prompt_sets.flags(args)}",
        **prompt_set,
        "environment_left_out": left_out,
        "output_loops": loops,  # recorded, not refused: every engine serves the same tokens
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# A fresh server's first requests: auto vs a fixed chain and plain decoding",
        "",
        f"Written by `{record['command']}` ({REQUESTS} requests per case and concurrency, each in a process of its "
        f"own, each engine new, in each of {args.rounds} rounds; tokens/s: the median over the rounds). CPU only, the "
        f"project's shared {record['cpus']}-core machine: {load_text(load_before, record['load_average_after'])}.",
        "",
        "| case | k=4 tok/s | plain tok/s | auto tok/s | auto / the better, per round | median |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        m, each = r["tok_s"], ", ".join(f"{x:.3f}" for x in r["auto_over_better_rounds"])
        lines.append(
            f"| {name} | {m['k=4']:.0f} | {m['plain']:.0f} | {m['auto']:.0f} | {each} | {r['auto_over_better']:.3f} |"
        )
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")


def summary(runs: list[dict]) -> dict:
    """A case's rounds: the median tokens/s per engine, each round's auto / the better and their median."""
    ratios = [r["auto_over_better"] for r in runs]
    return {
        "tok_s": {name: float(np.median([r["tok_s"][name] for r in runs])) for name in runs[0]["tok_s"]},
        "auto_over_better": float(np.median(ratios)),
        "auto_over_better_rounds": ratios,
        "rounds": runs,
    }


def in_child(*flags: str) -> dict:
    """The JSON a child process of the running script prints last (its command line plus `flags`): each in a process
    of its own, as a server starts in one."""
    argv = [sys.executable, sys.argv[0], *sys.argv[1:], *flags]
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fresh_engines(args, case: str, names=("k=4", "plain", "auto")):
    """The engines `names` of `case`, built and warmed up as a fresh `jaxspec serve` would be, and the prompt set."""
    from jaxspec import bundled
    from jaxspec.cli.serve import _recorded_acceptance
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair(int4_experts=args.int4_experts)
    prompt_set = prompt_sets.from_args(args, tokenizer)
    tune = ROOT / "benchmarks" / "results" / "tune_bundled" / "tune.json"
    config = EngineConfig(max_batch=8, max_context=256, draft=DraftShape(4), batch_buckets=(1, 8))
    d, acceptance = (drafter, _recorded_acceptance(tune)) if case == "bundled pair" else (scrambled(drafter), None)
    stop = tokenizer.stop_ids
    build = {
        "k=4": lambda: Engine(target, d, config, stop_ids=stop),
        "plain": lambda: Engine(target, None, dataclasses.replace(config, draft=DraftShape(0)), stop_ids=stop),
        "auto": lambda: Engine(
            target, d, dataclasses.replace(config, adaptive=True), stop_ids=stop, acceptance=acceptance
        ),
    }
    built = {name: build[name]() for name in names}
    for e in built.values():
        e.warmup(lambda _: None)
    return built, prompt_set


def served(args, engines: dict, prompt_set, c: int, seed: int) -> dict[str, Clients]:
    """`engines` serving REQUESTS requests from `c` clients each, in lockstep in the order `seed` draws; every engine
    must produce the same tokens (asserted)."""
    clients = {name: Clients(e, prompt_set.ids, c, args.max_tokens, REQUESTS // c) for name, e in engines.items()}
    lockstep(clients, np.random.default_rng(seed))
    tokens = [client.tokens for client in clients.values()]
    assert all(t == tokens[0] for t in tokens), f"{args.case} c={c}: the engines' tokens differ"
    return clients


def run_case(args, case: str, c: int, seed: int = 0) -> dict:
    """One case at concurrency `c`: its three engines built, warmed up and served in lockstep in this process (in
    the order `seed` draws)."""
    engines, prompt_set = fresh_engines(args, case)
    clients = served(args, engines, prompt_set, c, seed)
    rates = {name: client.rate for name, client in clients.items()}
    return {
        "tok_s": rates,
        "auto_over_better": rates["auto"] / max(rates["k=4"], rates["plain"]),
        "output_loops": prompt_sets.output_loops([list(map(int, t)) for t in clients["plain"].tokens]),
        "prompt_set": prompt_set.describe(),
    }


if __name__ == "__main__":
    main()
