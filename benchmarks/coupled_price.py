"""The price of coupled sampling (decoding/coupling.py) on the bundled pair: accepted length and tokens/s of coupled
against lossless rejection sampling, a chain and a tree, at temperatures 0.6 and 1.0, measured in one run.

    python benchmarks/coupled_price.py                 # 8 HumanEval prompts, 48 new tokens, batch 1, 2 timed passes
    python benchmarks/coupled_price.py --prompt-set sharegpt --prompt-count 16 --repeats 3

Every configuration first runs every prompt once (compiling its buckets); then --repeats timed passes run all
configurations prompt by prompt, interleaved, so drift in machine speed hits them alike. Plain decoding (its tokens
are the same in both modes) is the baseline of each temperature. A configuration's accepted length is its mean over
every cycle (tokens per cycle, the bonus included); its rate is total new tokens / total seconds. Each prompt runs
with its own seed (its index), the same in every configuration. Prompts: --prompt-set (prompt_sets.py). Writes
benchmarks/results/coupled_price.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import prompt_sets  # this directory (run as a script)

from jaxspec.decoding import DraftShape

SHAPES = [DraftShape(3), DraftShape(3, topk=2, num_draft_tokens=6)]
MODES = ("rejection", "coupled")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_sets.add_arguments(p, count=8, max_tokens=256)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperatures", default="0.6,1.0")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/coupled_price.json"))
    args = p.parse_args()

    import jax

    from jaxspec import bundled, generate

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    prompts = prompt_set.ids
    temperatures = [float(t) for t in args.temperatures.split(",")]
    configs = [(t, DraftShape(0), "rejection") for t in temperatures]
    configs += [(t, shape, mode) for t in temperatures for shape in SHAPES for mode in MODES]

    def run(i: int, config) -> dict:
        temperature, shape, mode = config
        kw = dict(draft=shape, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=i, sampling=mode)
        return generate(target, drafter if shape.num_steps else None, [prompts[i]], tokenizer=tokenizer, **kw).stats

    for i in range(len(prompts)):  # compile every bucket of every configuration
        for config in configs:
            run(i, config)
    runs: dict[tuple, list] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for i in range(len(prompts)):
            for config in configs:
                runs[config].append(run(i, config))
    rows = [_row(c, runs[c]) for c in configs]
    for row in rows:
        plain = next(r for r in rows if r["temperature"] == row["temperature"] and r["draft"] == "plain")
        row["speedup_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
    for row in rows:
        if row["mode"] == "coupled":
            other = next(r for r in rows if r["mode"] == "rejection" and r["config"][:2] == row["config"][:2])
            row["vs_rejection"] = {
                "accepted_length": row["accepted_length"] / other["accepted_length"],
                "tokens_per_s": row["tokens_per_s"] / other["tokens_per_s"],
            }
    result = {
        "command": f"python benchmarks/coupled_price.py {prompt_sets.flags(args)} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --temperatures {args.temperatures}",
        **prompt_set.describe(),
        "jax": jax.__version__,
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))


def _row(config, stats: list[dict]) -> dict:
    temperature, shape, mode = config
    cycles = sum(s["cycles"] for s in stats)
    tokens = sum(s["new_tokens"] for s in stats)
    accepted = sum(sum(s["accepted"]) for s in stats)  # drafts accepted over all cycles
    seconds = sum(s["seconds"] for s in stats)
    return {
        "config": [temperature, shape.label],
        "temperature": temperature,
        "draft": "plain" if shape.plain else shape.label,
        "mode": mode,
        "accepted_length": (accepted + cycles) / max(cycles, 1),
        "tokens_per_s": tokens / seconds,
        "new_tokens": tokens,
        "cycles": cycles,
    }


def _markdown(result: dict) -> str:
    lines = [
        f"# Coupled against rejection sampling ({result['prompts']} {result['prompt_set']} prompts, batch 1)",
        "",
        f"`{result['command']}` (jax {result['jax']})",
        "",
        "| temperature | draft | mode | accepted length | tokens/s | x plain | coupled / rejection (length, tok/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        vs = r.get("vs_rejection")
        rel = f"{vs['accepted_length']:.3f}, {vs['tokens_per_s']:.3f}" if vs else ""
        lines.append(
            f"| {r['temperature']} | {r['draft']} | {r['mode']} | {r['accepted_length']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f} | {rel} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
