"""What one long conversation costs the short ones beside it: the serving engine's inter-token latency of short rows
alone, beside one long row, and of a batch of long rows, for the serving code of --before (segments copy a dense
window of the bucket the longest row needs out of the pool and back, and attention reads every row to the batch's
longest: "before", that commit's jaxspec and sharding packages from git history) against the current code (each row
reads its own blocks of the pool in place, as far as its own length: "ragged").

    python benchmarks/serve_ragged.py                       # float32; writes benchmarks/results/serve_ragged.{json,md}
    python benchmarks/serve_ragged.py --dtype bfloat16 --output benchmarks/results/serve_ragged_bf16.json

The model is attention-dominated (as HBM reads of long caches dominate a step on an accelerator): Kimi-K2.5's
latent width (512 + 64 cached values per token and layer), 32 heads, a small MLP, random weights. Plain decoding, 8
slots of --max-context positions, greedy. Three batches, each on a fresh engine:
- A: 7 short rows (--short prompt tokens) decoding alone;
- B: the same 7 beside one long row (--long prompt tokens), all decoding;
- C: 8 long rows.
After every row is prefilled and a few warm-up steps (which compile), --steps engine steps are timed; a short row's
inter-token latency is a step's time over the tokens that row got in it (one per cycle), and the report gives the
median. r = (B - A) / (C - A) is the share of an all-long batch's extra cost that one long row adds: ~1 when every
row reads to the longest, ~1/8 when each reads its own. Each variant runs in its own process, one after the other, in
one run of this script (ratios within one run: the machine is shared), with the same script: only the packages it
imports differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "f177fd0"  # the last commit whose serving copied windows and read every row to the batch's longest


def bench_config():
    from jaxspec import KimiConfig

    return KimiConfig.preset("tiny").replace(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=32,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_position_embeddings=1 << 16,
    )


def measure(args) -> dict:
    """One variant in this process: the median short-row inter-token latency of batches A, B and C (seconds)."""
    from sharding.cpu import simulate_cpu_devices

    simulate_cpu_devices(1)
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.decoding.draft_shape import DraftShape
    from jaxspec.runtime.target import Target
    from jaxspec.serving.engine import Engine, EngineConfig, Request
    from sharding.mesh import make_mesh

    cfg = bench_config()
    target = Target.random(cfg, mesh=make_mesh("1x1"), dtype=jnp.dtype(args.dtype), seed=0)
    config = EngineConfig(max_batch=8, max_context=args.max_context, draft=DraftShape(0), segment_cycles=args.cycles)
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(2, cfg.vocab_size, n).tolist()  # noqa: E731
    batches = {"A": [args.short] * 7, "B": [args.short] * 7 + [args.long], "C": [args.long] * 8}
    out = {}
    for name, lengths in batches.items():
        engine = Engine(target, None, config)
        # budgets far past the timed steps: no row finishes while the others are prefilled or timed
        requests = [Request(prompt(n), args.max_context - n - config.prefill_chunk) for n in lengths]
        for r in requests:
            engine.submit(r)
        while any(not r.tokens for r in requests):  # every row prefilled and decoding
            engine.step()
        times = []
        for i in range(args.warmup + args.steps):
            before, start = len(requests[0].tokens), time.perf_counter()
            engine.step()
            got = len(requests[0].tokens) - before
            if i >= args.warmup and got:
                times.append((time.perf_counter() - start) / got)
        out[name] = statistics.median(times)
        print(f"{args.variant} {name}: {out[name] * 1e3:.1f} ms per token", file=sys.stderr, flush=True)
    return out


def report(runs: dict, args, load: str) -> str:
    lines = [
        "# serve_ragged: one long row beside short ones",
        "",
        f"`python benchmarks/serve_ragged.py --dtype {args.dtype}` ({load}). Median inter-token latency of a short",
        f"row ({args.short}-token prompts; the long rows {args.long}), plain decoding, 8 slots of {args.max_context}",
        "positions; r = (B - A) / (C - A).",
        "",
        "| serving code | A: 7 short | B: 7 short + 1 long | C: 8 long | r |",
        "|---|---|---|---|---|",
    ]
    for variant, t in runs.items():
        ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
        lines.append(f"| {variant} | {ms(t['A'])} | {ms(t['B'])} | {ms(t['C'])} | {t['r']:.2f} |")
    return "\n".join(lines) + "\n"


def run(variant: str, old: Path) -> dict:
    """Measure `variant` in a process of its own ("before": the packages extracted to `old`); adds r."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
    env = dict(os.environ, PYTHONPATH=str(old if variant == "before" else ROOT))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{variant}: failed\n{done.stderr[-3000:]}")
    t = json.loads(done.stdout.strip().splitlines()[-1])
    t["r"] = (t["B"] - t["A"]) / (t["C"] - t["A"])
    print(f"{variant}: r = {t['r']:.2f}", flush=True)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--short", type=int, default=100, help="prompt tokens of a short row")
    p.add_argument("--long", type=int, default=3000, help="prompt tokens of a long row")
    p.add_argument("--cycles", type=int, default=4, help="cycles per segment (EngineConfig.segment_cycles)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--variants", default="before,ragged")
    p.add_argument("--before", default=BEFORE, help="the commit whose serving code 'before' runs")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: measure one variant in this process
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_ragged.json")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_engine import load_text

    load_before = os.getloadavg()
    old = Path(tempfile.mkdtemp(prefix="serve_ragged_"))
    archive = subprocess.run(["git", "archive", args.before, "jaxspec", "sharding"], cwd=ROOT, check=True, stdout=PIPE)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    try:
        runs = {variant: run(variant, old) for variant in args.variants.split(",")}
    finally:
        shutil.rmtree(old)
    load = load_text(load_before, os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(command=" ".join(sys.argv), load=load, runs=runs), indent=1) + "\n")
    args.output.with_suffix(".md").write_text(report(runs, args, load))
    print(report(runs, args, load))


if __name__ == "__main__":
    main()
