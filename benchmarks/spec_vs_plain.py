"""Speculative vs plain decoding through `generate`, in one process on the same weights: three measurements.
    python benchmarks/spec_vs_plain.py                    # --measure sweep: tokens/s of k = 0 (plain) .. --max-k
    python benchmarks/spec_vs_plain.py --measure pair     # k = --num-steps vs plain on --prompt-set, interleaved
    python benchmarks/spec_vs_plain.py --measure length   # fixed and per-token cost of k = 0 and k = --num-steps
The pair: --model and --drafter (checkpoint directories), else --pair: "random" (--preset's random target and a random
drafter: the machinery only) or "bundled" (the bundled trained pair). Each measurement's default pair and output:
- sweep (pair random, results/spec_vs_plain.json): every k runs once to compile (not timed), then --repeats runs
  (median seconds); `speedup` is its tokens/s over plain decoding's, with the acceptance statistics. One batch: the
  --prompts file, else with a tokenizer --prompt-count prompts of --prompt-set, else two fixed id lists (a random
  pair's acceptance means nothing whatever its prompts).
- pair (pair bundled, results/bundled_pair.json; greedy, batch 1, --prompt-count prompts of --prompt-set, see
  prompt_sets.py; the outputs must pass its loop check): every prompt is first run once in both modes (compiling
  every prompt-length bucket), then --repeats timed passes interleave speculative and plain per prompt, so drift in
  machine speed hits both alike. Reported: mean accepted length (tokens per cycle incl. the bonus token, over all
  prompts; and over the prompts whose output does not end in a short loop), acceptance per draft position, tokens/s
  of each mode (total new tokens / total seconds) and their ratio (of the median pass).
- length (pair bundled, results/marginal_cost.json; the first prompt of --prompt-set, batch 1): `generate` at each of
  --lengths new tokens (compiled first; median of --repeats) for k = 0 and k = --num-steps, fitted as time = fixed +
  per-token x tokens (least squares). The marginal speedup (plain per-token / speculative per-token) is what long
  generations approach; the fixed part is per call.
Until this script took them over, pair and length were benchmarks/bundled_pair.py and marginal_cost.py: the result
files they wrote record those commands (`--measure pair` and `--measure length` measure the same way).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import prompt_sets  # this directory (run as a script)

from jaxspec.decoding import DraftShape

RESULTS = Path("benchmarks/results")
DEFAULTS = {  # measurement -> (pair, output, --max-new-tokens, --repeats)
    "sweep": ("random", RESULTS / "spec_vs_plain.json", 64, 3),
    "pair": ("bundled", RESULTS / "bundled_pair.json", 96, 2),
    "length": ("bundled", RESULTS / "marginal_cost.json", None, 3),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", choices=list(DEFAULTS), default="sweep")
    p.add_argument("--pair", choices=["random", "bundled"], help="default: the measurement's (above)")
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--preset", default="tiny", help="the random pair's config")
    p.add_argument("--tokenizer")
    p.add_argument("--prompts", help="sweep: a text file, one prompt per line (ids 'a,b,c' without a tokenizer)")
    prompt_sets.add_arguments(p, count=16, max_tokens=256)  # pair, length
    p.add_argument("--max-k", type=int, default=6, help="sweep: the deepest chain")
    p.add_argument("--num-steps", type=int, default=3, help="pair, length: the chain timed against plain decoding")
    p.add_argument("--max-new-tokens", type=int, help="sweep: 64, pair: 96")
    p.add_argument("--lengths", default="16,96,384", help="length: new tokens per timed call")
    p.add_argument("--repeats", type=int, help="sweep: 3 (median), pair: 2 passes (the median ratio), length: 3")
    p.add_argument("--mesh", default=None)
    p.add_argument("--cpu-devices", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output", type=Path, help="default: the measurement's (above)")
    args = p.parse_args()
    pair, output, max_new_tokens, repeats = DEFAULTS[args.measure]
    args.pair, args.output = args.pair or pair, args.output or output
    args.max_new_tokens, args.repeats = args.max_new_tokens or max_new_tokens, args.repeats or repeats
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    target, drafter, tokenizer = load_pair(args)
    measure = {"sweep": measure_sweep, "pair": measure_pair, "length": measure_length}[args.measure]
    command = " ".join(["python benchmarks/spec_vs_plain.py", *sys.argv[1:]])
    if args.measure != "sweep" or (tokenizer and not args.prompts):
        command = prompt_sets.command("benchmarks/spec_vs_plain.py", sys.argv[1:], args)
    record = {"command": command}
    record |= measure(args, target, drafter, tokenizer)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")


def load_pair(args):
    """(target, drafter, tokenizer or None): the checkpoints named, else the bundled or a random pair."""
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target, bundled, load_target
    from jaxspec.io import load_drafter_or_random
    from sharding.mesh import make_mesh

    if not args.model and args.pair == "bundled":
        return bundled.load_pair()
    mesh, dtype = make_mesh(args.mesh) if args.mesh else None, jnp.dtype(args.dtype)
    if args.model:
        if not args.drafter:
            raise SystemExit("--model needs --drafter")
        target = load_target(args.model, mesh=mesh, dtype=dtype)
    else:
        target = Target.random(KimiConfig.preset(args.preset), mesh=mesh, dtype=dtype)
    drafter = load_drafter_or_random(args.drafter if args.model else None, target)  # in the target's dtype
    tokenizer = None
    if args.tokenizer or args.model:
        from jaxspec.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer or args.model)
        except FileNotFoundError:
            tokenizer = None
    return target, drafter, tokenizer


def run(target, drafter, prompts, k: int, max_new_tokens: int, tokenizer=None):
    """One `generate` call drafting a chain of k (plain decoding, without the drafter, for k = 0)."""
    from jaxspec import generate

    kwargs = dict(draft=DraftShape(k), max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    return generate(target, drafter if k else None, prompts, **kwargs)


def machine() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    return {"platform": jax.devices()[0].platform, "cpu": cpu, "jax": jax.__version__}


def measure_sweep(args, target, drafter, tokenizer) -> dict:
    prompt_set = None
    if args.prompts:
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        prompts = lines if tokenizer else [[int(t) for t in ln.split(",")] for ln in lines]
    elif tokenizer:  # one batch of --prompt-count prompts of --prompt-set
        prompt_set = prompt_sets.from_args(args, tokenizer)
        prompts = prompt_set.ids
    else:  # a random pair without a tokenizer: its acceptance means nothing whatever the prompts
        prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46]]
    rows = []
    for k in range(args.max_k + 1):
        call = lambda k=k: run(target, drafter, prompts, k, args.max_new_tokens, tokenizer)
        call()  # compile
        results = [call() for _ in range(args.repeats)]
        seconds = statistics.median(r.stats["seconds"] for r in results)
        s = results[0].stats
        rows.append(
            {"k": k, "new_tokens": s["new_tokens"], "cycles": s["cycles"], "seconds": seconds}
            | {"tokens_per_second": s["new_tokens"] / seconds, "mean_accepted_length": s["mean_accepted_length"]}
            | {"reached": s["reached"], "accepted": s["accepted"], "acceptance_rate": s["acceptance_rate"]}
        )
    base = rows[0]["tokens_per_second"]
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / base
    print(f"{'k':>2} | {'tok/s':>8} | {'speedup':>7} | {'cycles':>6} | {'accepted len':>12} | per-position acceptance")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_rate"])
        print(
            f"{r['k']:>2} | {r['tokens_per_second']:8.1f} | {r['speedup']:7.2f} | {r['cycles']:>6} | "
            f"{r['mean_accepted_length']:12.2f} | {acc}"
        )
    return {
        "target": args.model or (f"preset {args.preset} (random)" if args.pair == "random" else "bundled"),
        "drafter": args.drafter or ("random" if args.pair == "random" else "bundled"),
        "mesh": dict(target.mesh.shape),
        **machine(),
        "prompts": len(prompts),
        **(prompt_set.describe() if prompt_set else {}),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure_pair(args, target, drafter, tokenizer) -> dict:
    prompt_set = prompt_sets.from_args(args, tokenizer)
    prompts, outputs = prompt_set.ids, {}

    def call(prompt, k):
        out = run(target, drafter, [prompt], k, args.max_new_tokens, tokenizer)
        outputs[tuple(prompt)] = [int(t) for t in out.tokens[0]]  # greedy: the same in both modes
        return out.stats

    for prompt in prompts:  # compile every bucket in both modes
        call(prompt, args.num_steps), call(prompt, 0)
    passes = []
    for _ in range(args.repeats):
        spec, plain = [], []
        for prompt in prompts:
            spec.append(call(prompt, args.num_steps))
            plain.append(call(prompt, 0))
        passes.append((spec, plain))

    def rate(stats) -> float:
        return sum(s["new_tokens"] for s in stats) / sum(s["seconds"] for s in stats)

    ratios = [rate(spec) / rate(plain) for spec, plain in passes]
    spec, plain = passes[ratios.index(statistics.median_low(ratios))]
    loops = prompt_sets.loops_or_exit([outputs[tuple(p)] for p in prompts], args)
    record = {
        "num_steps": args.num_steps,
        **prompt_set.describe(),
        "max_new_tokens": args.max_new_tokens,
        "batch": 1,
        "temperature": 0.0,
        **acceptance(spec),
        # The same over the prompts whose output does not end in a short loop (prompt_sets.output_loops).
        "without_looping_outputs": acceptance([s for n, s in enumerate(spec) if n not in loops["looping"]]),
        "output_loops": loops,
        "speculative_tok_s": rate(spec),
        "plain_tok_s": rate(plain),
        "speedup": rate(spec) / rate(plain),
        "speedup_per_pass": ratios,
    } | machine()
    print(f"{prompt_set.name}: {len(prompts)} prompts, k={args.num_steps}, greedy, batch 1, {args.max_new_tokens} new")
    print(f"mean accepted length (incl. bonus): {record['mean_accepted_length']:.2f}")
    print("acceptance by draft position: " + ", ".join(f"{a:.2f}" for a in record["acceptance_by_position"]))
    print(
        f"speculative {record['speculative_tok_s']:.1f} tok/s, plain {record['plain_tok_s']:.1f} tok/s: "
        f"speedup {record['speedup']:.2f}x (passes: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    without = record["without_looping_outputs"]["mean_accepted_length"]
    print(f"without the looping outputs: mean accepted length {without:.2f}")
    return record


def acceptance(stats: list[dict]) -> dict:
    """Tokens committed per cycle (accepted drafts + the bonus token) over every cycle of every run in `stats`, and
    the acceptance at each draft position."""
    cycles = sum(s["cycles"] for s in stats)
    reached = [sum(col) for col in zip(*(s["reached"] for s in stats), strict=True)]
    accepted = [sum(col) for col in zip(*(s["accepted"] for s in stats), strict=True)]
    return {
        "prompts_counted": len(stats),
        "new_tokens": sum(s["new_tokens"] for s in stats),
        "cycles": cycles,
        "mean_accepted_length": sum(s["new_tokens"] for s in stats) / max(cycles, 1),
        "acceptance_by_position": [a / max(r, 1) for a, r in zip(accepted, reached, strict=True)],
    }


def measure_length(args, target, drafter, tokenizer) -> dict:
    prompt = [3, 14, 15, 92, 65]
    if tokenizer:
        first = prompt_sets.load(args.prompt_set, tokenizer, 1, max_tokens=args.prompt_tokens, seed=args.prompt_seed)
        prompt = first.ids[0]
    lengths = [int(n) for n in args.lengths.split(",")]
    result = {"modes": {}}
    for k in (0, args.num_steps):
        rows = []
        for n in lengths:
            call = lambda n=n, k=k: run(target, drafter, [prompt], k, n)
            call()  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = call()
                times.append(time.perf_counter() - t0)
            rows.append(
                {"tokens": len(out.tokens[0]), "seconds": statistics.median(times), "cycles": out.stats["cycles"]}
            )
        per_token, fixed = np.polyfit([r["tokens"] for r in rows], [r["seconds"] for r in rows], 1)
        result["modes"][f"k={k}"] = {"rows": rows, "fixed_ms": 1e3 * fixed, "per_token_ms": 1e3 * per_token}
        print(f"k={k}: fixed {1e3 * fixed:.1f} ms, {1e3 * per_token:.2f} ms per token", flush=True)
    plain, spec = result["modes"]["k=0"], result["modes"][f"k={args.num_steps}"]
    result["marginal_speedup"] = plain["per_token_ms"] / spec["per_token_ms"]
    print(f"marginal speedup {result['marginal_speedup']:.2f}x")
    return result


if __name__ == "__main__":
    main()
