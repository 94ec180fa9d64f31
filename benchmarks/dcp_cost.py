"""What `--dcp 8` costs against `--dcp 1` per generated token, on the 1x8 CPU mesh, in one run.

    PYTHONPATH=$PWD python benchmarks/dcp_cost.py [--max-new-tokens 64] [--repeats 5]

The bundled pair on 8 simulated CPU devices (mesh 1x8), greedy: batch 1 (one held-out prompt) and batch 8 (eight),
plain decoding and a chain of 3 (a verify of 4 per cycle). Each case runs once per dcp to compile and to compare the
tokens (they must be equal), then --repeats timed passes alternate dcp 1 and dcp 8 (the order flipped every pass), so
drift in machine speed hits both alike. Reported per case: seconds per generated token of each (the median pass; a
`generate` call's seconds, prefill included, over its new tokens), their ratio (the median of the per-pass ratios),
and the collectives per step of the target's compiled step (the HLO census, counted per execution: decode of 1 token,
verify of 4) at each dcp. Writes benchmarks/results/dcp_cost.{json,md}.

The 8 simulated devices share the machine's cores: the figures are ratios within a run, not accelerator speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sharding.cpu import simulate_cpu_devices

RESULTS = Path("benchmarks/results")
CASES = [(1, 0), (1, 3), (8, 0), (8, 3)]  # (batch, chain depth k: 0 = plain decoding)
DCPS = (1, 8)
CENSUS_CACHE = 1024  # cache positions of the step compiled for the census (the count does not depend on it)


def call(target, drafter, prompts, k: int, dcp: int, max_new_tokens: int, tokenizer) -> tuple[list, dict]:
    from jaxspec import generate
    from jaxspec.decoding import DraftShape

    kwargs = dict(draft=DraftShape(k), max_new_tokens=max_new_tokens, tokenizer=tokenizer, dcp=dcp)
    out = generate(target, drafter if k else None, prompts, **kwargs)
    return out.tokens, out.stats


def measure_case(pair, batch: int, k: int, args) -> dict:
    """Per generated token seconds of each dcp (median pass), their ratio and whether the greedy tokens agree."""
    from jaxspec import bundled

    target, drafter, tokenizer = pair
    prompts = bundled.prompts()[:batch]
    run = lambda dcp: call(target, drafter, prompts, k, dcp, args.max_new_tokens, tokenizer)  # noqa: E731
    tokens = {dcp: run(dcp)[0] for dcp in DCPS}  # compiles
    per_token = {dcp: [] for dcp in DCPS}
    for i in range(args.repeats):
        for dcp in DCPS if i % 2 == 0 else DCPS[::-1]:
            got, stats = run(dcp)
            assert got == tokens[dcp]
            per_token[dcp].append(stats["seconds"] / stats["new_tokens"])
    ratios = [a / b for a, b in zip(per_token[8], per_token[1], strict=True)]
    row = {"batch": batch, "k": k, "new_tokens": stats["new_tokens"], "same_tokens": tokens[1] == tokens[8]}
    row |= {f"ms_per_token_dcp{d}": 1e3 * statistics.median(per_token[d]) for d in DCPS}
    row |= {"ratio": statistics.median(ratios), "ratios": ratios}
    print(
        f"batch {batch} k {k}: dcp 1 {row['ms_per_token_dcp1']:.2f} ms/token, dcp 8 {row['ms_per_token_dcp8']:.2f}, "
        f"ratio {row['ratio']:.3f} (passes {', '.join(f'{r:.3f}' for r in ratios)}); same tokens {row['same_tokens']}",
        flush=True,
    )
    return row


def census(target, batch: int, tokens: int) -> dict:
    """Collectives executed per step (all-reduce, all-gather, all-to-all, ...) of each dcp's compiled step."""
    from sharding import inspect

    out = {}
    for dcp in DCPS:
        counts = inspect.collective_census(target.with_dcp(dcp).compile_step(batch, tokens, CENSUS_CACHE))
        out[f"dcp{dcp}"] = {kind: c["executed"] for kind, c in counts.items() if c["executed"]}
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | step | dcp 1 ms / token | dcp 8 ms / token | dcp 8 / dcp 1 | same greedy tokens | "
        "collectives per step, dcp 1 | dcp 8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda c: ", ".join(f"{n} {kind}" for kind, n in c.items()) or "none"  # noqa: E731
    for r in rows:
        step = "decode" if r["k"] == 0 else f"chain {r['k']} (verify of {r['k'] + 1})"
        lines.append(
            f"| {r['batch']} | {step} | {r['ms_per_token_dcp1']:.2f} | {r['ms_per_token_dcp8']:.2f} | "
            f"{r['ratio']:.3f} | {r['same_tokens']} | {fmt(r['collectives']['dcp1'])} | "
            f"{fmt(r['collectives']['dcp8'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per case (dcp 1 and 8 alternating)")
    p.add_argument("--cases", default=",".join(f"{b}x{k}" for b, k in CASES), help="batch x chain depth, e.g. 1x0,1x3")
    args = p.parse_args()
    simulate_cpu_devices(8)
    import jax

    from jaxspec import bundled
    from sharding.mesh import make_mesh

    pair = bundled.load_pair(mesh=make_mesh("1x8"))
    rows = []
    for case in args.cases.split(","):
        batch, k = map(int, case.split("x"))
        rows.append(measure_case(pair, batch, k, args) | {"collectives": census(pair[0], batch, k + 1)})
    command = " ".join(["PYTHONPATH=$PWD python benchmarks/dcp_cost.py", *sys.argv[1:]])
    record = {"command": command, "mesh": "1x8", "pair": "bundled", "jax": jax.__version__}
    record |= {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}
    record["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (RESULTS / "dcp_cost.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / "dcp_cost.md").write_text(f"`{command}` (mesh 1x8, bundled pair, greedy)\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
