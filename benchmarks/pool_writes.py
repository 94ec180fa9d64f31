"""A step's cache writes into the pool as runs (cache.py's `_put_runs`) against a scatter, served in one process.

Every chain, prefill and catch-up step writes each row's T new cache entries at consecutive positions. A scatter of
them is what the code did until 2026-12-07, and what it still does off the CPU: XLA:CPU runs a scatter as a loop over
its B x T entries, several operations each (a 64-token prefill chunk: 64 iterations per layer). On the CPU a step now
slices out the blocks each row's run spans, puts the run in with one dynamic_update_slice and writes them back.

Two `Engine`s as `jaxspec serve` builds them with its defaults (the bundled pair, `--num-steps auto`), each over its
own copy of the pair (so each compiles its own programs): A with every pool write a scatter (`Paged._put` patched
while A compiles), B as the code is. Both serve the same greedy requests of --max-tokens tokens from c clients in
lockstep (`serve_engine.lockstep`: one step of each engine in turn, in a shuffled order), at each of --concurrency,
over --rounds rounds; their tokens are asserted equal. B / A: tokens/s over each engine's own step seconds.

    python benchmarks/pool_writes.py      # writes benchmarks/results/pool_writes.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_engine import Clients, lockstep

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 16  # per level and round


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", default="4,1", help="comma-separated client counts (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "pool_writes.json")
    prompt_sets.add_arguments(p, count=15, max_tokens=256, default="held-out")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.rounds < 1 or not levels or min(levels) < 1:
        p.error("--rounds and every --concurrency level must be >= 1")
    from jaxspec import bundled
    from jaxspec.cli.serve import _recorded_acceptance, recommended_shape
    from jaxspec.decoding import DraftShape
    from jaxspec.models import cache
    from jaxspec.serving.engine import Engine, EngineConfig

    tune = ROOT / "benchmarks" / "results" / "tune_bundled" / "tune.json"
    draft = DraftShape(recommended_shape(tune).num_steps)
    runs = cache.Paged._put

    def scatter(self, array, lead, new_BT, pos_BT):  # the write before 2026-12-07, on every platform
        blocks_BT, offsets_BT = self.slots(pos_BT)
        return cache._set(array, (*lead, blocks_BT, offsets_BT), new_BT)

    engines, tokenizer = {}, None
    for name in ("scatter", "runs"):
        cache.Paged._put = scatter if name == "scatter" else runs
        target, drafter, tokenizer = bundled.load_pair()  # its own objects: its own compiled programs
        engine = Engine(
            target,
            drafter,
            EngineConfig(draft=draft, adaptive=True),
            stop_ids=(),
            acceptance=_recorded_acceptance(tune, draft),
        )
        start = time.perf_counter()
        engine.warmup(lambda _: None)
        print(f"{name}: warmed up in {time.perf_counter() - start:.0f} s", flush=True)
        engines[name] = engine
    cache.Paged._put = runs
    prompt_set = prompt_sets.from_args(args, tokenizer)
    load_before = os.getloadavg()

    def level(c: int, seed: int) -> dict[str, Clients]:
        clients = {n: Clients(e, prompt_set.ids, c, args.max_tokens, REQUESTS // c) for n, e in engines.items()}
        lockstep(clients, np.random.default_rng(seed))
        assert clients["scatter"].tokens == clients["runs"].tokens, "the two writes served different tokens"
        return clients

    for c in levels:  # every program of each level run once before measuring
        level(c, 1000 + c)
    rows = []
    for r in range(args.rounds):
        for c in levels:
            clients = level(c, r)
            rows.append({"round": r, "concurrency": c, **{n: cl.rate for n, cl in clients.items()}})
            print(f"round {r} c={c}: {rows[-1]['scatter']:.0f} / {rows[-1]['runs']:.0f} tok/s", flush=True)
    table = []
    for c in levels:
        mine = [row for row in rows if row["concurrency"] == c]
        table.append(
            {
                "concurrency": c,
                "scatter_tok_s": float(np.median([row["scatter"] for row in mine])),
                "runs_tok_s": float(np.median([row["runs"] for row in mine])),
                "runs_over_scatter": [row["runs"] / row["scatter"] for row in mine],
            }
        )
    command = prompt_sets.command("benchmarks/pool_writes.py", sys.argv[1:], args)
    record = {
        "command": command,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "requests": REQUESTS,
        "rows": rows,
        "table": table,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "prompt_set": prompt_set.describe(),
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    md = [
        "# A step's cache writes as runs against a scatter (XLA:CPU, in one process)",
        "",
        f"Written by `{command}`: two engines as `jaxspec serve` builds them with its defaults (the bundled pair), "
        f"one writing the pool with a scatter, one with runs, {REQUESTS} greedy requests of {args.max_tokens} tokens "
        f"per level and round in lockstep, {args.rounds} rounds; the same tokens (asserted). CPU only, the project's "
        f"shared 2-core machine: load average (1, 5, 15 min) {tuple(round(x, 1) for x in load_before)} before, "
        f"{tuple(round(x, 1) for x in record['load_average_after'])} after.",
        "",
        "| concurrency | scatter tok/s (median) | runs tok/s (median) | runs / scatter, per round |",
        "|---|---|---|---|",
        *(
            f"| {t['concurrency']} | {t['scatter_tok_s']:.0f} | {t['runs_tok_s']:.0f} | "
            + ", ".join(f"{x:.3f}" for x in t["runs_over_scatter"])
            + " |"
            for t in table
        ),
        "",
    ]
    args.output.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
