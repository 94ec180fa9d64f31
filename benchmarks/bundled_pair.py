"""The bundled pair's acceptance and speedup on held-out prompts: speculative (k draft steps, greedy) vs plain decoding
of the same target, measured in one run on this machine.

    python benchmarks/bundled_pair.py                       # k=3, 16 held-out prompts, 96 new tokens, batch 1
    python benchmarks/bundled_pair.py --num-steps 2 --repeats 3

Every prompt is first run once in both modes (compiling every prompt-length bucket), then --repeats timed passes
interleave speculative and plain per prompt, so drift in machine speed hits both alike. Reported: mean accepted length
(tokens per cycle incl. the bonus token, over all prompts), acceptance per draft position, tokens/s of each mode
(total new tokens / total seconds) and their ratio. Writes benchmarks/results/bundled_pair.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=16, help="how many held-out prompts (at most 16)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes (the median pass ratio is reported)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/bundled_pair.json"))
    args = p.parse_args()

    import jax

    from jaxspec import bundled, generate

    target, drafter, tokenizer = bundled.load_pair()
    prompts = bundled.prompts()[: args.prompts]

    def run(prompt: str, k: int):
        return generate(
            target,
            drafter if k else None,
            [prompt],
            max_new_tokens=args.max_new_tokens,
            num_steps=k,
            tokenizer=tokenizer,
        ).stats

    for prompt in prompts:  # compile every bucket in both modes
        run(prompt, args.num_steps), run(prompt, 0)
    passes = []
    for _ in range(args.repeats):
        spec, plain = [], []
        for prompt in prompts:
            spec.append(run(prompt, args.num_steps))
            plain.append(run(prompt, 0))
        passes.append((spec, plain))

    def rate(stats) -> float:
        return sum(s["new_tokens"] for s in stats) / sum(s["seconds"] for s in stats)

    ratios = [rate(spec) / rate(plain) for spec, plain in passes]
    spec, plain = passes[ratios.index(statistics.median_low(ratios))]
    cycles = sum(s["cycles"] for s in spec)
    reached = [sum(col) for col in zip(*(s["reached"] for s in spec), strict=True)]
    accepted = [sum(col) for col in zip(*(s["accepted"] for s in spec), strict=True)]
    record = {
        "command": "python benchmarks/bundled_pair.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
        "num_steps": args.num_steps,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch": 1,
        "temperature": 0.0,
        "new_tokens": sum(s["new_tokens"] for s in spec),
        "cycles": cycles,
        # Tokens committed per cycle (accepted drafts + the bonus token), over every cycle of every prompt.
        "mean_accepted_length": sum(s["new_tokens"] for s in spec) / cycles,
        "acceptance_by_position": [a / max(r, 1) for a, r in zip(accepted, reached, strict=True)],
        "speculative_tok_s": rate(spec),
        "plain_tok_s": rate(plain),
        "speedup": rate(spec) / rate(plain),
        "speedup_per_pass": ratios,
        "platform": jax.devices()[0].platform,
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"held-out prompts: {len(prompts)}, k={args.num_steps}, greedy, batch 1, {args.max_new_tokens} new tokens")
    print(f"mean accepted length (incl. bonus): {record['mean_accepted_length']:.2f}")
    print("acceptance by draft position: " + ", ".join(f"{a:.2f}" for a in record["acceptance_by_position"]))
    print(
        f"speculative {record['speculative_tok_s']:.1f} tok/s, plain {record['plain_tok_s']:.1f} tok/s: "
        f"speedup {record['speedup']:.2f}x (passes: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
