"""What a serving segment program costs on XLA:CPU in memory maps, compile time and run time, compiled with and without
the options `jaxspec serve` uses there (jaxspec/serving/startup.py: CPU_COMPILER_OPTIONS, those this jaxlib knows).

One engine over the bundled pair (8 slots, 1024 positions, adaptive over plain decoding and the k = 4 chain), one
live greedy row; per program kind (plain or chain, static-greedy or per-row) over 1 row x 256 positions, first
without the options, then with them (each compile after dropping JAX's caches, so nothing is reused): the maps the
process gained (/proc/self/maps), the seconds of the first call (compile + run), and the median of --repeats runs
from the same saved state, alternating the two programs (ratios in one run).

    python benchmarks/serve_maps.py      # writes benchmarks/results/serve_maps.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "serve_maps.json")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig, Request
    from jaxspec.serving.executor import _segment_program
    from jaxspec.serving.plan import Segment
    from jaxspec.serving.startup import cpu_compiler_options, maps_in_use

    target, drafter, tokenizer = bundled.load_pair()
    cfg = EngineConfig(max_batch=8, max_context=1024, draft=DraftShape(4), adaptive=True)
    engine = Engine(target, drafter, cfg, stop_ids=tokenizer.stop_ids)
    engine.submit(Request(tokenizer.encode(bundled.prompts()[0])[:64], 400))
    while engine.scheduler.queue_depth or any(
        s is not None and s.next_chunk is not None for s in engine.scheduler.slots
    ):
        engine.step()
    ex = engine.executor
    saved = jax.tree.map(jnp.copy, (ex.state, ex.pool))
    variants = {"default": _segment_program(()), "jaxspec serve's": _segment_program(cpu_compiler_options())}

    def run(program, segment) -> float:
        ex._program = program
        ex.state, ex.pool = jax.tree.map(jnp.copy, saved)
        ex._q_stale = False
        jax.block_until_ready((ex.state, ex.pool))
        start = time.perf_counter()
        ex.segment(segment)
        jax.block_until_ready(ex.state)
        return time.perf_counter() - start

    rows = []
    for shape in cfg.shapes:
        for greedy in (True, False):
            segment = Segment(1, shape, greedy, cfg.segment_cycles)
            row = {"draft": shape.label, "program": "greedy" if greedy else "per-row"}
            for name, program in variants.items():
                jax.clear_caches()
                before = maps_in_use()
                row[f"{name} first call s"] = run(program, segment)
                row[f"{name} maps"] = maps_in_use() - before
            times = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, program in variants.items():
                    times[name].append(run(program, segment))
            for name in variants:
                row[f"{name} run ms"] = 1e3 * statistics.median(times[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
    options = dict(cpu_compiler_options())
    args.output.write_text(json.dumps({"jax": jax.__version__, "options": options, "rows": rows}, indent=1) + "\n")
    lines = [
        "# A segment program on XLA:CPU: memory maps, compile and run time, with and without jaxspec serve's options",
        "",
        f"`python benchmarks/serve_maps.py` (jax {jax.__version__}; options {options}); 1 row x 256 positions.",
        "",
        "| draft | program | maps | maps, serve's options | first call s | same, options | run ms | same, options |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = "default", "jaxspec serve's"
        lines.append(
            f"| {r['draft']} | {r['program']} | {r[f'{a} maps']} | {r[f'{b} maps']} | {r[f'{a} first call s']:.1f} | "
            f"{r[f'{b} first call s']:.1f} | {r[f'{a} run ms']:.1f} | {r[f'{b} run ms']:.1f} |"
        )
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
