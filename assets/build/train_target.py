"""Train the bundled target: a small Kimi-K2.5-architecture model (MLA, sigmoid-routed MoE with a shared expert) on
Python standard library source, then quantize its routed experts to INT4 and save it in the HF layout with a
compressed-tensors `quantization_config`, like the published Kimi-K2.5 checkpoint.

    python assets/build/train_target.py --out assets/kimi-py-tiny/target            # seeded; resumes if interrupted

Training runs the same `KimiModel` that serves it (fp32, float experts), next-token cross-entropy, AdamW with warmup
and cosine decay. Checkpoints (Orbax) go to --work every --checkpoint-every steps; a rerun resumes from the latest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import corpus
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxspec.config import Int4Quant, KimiConfig, RopeScaling

# The bundled target. 4 layers (1 dense + 3 MoE with 8 routed experts, top-2, and a shared expert), hidden 256,
# 4096-token BPE vocabulary: ~10M parameters, trains in ~30 minutes on 2 CPU cores.
CONFIG = KimiConfig.preset("tiny").replace(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=2048,
    rope_theta=50000.0,
    rope_scaling=RopeScaling(
        factor=4.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    quant=Int4Quant(group_size=32),
    bos_token_id=None,
    eos_token_id=0,  # <|endoftext|>, the tokenizer's first special token
    pad_token_id=1,
)


def batches(stream: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Random windows [batch, seq + 1], a pure function of (seed, step): resuming replays the same data."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return np.stack([stream[s : s + seq + 1] for s in starts])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("assets/kimi-py-tiny/target"))
    p.add_argument("--work", type=Path, default=Path("build/kimi-py-tiny/target"), help="checkpoints and logs")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    args = p.parse_args()

    from jaxspec.io import save_target
    from jaxspec.runtime import Target

    args.work.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        corpus.train_tokenizer(tok_dir, CONFIG.vocab_size)
    stream_path = args.work / "train_ids.npy"
    if not stream_path.is_file():
        np.save(stream_path, corpus.encode_split(tok_dir, held_out=False))
    stream = np.load(stream_path)
    print(f"training stream: {len(stream):,} tokens; {args.steps} steps x {args.batch} x {args.seq}")

    target = Target.random(CONFIG, dtype=jnp.float32, int4_experts=False, seed=args.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps, end_value=args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    # The router bias (DeepSeek-V3's e_score_correction_bias) gets no gradient (it only shifts the top-k choice);
    # it stays zero. Load balancing is not needed at this size.
    params = target.params
    opt_state = opt.init(params)

    def loss_fn(params, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
        logits = target.apply(params, x, pos, None, impl="expanded")[0].astype(jnp.float32)
        logits = jax.sharding.reshard(logits, NamedSharding(target.mesh, P()))  # one device: a no-op relabel
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mngr = ocp.CheckpointManager(args.work / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt": opt_state}))
        params, opt_state = restored["params"], restored["opt"]
        print(f"resumed from step {start}")
    log = (args.work / "log.jsonl").open("a")
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="target")
    t0 = time.perf_counter()
    try:
        for step in bar:
            tokens = jnp.asarray(batches(stream, step, args.batch, args.seq, args.seed))
            params, opt_state, loss = train_step(params, opt_state, tokens)
            if step % 10 == 0 or step == args.steps - 1:
                loss = float(loss)
                bar.set_postfix(loss=f"{loss:.3f}")
                log.write(json.dumps({"step": step, "loss": loss, "s": time.perf_counter() - t0}) + "\n")
                log.flush()
            if (step + 1) % args.checkpoint_every == 0:
                mngr.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
    except KeyboardInterrupt:
        mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt": opt_state}), force=True)
        mngr.wait_until_finished()
        raise SystemExit(f"interrupted: checkpoint saved at step {step}; rerun to resume") from None
    if mngr.latest_step() != args.steps:
        mngr.save(args.steps, args=ocp.args.StandardSave({"params": params, "opt": opt_state}), force=True)
    mngr.wait_until_finished()

    trained = Target(CONFIG, target.mesh, target.graphdef, params, target.rules)
    save_target(trained, args.out, tokenizer_dir=tok_dir, dtype=jnp.bfloat16)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
