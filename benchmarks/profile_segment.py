"""Where a serving segment's time goes on XLA:CPU: every operation of the segment program traced and summed by the
part of the model it belongs to (in-process, no HTTP).

One `Engine` over the bundled pair as `jaxspec serve` builds it at concurrency --concurrency (8 slots of 1,024
positions; a fixed chain of k = --num-steps, batch buckets 1, 4 and 8), warmed up; c clients then send one greedy
request of --max-tokens tokens each (--prompt-set, default the held-out functions, as serve_vs_vllm_heldout.md) under
`jax.profiler.trace` with XLA:CPU's per-operation trace events on (`--xla_cpu_enable_xprof_traceme`). Each event's
HLO operation is mapped to the JAX scope it came from through the program's `--xla_dump_to` dump (its `op_name`
metadata); the report sums the operations of the segment program that ran most (the c-row one; the prefill chunks
that ran inside it included) by part, with their count per cycle of that program. Tracing slows each operation
down (~1.5x here), so the shares are the measurement, not the times.

    python benchmarks/profile_segment.py      # writes benchmarks/results/profile_segment.{json,md}
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (part, the scope words that put an operation there), first match wins; op_name paths are the JAX scopes
PARTS = (
    ("routed experts: weight slices", ("routed_experts/dynamic_slice",)),
    ("routed experts: the rest", ("routed_experts",)),
    ("router, shared expert, dense MLPs", ("mlp/",)),
    ("attention", ("attention/", "attend_")),
    ("LM heads", ("head/",)),
    ("the drafter's fc", ("fc/",)),
    ("per-layer weights sliced from the stacks", ("dynamic_index_in_dim",)),
    ("argmax and other reductions", ("/reduce", "argmax")),
    ("embedding lookups", ("embed/",)),
    ("window gather / scatter", ("jit(_gather)", "jit(_scatter)")),
)


def part_of(op_name: str) -> str:
    op_name = re.sub(r"/(while|body|cond|closed_call|branch_\d+_fun)(?=/)", "", op_name)  # control flow: not a part
    for part, words in PARTS:
        if any(w in op_name for w in words):
            return part
    if not op_name:  # fusions XLA left without metadata (scatter loops, drafter dots, attention's: performance.md)
        return "no scope (fusions without metadata)"
    return "other (loop bookkeeping, copies, accept and commit)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "profile_segment.json")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prompt_sets

    prompt_sets.add_arguments(p, count=15, max_tokens=256, default="held-out")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="profile_segment-"))
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_enable_xprof_traceme=true --xla_dump_to={work / 'dump'}"
        " --xla_dump_hlo_pass_re=NONE"
    )
    import jax
    import numpy as np
    from serve_engine import Clients, lockstep

    from jaxspec import bundled
    from jaxspec.decoding import DraftShape
    from jaxspec.serving.engine import Engine, EngineConfig

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    c = args.concurrency
    config = EngineConfig(
        max_batch=8, max_context=1024, draft=DraftShape(args.num_steps), batch_buckets=tuple(sorted({1, c, 8}))
    )
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    lockstep({"warm": Clients(engine, prompt_set.ids, c, args.max_tokens, 1)}, np.random.default_rng(0))
    run, cycles = engine._run, [0]

    def counted(plan):  # the cycles the c-row segments ran (a step's counters, before and after)
        before = engine.executor.counters().cycles
        result = run(plan)
        if plan.segment is not None and plan.segment.rows == c:
            cycles[0] += engine.executor.counters().cycles - before
        return result

    engine._run = counted
    with jax.profiler.trace(str(work / "trace")):
        lockstep({"traced": Clients(engine, prompt_set.ids, c, args.max_tokens, 1)}, np.random.default_rng(1))
    cycles = cycles[0]
    events = collections.defaultdict(list)  # program id -> [(hlo op, ns)]
    runs = collections.defaultdict(set)
    trace = glob.glob(str(work / "trace" / "**" / "*.xplane.pb"), recursive=True)[0]
    for plane in jax.profiler.ProfileData.from_file(trace).planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "program_id" not in stats or ev.name.startswith(("ThunkExecutor", "end:", "Slinky")):
                    continue
                runs[stats["program_id"]].add(stats.get("run_id"))
                if not ev.name.startswith(("while", "call", "conditional")):  # containers: their bodies are events
                    events[stats["program_id"]].append((stats.get("hlo_op", ev.name), ev.duration_ns))
    program = max(events, key=lambda pid: sum(ns for _, ns in events[pid]))
    dump = glob.glob(str(work / "dump" / f"module_{program:04d}.*cpu_after_optimizations.txt"))[0]
    names = {}
    for text in Path(dump).read_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", text)
        if m:
            scope = re.search(r'op_name="([^"]*)"', m.group(2))
            names[m.group(1)] = scope.group(1) if scope else ""
    ns, count = collections.Counter(), collections.Counter()
    for op, d in events[program]:
        part = part_of(names.get(op, ""))
        ns[part] += d
        count[part] += 1
    total = sum(ns.values())
    rows = [
        {"part": part, "share": ns[part] / total, "ops_per_cycle": count[part] / cycles} for part, _ in ns.most_common()
    ]
    record = {
        "command": "python benchmarks/profile_segment.py"
        + (f" --concurrency {c}" if c != 4 else "")
        + (f" --num-steps {args.num_steps}" if args.num_steps != 4 else ""),
        "program": Path(dump).name.split(".")[0],
        "segment_runs": len(runs[program]),
        "cycles": cycles,
        "ops_per_cycle": len(events[program]) / cycles,
        "traced_ms_per_cycle": total / 1e6 / cycles,
        "parts": rows,
        "prompt_set": prompt_set.describe(),
        "jax": jax.__version__,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    md = [
        f"# A {c}-row k = {args.num_steps} segment on XLA:CPU, by part",
        "",
        f"Written by `{record['command']}` (the bundled pair, 8 slots x 1,024 positions, the static-greedy program, "
        f"{c} held-out prompts, one request each): {record['segment_runs']} runs of the {c}-row segment program, "
        f"{cycles} cycles, {record['ops_per_cycle']:.0f} operations per cycle (loop iterations not counted), "
        f"{record['traced_ms_per_cycle']:.1f} ms of traced operation time per cycle (tracing slows them: read the "
        "shares).",
        "",
        "| part | share of the operations' time | operations per cycle |",
        "|---|---|---|",
        *(f"| {r['part']} | {100 * r['share']:.1f}% | {r['ops_per_cycle']:.0f} |" for r in rows),
        "",
    ]
    args.output.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md), f"trace and dump: {work}", sep="\n")


if __name__ == "__main__":
    main()
