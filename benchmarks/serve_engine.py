"""The serving engine in-process (no HTTP): the engine's scheduling options A/B, interleaved in one run.

Each variant is an `Engine` over the bundled pair (8 slots, batch buckets 1 and 8, 512 positions per slot), for the
speculative (k = 4) and plain (k = 0) loops. Concurrency c: c clients, each sending 2 greedy requests of 64 tokens
one after the other (a client's next request is submitted when its previous one finishes), driven by `Engine.step`
in this thread. Rounds interleave the variants; the median tokens/s per (variant, k, c) is reported, and every
variant must produce the same tokens (asserted).

Variants: "old": the per-row program always (the engine before the static-greedy program); "new": the defaults.
(The results files from before ragged attention also had "old" run every segment over all 512 positions, against
context buckets in "new"; segments have no context size now.) With --tree STEPS:TOPK:TOKENS the
variants are "new" and "tree": the defaults drafting that tree instead of the k = 4 chain (plain decoding has no
tree, so the tree's k = 0 figures are "new"'s). Prompts: --prompt-set (prompt_sets.py; default 16 HumanEval prompts
of at most 256 tokens).

    python benchmarks/serve_engine.py --rounds 2        # writes benchmarks/results/serve_engine.json
    python benchmarks/serve_engine.py --rounds 2 --tree 4:2:8 --output benchmarks/results/serve_engine_tree.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)

VARIANTS = {"old": dict(greedy_program=False), "new": {}}


def as_served() -> list[str]:
    """Drop the test-only settings (serve_load.TEST_ONLY_ENV: the test suite's PJRT_NPROC) from this process's
    environment, as `jaxspec serve` runs without them; call before JAX starts its CPU client (a child process started
    after it inherits the change). Returns the names it dropped (a record's "environment_left_out": the in-process
    records before 2026-12-07, night, ran with PJRT_NPROC=32 inherited, every engine alike)."""
    from serve_load import TEST_ONLY_ENV

    return [name for name in TEST_ONLY_ENV if os.environ.pop(name, None) is not None]


def load(engine, prompts, c: int, max_tokens: int, per_client: int = 2):
    """`c` clients, each sending `per_client` requests of `max_tokens` one after the other, driven by `engine.step`
    here (Python's garbage collector paused); returns (tokens/s over the engine's steps, every request's tokens)."""
    clients = Clients(engine, prompts, c, max_tokens, per_client)
    lockstep({"engine": clients}, np.random.default_rng(0))
    return clients.rate, clients.tokens


class Clients:
    """`c` clients of `engine`, each sending `per_client` requests of `max_tokens` one after the other (a client's
    next request is submitted when its previous one finishes); `step` runs one engine step and times it. `spec`:
    request i's settings (`spec(i)`, a RowSpec; None: greedy)."""

    def __init__(self, engine, prompts, c: int, max_tokens: int, per_client: int, spec=None):
        from jaxspec.decoding.sampling_params import RowSpec
        from jaxspec.serving.engine import Request

        self.engine, self.seconds = engine, 0.0
        ask = lambda i: Request(prompts[i % len(prompts)], max_tokens, spec(i) if spec else RowSpec())  # noqa: E731
        self.requests = [ask(i) for i in range(per_client * c)]
        self.pending = list(self.requests)
        self.active = [self.pending.pop(0) for _ in range(c)]
        for r in self.active:
            engine.submit(r)

    @property
    def done(self) -> bool:
        return all(r.finished for r in self.requests)

    def step(self) -> None:
        start = time.perf_counter()
        self.engine.step()
        for r in [r for r in self.active if r.finished]:
            self.active.remove(r)
            if self.pending:
                self.active.append(self.pending.pop(0))
                self.engine.submit(self.active[-1])
        self.seconds += time.perf_counter() - start

    @property
    def rate(self) -> float:
        return sum(len(r.tokens) for r in self.requests) / self.seconds

    @property
    def tokens(self) -> list:
        return [r.tokens for r in self.requests]


def acceptance(delta) -> dict:
    """What a loop's counters counted over a span (`Counters.minus`): accepted drafts per row-cycle and the
    conditional acceptance a_j per draft position (None where never reached)."""
    hist = np.asarray(delta.accept_hist, np.float64)
    reached, accepted = np.asarray(delta.reached, np.float64), np.asarray(delta.accepted, np.float64)
    a_j = [round(float(a / r), 3) if r else None for a, r in zip(accepted, reached, strict=True)]
    return {"accepted_per_cycle": float(hist @ np.arange(len(hist)) / max(hist.sum(), 1)), "a_j": a_j}


def report(output: Path, record: dict, title: str, note: str, table: list[str]) -> None:
    """`record` (its "command", "load_average_before" and "load_average_after" set) as `output` (JSON), and as
    markdown beside it: `title`, what wrote it with `note` and the load, then the `table`'s lines."""
    output.write_text(json.dumps(record, indent=2) + "\n")
    load = load_text(record["load_average_before"], record["load_average_after"])
    lines = [f"# {title}", "", f"Written by `{record['command']}` ({note}); {load}.", "", *table]
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")


def load_text(before, after) -> str:
    """The load averages (1, 5, 15 min) before and after a run, as a report states them."""
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    return f"load average (1, 5, 15 min) {fmt(before)} before, {fmt(after)} after"


def lockstep(clients: dict[str, Clients], order: np.random.Generator) -> None:
    """Step every engine with work left once, in a shuffled order, until all are done, with Python's garbage
    collector paused (timeit's default: a collection is not the engines' time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        while live := [name for name, c in clients.items() if not c.done]:
            for name in order.permutation(live):
                clients[name].step()
    finally:
        if enabled:
            gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tree", help="also a tree variant: STEPS:TOPK:TOKENS (see `jaxspec tune --trees`)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/serve_engine.json"))
    prompt_sets.add_arguments(p, count=16, max_tokens=256)  # + 64 new tokens: inside the 512 positions of a slot
    args = p.parse_args()
    if args.tree:
        from jaxspec.decoding import DraftShape

        shape = DraftShape.parse(args.tree)
        if not shape.tree:
            p.error(f"--tree: {args.tree!r} is a chain (topk 1); give STEPS:TOPK:TOKENS with TOPK > 1")
        VARIANTS.pop("old")
        VARIANTS["tree"] = dict(draft=shape)
    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    prompts, engines, warmup = prompt_set.ids, {}, {}
    for k in (4, 0):
        for name, options in VARIANTS.items():
            if name == "tree" and not k:
                continue
            options = dict(options)
            draft = options.pop("draft", DraftShape(k))
            config = EngineConfig(max_batch=8, max_context=512, draft=draft, batch_buckets=(1, 8), **options)
            engine = Engine(target, None if draft.plain else drafter, config, stop_ids=tokenizer.stop_ids)
            warmup[f"{name} k={k}"] = engine.warmup(lambda _: None)
            engines[(k, name)] = engine
    rates, outputs = collections.defaultdict(list), {}
    for _ in range(args.rounds):
        for c in (1, 8):
            for k in (4, 0):
                for name in VARIANTS:
                    if (k, name) not in engines:
                        continue
                    rate, tokens = load(engines[(k, name)], prompts, c, args.max_tokens)
                    rates[(name, k, c)].append(rate)
                    assert outputs.setdefault((k, c), tokens) == tokens, f"{name} k={k} c={c}: different tokens"
    table = {}
    for name in VARIANTS:
        m = {
            (k, c): float(np.median(rates[(name if (k, name) in engines else "new", k, c)]))
            for k in (4, 0)
            for c in (1, 8)
        }
        table[name] = {
            "tok_s": {f"k={k} c={c}": v for (k, c), v in m.items()},
            "speculative_c8_over_c1": m[(4, 8)] / m[(4, 1)],
            "plain_c8_over_c1": m[(0, 8)] / m[(0, 1)],
            "speculative_over_plain_c1": m[(4, 1)] / m[(0, 1)],
        }
        print(name, json.dumps(table[name]))
    record = {
        "command": f"python benchmarks/serve_engine.py --rounds {args.rounds} --max-tokens {args.max_tokens}"
        + (f" --tree {args.tree}" if args.tree else "")
        + f" {prompt_sets.flags(args)}",
        **prompt_set.describe(),
        # recorded, not refused: this benchmark times scheduling, the same tokens for every variant
        "output_loops": prompt_sets.output_loops([list(map(int, t)) for t in outputs[(4, 8)]]),
        "load_average": os.getloadavg(),
        "warmup_s": warmup,
        "variants": table,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
