"""Adaptive speculation (`--num-steps auto`) against fixed k = 3 and plain decoding, in-process (no HTTP).

Two cases: the bundled pair, and the bundled target with a deliberately poor drafter (the bundled drafter's weights
scrambled: each array's entries permuted; no tune.json, so auto's chain is k = 3 for both). Per case, three engines
(8 slots, batch buckets 1 and 8, 256 positions per slot): fixed k = 3, plain (k = 0, no drafter), and auto (per
segment plain or the k = 3 chain, the scheduler's DraftPolicy choosing from the segment times and acceptance it
measures; the policy keeps what it learned across rounds, as a server does). Concurrency c: c clients, each sending
--requests greedy requests of --max-tokens tokens one after the other. A case's engines serve that load side by side
in lockstep (serve_engine.py's `lockstep`), driven by `Engine.step` in this thread: one step of each engine with work
left, in a shuffled order, then again (the garbage collector paused), so other work on this shared machine falls on
every engine alike; an engine's tokens/s is its tokens over the seconds of its own steps. The first
--learning-rounds rounds are served and not measured (auto learns what each shape costs from nothing there, once, as
a server does when it starts; their tokens/s are reported apart). Reported per (case, engine,
c): tokens/s over all rounds (all its tokens over all its seconds; auto / the better: the ratio of those), the
median over rounds of auto's tokens/s over the better engine's in the same round, the ratio of the engines' median
tokens/s over rounds (less robust: the two medians may come from rounds under different load), whether every engine
of a case produced the same tokens, and auto's segments per shape.

Prompts: --prompt-set (prompt_sets.py; default 16 HumanEval prompts of at most 128 tokens).

    python benchmarks/serve_adaptive.py --rounds 11 --max-tokens 96 --requests 4  # writes results/serve_adaptive.*
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)
from serve_engine import Clients, lockstep  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent


def scrambled(drafter, seed: int = 0):
    """The drafter with every weight array's entries permuted (a drafter that matches nothing)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def scramble(x):
        if not hasattr(x, "shape") or x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        flat = np.asarray(x).reshape(-1)
        return jax.device_put(flat[rng.permutation(flat.size)].reshape(x.shape), x.sharding)

    return dataclasses.replace(drafter, params=jax.tree.map(scramble, drafter.params))


def engines_of(target, drafter, stop_ids, plain):
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    config = EngineConfig(max_batch=8, max_context=256, draft=DraftShape(3), batch_buckets=(1, 8))
    out = {
        "k=3": Engine(target, drafter, config, stop_ids=stop_ids),
        "auto": Engine(target, drafter, dataclasses.replace(config, adaptive=True), stop_ids=stop_ids),
    }
    warmup = {name: e.warmup(lambda _: None) for name, e in out.items()}
    return out | {"plain": plain}, warmup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests each client sends per round, one after another")
    p.add_argument(
        "--learning-rounds",
        type=int,
        default=1,
        help="rounds first served and not measured: auto's policy learns its shapes' costs from nothing there (a "
        "server does so once); their tokens/s are reported apart",
    )
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_adaptive.json")
    prompt_sets.add_arguments(p, count=16, max_tokens=128)  # + --max-tokens: inside the 256 positions of a slot
    args = p.parse_args()
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    prompts = prompt_set.ids
    plain = Engine(target, None, EngineConfig(8, 256, DraftShape(0), batch_buckets=(1, 8)), stop_ids=tokenizer.stop_ids)
    warmup = {"plain": plain.warmup(lambda _: None)}
    cases = {}
    for case, d in (("bundled pair", drafter), ("poor drafter", scrambled(drafter))):
        cases[case], w = engines_of(target, d, tokenizer.stop_ids, plain)
        warmup |= {f"{case} {name}": s for name, s in w.items()}
    load_before = os.getloadavg()
    rates, outputs, same = collections.defaultdict(list), {}, {}
    totals = collections.defaultdict(lambda: np.zeros(2))  # (tokens, seconds) over all rounds
    segments = {case: collections.Counter() for case in cases}
    order = np.random.default_rng(0)
    first = {}  # the learning rounds' tokens/s, not in the figures
    for i in range(args.learning_rounds + args.rounds):
        for case, engines in cases.items():
            for c in (1, 8):
                auto = engines["auto"].executor
                auto.run = counting(auto, segments[case] if i >= args.learning_rounds else collections.Counter())
                clients = {name: Clients(e, prompts, c, args.max_tokens, args.requests) for name, e in engines.items()}
                lockstep(clients, order)
                del auto.run
                key = f"{case} c={c}"
                if i < args.learning_rounds:
                    first[key] = {name: client.rate for name, client in clients.items()}
                    continue
                for name, client in clients.items():
                    rates[(case, name, c)].append(client.rate)
                    totals[(case, name, c)] += np.array([sum(map(len, client.tokens)), client.seconds])
                    same[key] = same.get(key, True) and outputs.setdefault(key, client.tokens) == client.tokens
    table = {}
    for case, engines in cases.items():
        for c in (1, 8):
            m = {name: float(np.median(rates[(case, name, c)])) for name in engines}
            total = {name: float(np.divide(*totals[(case, name, c)])) for name in engines}
            better = "k=3" if total["k=3"] > total["plain"] else "plain"
            paired = np.median(np.divide(rates[(case, "auto", c)], rates[(case, better, c)]))
            key = f"{case} c={c}"
            table[key] = {
                "tok_s": total,
                "auto_over_better": total["auto"] / total[better],
                "per_round_auto_over_better": float(paired),
                "median_tok_s": m,
                "medians_auto_over_better": m["auto"] / max(m["k=3"], m["plain"]),
                "per_round_tok_s": {name: rates[(case, name, c)] for name in engines},
                "same_tokens": same[key],
                "learning_rounds_tok_s": first.get(key),
            }
            print(case, c, json.dumps(table[f"{case} c={c}"]), flush=True)
    record = {
        "command": (
            f"python benchmarks/serve_adaptive.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
            f"--requests {args.requests} --learning-rounds {args.learning_rounds} {prompt_sets.flags(args)}"
        ),
        **prompt_set.describe(),
        # recorded, not refused: every engine serves the same tokens
        "output_loops": prompt_sets.output_loops([list(map(int, t)) for t in outputs["bundled pair c=8"]]),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "warmup_s": warmup,
        "results": table,
        "auto_segments": {case: {k: v for k, v in sorted(n.items())} for case, n in segments.items()},
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(report(record))


def counting(executor, counter):
    """`executor.run`, counting the segments it runs per draft shape."""
    run = type(executor).run

    def counted(plan):
        if plan.segment is not None:
            counter[plan.segment.draft.label] += 1
        return run(executor, plan)

    return counted


def report(record: dict) -> str:
    lines = [
        "# Adaptive speculation (`--num-steps auto`) vs fixed k = 3 and plain decoding",
        "",
        f"Written by `{record['command']}`. CPU only, the project's shared {record['cpus']}-core machine with other "
        f"jobs beside it: load average (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in record['load_average_before'])} "
        f"before the measured rounds, {', '.join(f'{x:.1f}' for x in record['load_average_after'])} after.",
        "",
        "Tokens/s over all rounds; auto / the better: of those, per round (median), and of the engines' median "
        "tokens/s over rounds.",
        "",
        "| case | k=3 tok/s | plain tok/s | auto tok/s | auto / the better | per round (median) | of medians "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in record["results"].items():
        m = r["tok_s"]
        ratio, paired, same = r["auto_over_better"], r["per_round_auto_over_better"], r["same_tokens"]
        cells = f"{m['k=3']:.0f} | {m['plain']:.0f} | {m['auto']:.0f} | {ratio:.3f} | {paired:.3f}"
        cells += f" | {r['medians_auto_over_better']:.3f}"
        lines.append(f"| {name} | {cells} | {'yes' if same else 'NO'} |")
    lines += ["", "Segments auto ran, per draft shape (measured rounds): " + json.dumps(record["auto_segments"]), ""]
    learning = {name: r["learning_rounds_tok_s"] for name, r in record["results"].items() if r["learning_rounds_tok_s"]}
    if learning:
        lines += [
            "The last unmeasured learning round (auto's policy learning from nothing), tokens/s: "
            + json.dumps({k: {n: round(v) for n, v in r.items()} for k, r in learning.items()}),
            "",
        ]
    lines += ["Warm-up seconds: " + json.dumps({k: round(v, 1) for k, v in record["warmup_s"].items()}), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
