"""Where a fresh auto server's time goes against plain decoding's, step by step (the fresh-server benchmark's case).

`benchmarks/serve_fresh.py` measures what a just-started `jaxspec serve --num-steps auto` serves against fixed shapes;
this splits the gap between auto and plain decoding where plain decoding is the better one (the bundled pair at 8
clients, on HumanEval: a chain there serves under half of plain decoding's tokens/s). Per round, in a process of its
own (as a server starts in one): the plain and auto engines of serve_fresh.py's case, built and warmed up anew, serve
16 greedy requests of --max-tokens tokens from --concurrency clients in lockstep (each round its own order, as
serve_fresh.py's rounds); each engine's steps are sorted by
what their executor ran, and the seconds of each kind summed:
- prefill: steps that ran prefill chunks (the segment that follows in the same program included);
- probe / chain: segments of a chain (a probe: the policy's one-cycle first measure of the drafter on this traffic);
- plain: segments of plain decoding (auto's keep the drafter's target states for a chain to come);
- other: steps that ran neither (admissions, frees);
- host: each step's seconds outside the executor (the scheduler and the policy in Python).
Both engines serve the same tokens (asserted), so each kind's auto - plain seconds, as a share of plain's total, is
what it costs auto's throughput.

    python benchmarks/serve_fresh_breakdown.py      # writes benchmarks/results/serve_fresh_breakdown.{json,md}
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import prompt_sets  # this directory (run as a script)
from serve_engine import as_served, load_text
from serve_fresh import CASES, CONCURRENCY, fresh_engines, in_child, served

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("prefill", "probe", "chain", "plain", "other", "host")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, choices=CONCURRENCY, default=8)
    p.add_argument("--case", choices=CASES, default=CASES[0])
    p.add_argument("--rounds", type=int, default=3, help="fresh processes, each one round")
    p.add_argument("--int4-experts", default="auto", help="the target's INT4 experts: auto, packed, dense")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_fresh_breakdown.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one round, in this process
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the round's lockstep order
    prompt_sets.add_arguments(p, count=16, max_tokens=128)
    args = p.parse_args()
    left_out = as_served()  # the children (one per round) inherit it
    if args.child:
        print(json.dumps(one_round(args)), flush=True)
        return
    if args.rounds < 1:
        p.error(f"--rounds: expected at least 1, got {args.rounds}")
    load_before, rounds = os.getloadavg(), []
    for i in range(args.rounds):
        rounds.append(in_child("--child", "--seed", str(i)))  # each round its own order, as serve_fresh.py
        print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
    record = {
        "command": f"python benchmarks/serve_fresh_breakdown.py --max-tokens {args.max_tokens} --concurrency "
        f"{args.concurrency} --case '{args.case}' --rounds {args.rounds} --int4-experts {args.int4_experts} "
        f"{prompt_sets.flags(args)}",
        "environment_left_out": left_out,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rounds": rounds,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    args.output.with_suffix(".md").write_text("\n".join(table(record)) + "\n")


def table(record: dict) -> list[str]:
    """The results file: per round, auto / plain and each kind's auto - plain ms (% of plain's total), steps."""
    lines = [
        "# A fresh auto server against plain decoding, step by step",
        "",
        f"Written by `{record['command']}` (each round a process of its own, each engine new). CPU only, the "
        f"project's shared {record['cpus']}-core machine: "
        f"{load_text(record['load_average_before'], record['load_average_after'])}.",
        "",
        "Per kind of step: auto's ms minus plain decoding's, as a share of plain's total (its steps of that kind: "
        "auto / plain). Auto / plain: tokens/s over each engine's own steps.",
        "",
        f"| round | plain s | auto / plain | {' | '.join(KINDS)} |",
        "|---|---|---|" + "---|" * len(KINDS),
    ]
    for i, r in enumerate(record["rounds"], 1):
        total = r["plain"]["seconds"]
        cells = []
        for kind in KINDS:
            a, b = r["auto"]["kinds"].get(kind, [0, 0.0]), r["plain"]["kinds"].get(kind, [0, 0.0])
            cells.append(f"{(a[1] - b[1]) * 1e3:+.1f} ms ({(a[1] - b[1]) / total:+.1%}; {a[0]} / {b[0]})")
        lines.append(f"| {i} | {total:.3f} | {r['auto_over_plain']:.3f} | {' | '.join(cells)} |")
    return lines


def one_round(args) -> dict:
    """The plain and auto engines of the case served in lockstep here; each engine's steps timed by kind."""
    engines, prompt_set = fresh_engines(args, args.case, names=("plain", "auto"))
    kinds = {name: collections.defaultdict(lambda: [0, 0.0]) for name in engines}
    for name, engine in engines.items():
        _time_by_kind(engine, kinds[name])
    clients = served(args, engines, prompt_set, args.concurrency, args.seed)
    for name, client in clients.items():  # host: the steps' seconds outside the executor
        kinds[name]["host"] = [kinds[name]["steps"][0], client.seconds - kinds[name].pop("steps")[1]]
    rates = {name: client.rate for name, client in clients.items()}
    return {
        "auto_over_plain": rates["auto"] / rates["plain"],
        **{name: {"seconds": clients[name].seconds, "tok_s": rates[name], "kinds": kinds[name]} for name in engines},
    }


def _time_by_kind(engine, kinds: dict) -> None:
    """Sum the seconds of `engine`'s executor runs per kind of step into `kinds` ([steps, seconds] each; "steps": all
    of them)."""
    executor, run = engine.executor, engine.executor.run

    def timed(plan):
        probing = engine.scheduler.policy.probing
        start = time.perf_counter()
        result = run(plan)
        seconds = time.perf_counter() - start
        if plan.prefill:
            kind = "prefill"
        elif plan.segment is None:
            kind = "other"
        elif plan.segment.draft.plain:
            kind = "plain"
        else:
            kind = "probe" if probing else "chain"
        for k in (kind, "steps"):
            kinds[k][0] += 1
            kinds[k][1] += seconds
        return result

    executor.run = timed


if __name__ == "__main__":
    main()
