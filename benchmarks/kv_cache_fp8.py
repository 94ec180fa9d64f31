"""Accuracy of the fp8 latent cache against the compute-dtype cache (issue 29 item 2): greedy token agreement and
logit error, on the bundled pair and on a config with Kimi-K2.5's MLA widths.

    python benchmarks/kv_cache_fp8.py                              # both models -> results/kv_cache_fp8.json
    python benchmarks/kv_cache_fp8.py --prompts 4 --new-tokens 16  # quicker

Per model and compute dtype, the same target runs with `kv_cache_dtype="auto"` (the cache in the compute dtype) and
`"fp8"` (float8_e4m3 + a float32 scale per token):
- free-running greedy (plain decoding, batch of all prompts): how many prompts generate identical tokens, and the
  fraction of generated positions that agree before a prompt's first divergence;
- teacher-forced over the auto run's greedy sequences (prompt + continuation, one pass through each cache format):
  argmax agreement on the continuation positions and the logit error |fp8 - auto| (max and mean, in units of the
  logits' standard deviation), with the float32 run's auto cache as a second reference;
- speculative decoding with the drafter (bundled pair only): mean accepted length with each cache.
"kimi-mla" is this benchmark's own config: the tiny preset with Kimi-K2.5's cache widths (kv_lora_rank 512,
qk_rope_head_dim 64; 576 values per token), 4 layers, random weights, head scaled x25 (random logits are flat).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import KimiConfig, Target, bundled
from jaxspec.decoding.generate import generate
from jaxspec.io import load_drafter, load_target


def teacher_forced(target: Target, seqs: list[list[int]]) -> np.ndarray:
    """Logits [B, S, V] of right-padded sequences through `target`'s cache (one prefill)."""
    n = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), n), np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    pos = np.broadcast_to(np.arange(n), ids.shape)
    return np.asarray(target.forward(ids, pos, target.init_cache(len(seqs), n))[0], np.float32)


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(target: Target, prompts: list[list[int]], new: int, reference: Target | None, drafter=None) -> dict:
    fp8 = target.with_kv_cache_dtype("fp8")
    runs = {
        kv: generate(t, None, prompts, max_new_tokens=new, num_steps=0).tokens
        for kv, t in (("auto", target), ("fp8", fp8))
    }
    div = [first_divergence(a, b) for a, b in zip(runs["auto"], runs["fp8"], strict=True)]
    seqs = [p + t for p, t in zip(prompts, runs["auto"], strict=True)]
    logits = {"auto": teacher_forced(target, seqs), "fp8": teacher_forced(fp8, seqs)}
    if reference is not None:
        logits["reference"] = teacher_forced(reference, seqs)
    # continuation positions: the logits that predicted each generated token (prompt's last .. second to last)
    mask = np.zeros(logits["auto"].shape[:2], bool)
    for i, (p, t) in enumerate(zip(prompts, runs["auto"], strict=True)):
        mask[i, len(p) - 1 : len(p) + len(t) - 1] = True
    std = float(logits["auto"][mask].std())

    def error(a: str, b: str) -> dict:
        d = np.abs(logits[a] - logits[b])[mask]
        agree = (logits[a].argmax(-1) == logits[b].argmax(-1))[mask]
        return {"max_abs_over_std": float(d.max()) / std, "mean_abs_over_std": float(d.mean()) / std,
                "argmax_agreement": float(agree.mean())}  # fmt: skip

    out = {
        "prompts": len(prompts),
        "new_tokens": new,
        "greedy_identical_prompts": sum(a == b for a, b in zip(runs["auto"], runs["fp8"], strict=True)),
        "greedy_positions_before_first_divergence": sum(div) / sum(len(t) for t in runs["auto"]),
        "teacher_forced_positions": int(mask.sum()),
        "logit_std": std,
        "fp8_vs_auto": error("fp8", "auto"),
    }
    if reference is not None:
        out["auto_vs_float32"] = error("auto", "reference")
        out["fp8_vs_float32"] = error("fp8", "reference")
    if drafter is not None:
        for kv, t in (("auto", target), ("fp8", fp8)):
            stats = generate(t, drafter, prompts, max_new_tokens=new, num_steps=3).stats
            out[f"spec_mean_accepted_length_{kv}"] = stats["mean_accepted_length"]
    return out


def kimi_mla_target(dtype) -> Target:
    cfg = dataclasses.replace(
        KimiConfig.preset("tiny"), kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=4, vocab_size=1024
    )
    target = Target.random(cfg, dtype=dtype, seed=0)
    params = jax.tree.map(lambda x: x, target.params)
    params["lm_head"] = params["lm_head"].replace(params["lm_head"].get_value() * 25.0)
    return dataclasses.replace(target, params=params)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts of the bundled pair (at most 16)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/kv_cache_fp8"))
    args = p.parse_args()
    start = time.perf_counter()
    results: dict = {}
    target_dir, drafter_dir = bundled.paths()
    from jaxspec.tokenizer import load_tokenizer

    tok = load_tokenizer(target_dir)
    prompts = [tok.encode(t)[-96:] for t in bundled.prompts()[: args.prompts]]
    f32 = load_target(target_dir, dtype=jnp.float32)
    for name in ("float32", "bfloat16"):
        target = f32 if name == "float32" else load_target(target_dir, dtype=jnp.bfloat16)
        drafter = load_drafter(drafter_dir, target, dtype=target.dtype)
        ref = None if name == "float32" else f32
        results[f"bundled/{name}"] = compare(target, prompts, args.new_tokens, ref, drafter)
        print(name, json.dumps(results[f"bundled/{name}"]), flush=True)
    rng = np.random.default_rng(0)
    own = [rng.integers(2, 1024, int(n)).tolist() for n in rng.integers(8, 64, args.prompts)]
    f32_own = kimi_mla_target(jnp.float32)
    for name in ("float32", "bfloat16"):
        target = f32_own if name == "float32" else kimi_mla_target(jnp.bfloat16)
        ref = None if name == "float32" else f32_own
        results[f"kimi-mla/{name}"] = compare(target, own, args.new_tokens, ref)
        print(name, json.dumps(results[f"kimi-mla/{name}"]), flush=True)
    record = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "seconds": time.perf_counter() - start,
        "results": results,
    }
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output.with_suffix('.json')}")


if __name__ == "__main__":
    main()
