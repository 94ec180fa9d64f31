"""Tree drafts vs chain drafts on the bundled pair (issue 16): tokens/s and accepted length of each configuration,
measured in one run, and the verify step's cost against the number of draft tokens that explains the result.

    python benchmarks/tree_vs_chain.py                   # 8 HumanEval prompts, 64 new tokens, greedy, batch 1
    python benchmarks/tree_vs_chain.py --prompt-count 16 --repeats 3

Every configuration first runs every prompt once (compiling its buckets); then --repeats timed passes run all
configurations prompt by prompt, interleaved, so drift in machine speed hits them alike. A configuration's rate is
its total new tokens / total seconds over the passes. The verify costs come from `PhaseTimer` (the compiled phase
alone, median of repeated calls): a chain verify of T tokens and a tree verify of T nodes, each over a decode step,
at the prompts' typical context. Prompts: --prompt-set (prompt_sets.py); the outputs must pass its loop check.
Writes benchmarks/results/tree_vs_chain.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import prompt_sets  # this directory (run as a script)

from jaxspec.decoding import DraftShape

CHAINS = [DraftShape(k) for k in (2, 3, 4, 5)]
TREES = [DraftShape(*t) for t in [(3, 2, 5), (3, 2, 7), (4, 2, 8), (5, 2, 10), (3, 3, 8), (4, 3, 12), (6, 4, 16)]]
VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    prompt_sets.add_arguments(p, count=8, max_tokens=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/tree_vs_chain.json"))
    args = p.parse_args()

    import jax

    from jaxspec import bundled, generate
    from jaxspec.profiling.timing import PhaseTimer

    target, drafter, tokenizer = bundled.load_pair()
    prompt_set = prompt_sets.from_args(args, tokenizer)
    prompts, outputs = prompt_set.ids, {}
    configs = CHAINS + TREES

    def run(prompt: list[int], shape: DraftShape):
        out = generate(target, drafter, [prompt], draft=shape, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer)
        outputs[tuple(prompt)] = [int(t) for t in out.tokens[0]]  # greedy: the same for every configuration
        return out.stats

    for prompt in prompts:  # compile every bucket of every configuration
        for cfg in configs:
            run(prompt, cfg)
    runs: dict[DraftShape, list] = {cfg: [] for cfg in configs}
    for _ in range(args.repeats):
        for prompt in prompts:
            for cfg in configs:
                runs[cfg].append(run(prompt, cfg))
    rows = [_row(cfg, runs[cfg]) for cfg in configs]
    loops = prompt_sets.loops_or_exit([outputs[tuple(p)] for p in prompts], args)

    context = 2 * max(len(q) for q in prompts)  # a verify at a typical live context
    timer = PhaseTimer(target, drafter, batch=1, cache_len=4 * context, context=context)
    decode = timer.decode(reps=7)
    verify = {T: {"chain": timer.verify(T, reps=7) / decode, "tree": timer.tree_verify(T, reps=7) / decode}
              for T in VERIFY_TOKENS}  # fmt: skip

    best_chain = max((r for r in rows if r["topk"] == 1), key=lambda r: r["tok_s"])
    best_tree = max((r for r in rows if r["topk"] > 1), key=lambda r: r["tok_s"])
    record = {
        "command": f"python benchmarks/tree_vs_chain.py {prompt_sets.flags(args)} "
        f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}",
        **prompt_set.describe(),
        "output_loops": loops,
        "max_new_tokens": args.max_new_tokens,
        "batch": 1,
        "temperature": 0.0,
        "configs": rows,
        "best_chain": best_chain,
        "best_tree": best_tree,
        "best_tree_over_best_chain": best_tree["tok_s"] / best_chain["tok_s"],
        "decode_ms": decode * 1e3,
        "verify_over_decode": verify,
        "context": context,
        "platform": jax.devices()[0].platform,
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(_markdown(record))
    print(_markdown(record))


def _row(shape: DraftShape, stats: list[dict]) -> dict:
    tokens, cycles = sum(s["new_tokens"] for s in stats), sum(s["cycles"] for s in stats)
    return (
        {"draft": shape.label}
        | shape.to_dict()
        | {
            "tok_s": tokens / sum(s["seconds"] for s in stats),
            # tokens committed per cycle (accepted drafts + the bonus); the prefill's first token is not a cycle's
            "accepted_length": (tokens - len(stats)) / max(cycles, 1),
            "ms_per_cycle": 1e3 * sum(s["seconds"] for s in stats) / max(cycles, 1),
        }
    )


def _markdown(r: dict) -> str:
    lines = [
        "# Tree drafts vs chain drafts on the bundled pair (issue 16)",
        "",
        f"`{r['command']}`: greedy, batch 1, {r['prompts']} {r.get('prompt_set', 'held-out')} prompts x "
        f"{r['max_new_tokens']} new tokens; "
        f"{r['cpu']} ({r['platform']}), jax {r['jax']}.",
        "",
        "| num_steps | topk | draft tokens (verified) | tok/s | accepted length | ms per cycle |",
        "|---|---|---|---|---|---|",
    ]
    for c in r["configs"]:
        lines.append(
            f"| {c['num_steps']} | {c['topk']} | {c['num_draft_tokens']} | {c['tok_s']:.1f} | "
            f"{c['accepted_length']:.2f} | {c['ms_per_cycle']:.2f} |"
        )
    bc, bt = r["best_chain"], r["best_tree"]
    lines += [
        "",
        f"Best chain: k={bc['num_steps']}, {bc['tok_s']:.1f} tok/s, accepted length {bc['accepted_length']:.2f}. "
        f"Best tree: steps={bt['num_steps']} topk={bt['topk']} draft tokens={bt['num_draft_tokens']}, "
        f"{bt['tok_s']:.1f} tok/s, accepted length {bt['accepted_length']:.2f}. "
        f"Best tree / best chain: **{r['best_tree_over_best_chain']:.2f}x**.",
        "",
        f"Verify cost over a decode step ({r['decode_ms']:.2f} ms) at context {r['context']}, by tokens verified:",
        "",
        "| tokens | chain verify / decode | tree verify / decode |",
        "|---|---|---|",
    ]
    for T, v in r["verify_over_decode"].items():
        lines.append(f"| {T} | {v['chain']:.2f} | {v['tree']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
