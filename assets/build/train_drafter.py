"""Train the bundled drafter for the bundled target with `jaxspec.training` and export it in SGLang format.

    python assets/build/train_drafter.py             # after train_target.py; seeded; resumes if interrupted

Data: prompts are the opening lines of functions and classes from the TRAINING split of the standard library (the
benchmark's held-out files are never used); the target answers each one greedily and the drafter learns from those
regenerated responses (`generate_dataset`), with hidden states and target distributions recomputed per batch.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import corpus
import jax.numpy as jnp
import numpy as np

from jaxspec import load_target
from jaxspec.tokenizer import load_tokenizer
from jaxspec.training import generate_dataset, train_drafter


def training_prompts(tokenizer, n: int, seed: int, max_tokens: int = 48) -> list[list[int]]:
    """`n` prompts: 1-4 lines from a random `def`/`class` line of a random training-split file, <= max_tokens."""
    rng = np.random.default_rng(seed)
    files = [text.splitlines(keepends=True) for _, text in corpus.read_split(held_out=False)]
    starts = [
        (f, i)
        for f, lines in enumerate(files)
        for i, ln in enumerate(lines)
        if ln.lstrip().startswith(("def ", "class "))
    ]
    prompts = []
    for j in rng.permutation(len(starts))[:n]:
        f, i = starts[j]
        text = "".join(files[f][i : i + int(rng.integers(1, 5))])
        prompts.append(tokenizer.encode(text, allow_special=False)[:max_tokens])
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("assets/kimi-py-tiny/target"))
    p.add_argument("--out", type=Path, default=Path("assets/kimi-py-tiny/drafter"))
    p.add_argument("--work", type=Path, default=Path("build/kimi-py-tiny/drafter"), help="dataset, checkpoints, logs")
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ttt-depth", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    target = load_target(args.target, dtype=jnp.float32)
    tokenizer = load_tokenizer(args.target)
    data = generate_dataset(
        target,
        training_prompts(tokenizer, args.prompts, args.seed),
        args.work / "data",
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        seed=args.seed,
        shard_size=64,
    )
    run = args.work / "run"
    train_drafter(
        target,
        data,
        run,
        draft_vocab_size=args.draft_vocab,
        steps=args.steps,
        batch_size=args.batch,
        ttt_depth=args.ttt_depth,
        lr=args.lr,
        warmup=args.steps // 10,
        seed=args.seed,
        checkpoint_every=50,
        resume=(run / "train_config.json").is_file(),
        dtype=jnp.bfloat16,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run / name, args.out / name)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
