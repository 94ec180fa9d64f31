"""What keeping the drafter's target states costs an adaptive engine's plain segments, inside one engine.

An auto engine (`--num-steps auto`'s plain decoding and k = 4 chain) pinned to plain decoding and to feeding nothing,
as `benchmarks/serve_k0_tax.py` pins it; its plain segment programs alternate, step by step, between the ones it runs
(`LoopConfig.track_drafter`: each cycle captures the drafter's layers of the target and keeps them in
`LoopState.aux_BSI` for a chain that may come) and the same programs without it, on the same state, pool and buffers.
So the two differ only in their programs: `serve_k0_tax.py` compares two engines, and engines built alike differ by
a few percent from process to process on this machine. 8 slots, batch buckets 1 and 8, 256 positions; 8 clients send
16 greedy requests of --max-tokens tokens, --rounds times (the first discarded as warm); the median seconds of the
segments over 8 rows that ran no prefill chunk, per variant.

    python benchmarks/plain_tracking.py      # writes benchmarks/results/plain_tracking.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from pathlib import Path

import numpy as np
from serve_engine import Clients, lockstep, report  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "plain_tracking.json")
    args = p.parse_args()
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.adaptive import Scripted
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompts = [tokenizer.encode(p)[:128] for p in bundled.prompts()]
    config = EngineConfig(max_batch=8, max_context=256, draft=DraftShape(4), batch_buckets=(1, 8), adaptive=True)
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    x, plain = engine.executor, DraftShape(0)
    kept = x.programs[plain]
    assert all(c.track_drafter for c in kept), "an auto engine's plain programs keep the drafter's states"
    variants = {"kept": kept, "not kept": tuple(dataclasses.replace(c, track_drafter=False) for c in kept)}
    for programs in variants.values():  # compile both
        x.programs[plain] = programs
        engine.warmup(lambda _: None)
    engine.scheduler.policy = Scripted((plain,), feed=False)
    seconds = {name: [] for name in variants}
    turn, run = itertools.cycle(variants), x.run

    def alternating(plan):
        name = next(turn)
        x.programs[plain] = variants[name]
        result = run(plan)
        if plan.segment is not None and plan.segment.rows == 8 and result.segment_seconds is not None:
            seconds[name].append(result.segment_seconds)
        return result

    x.run = alternating
    load_before = os.getloadavg()
    for i in range(args.rounds):
        lockstep({"auto": Clients(engine, prompts, 8, args.max_tokens, 2)}, np.random.default_rng(i))
        if i == 0:  # warm
            for times in seconds.values():
                times.clear()
    ms = {name: 1e3 * float(np.median(times)) for name, times in seconds.items()}
    ratio = ms["kept"] / ms["not kept"]
    print(json.dumps({"ms_per_segment": ms, "kept_over_not_kept": ratio}), flush=True)
    record = {
        "command": f"python benchmarks/plain_tracking.py --max-tokens {args.max_tokens} --rounds {args.rounds}",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "segments": {name: len(times) for name, times in seconds.items()},
        "ms_per_segment": ms,
        "kept_over_not_kept": ratio,
    }
    table = [
        "| segments over 8 rows | states kept: median ms | not kept: median ms | kept / not kept |",
        "|---|---|---|---|",
        f"| {len(seconds['kept'])}, {len(seconds['not kept'])} | {ms['kept']:.2f} | {ms['not kept']:.2f} | "
        f"{ratio:.3f} |",
    ]
    title = "What keeping the drafter's target states costs an auto engine's plain segments"
    note = f"one engine, its plain programs alternating step by step, the first of {args.rounds} rounds discarded"
    report(args.output, record, title, note, table)


if __name__ == "__main__":
    main()
