"""Decode / verify step cost against the bytes a step must read: routed experts before vs after, in ONE run.

    python benchmarks/step_cost.py [--tokens 1,2,4,8] [--prefill 64] [--repeats 7]

On an expert-dominated config (INT4 expert stack >= 20x a 32 MiB L3), on 1 device and on 8 simulated CPU devices,
times the cached step for T tokens (batch 1) with the routed-expert path of commit 88d07ae ("before": static
capacity of min(E_local, M*K) experts in chunks of 8, loaded from git history, not kept in the package) and with
today's path ("after"), interleaved. A separate, untimed run records the experts each step routes to (a debug
callback), giving the distinct experts hit per device and layer and the floor: the bytes the step must read
(every device's non-expert weights + its hit experts' packed weights and scales; the simulated devices share the
CPU, so floors add over devices). Writes benchmarks/results/step_cost.json and step_cost.md.

The 8 simulated devices share 2 cores: times are comparable within a run (ratios), not as absolute speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from sharding.cpu import simulate_cpu_devices

BEFORE_COMMIT = "88d07ae"
CACHE_LEN = 64
START = 32  # position of the step's first token (a short live context)


def bench_config():
    from jaxspec.config import KimiConfig

    # Experts dominate: each INT4 expert (3 x 256 x 2048 / 2 bytes + bf16 scales) is 0.84 MB, 384 per layer,
    # 3 MoE layers: 963 MB of INT4 experts (30x a 32 MiB L3); non-expert weights ~25 MB (f32).
    return KimiConfig.preset("tiny").replace(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=384,
        num_experts_per_tok=8,
    )


def random_target(cfg, mesh, dtype=None):
    """Random weights made directly in their shardings (norms 1, router bias 0, random packed INT4)."""
    import jax
    import jax.numpy as jnp

    from jaxspec import Target

    abstract = Target.abstract(cfg, mesh=mesh, dtype=dtype or jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract.params)

    def make(key, path, sds):
        name = jax.tree_util.keystr(path)
        if sds.dtype == jnp.uint8:
            return jax.random.bits(key, sds.shape, jnp.uint8)
        if "scale" in name:
            return jnp.full(sds.shape, 0.01, sds.dtype)
        if "norm" in name:
            return jnp.ones(sds.shape, sds.dtype)
        if "router_bias" in name:
            return jnp.zeros(sds.shape, sds.dtype)
        return (jax.random.normal(key, sds.shape) / jnp.sqrt(sds.shape[-2] if len(sds.shape) > 1 else 1)).astype(
            sds.dtype
        )

    keys = jax.random.split(jax.random.key(0), len(leaves))
    shardings = [sds.sharding for _, sds in leaves]
    fn = jax.jit(lambda keys: [make(k, p, s) for k, (p, s) in zip(keys, leaves, strict=True)], out_shardings=shardings)
    params = jax.tree_util.tree_unflatten(treedef, fn(keys))
    return Target(cfg, mesh, abstract.graphdef, params, abstract.rules)


def load_before():
    """routed_experts of commit BEFORE_COMMIT, from git history."""
    from history import module_at

    module = module_at(BEFORE_COMMIT, "jaxspec/models/moe.py", "_moe_before")
    import jax

    from jaxspec.models.moe import LayerSlice

    def layer(w):  # what the layer scan handed the old path: this layer's whole expert stack (a copy)
        take = lambda a: jax.lax.dynamic_index_in_dim(a, w.layer, 0, keepdims=False)
        return jax.tree.map(take, w.stack) if isinstance(w, LayerSlice) else w

    def routed_experts(x, idx, w, *weights, impl="auto", interpret=None):
        return module.routed_experts(x, idx, w, *map(layer, weights))

    return routed_experts


@contextlib.contextmanager
def patched_routed_experts(fn):
    from jaxspec.models import moe

    saved = moe.routed_experts
    moe.routed_experts = fn
    try:
        yield
    finally:
        moe.routed_experts = saved


def step_fn(target, tokens: int, *, cache_len: int = CACHE_LEN, start: int = START):
    """A compiled cached step (batch 1, `tokens` tokens at positions start...) over a cache of `cache_len`
    positions, and its inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.asarray(np.random.default_rng(tokens).integers(0, target.config.vocab_size, (1, tokens)), jnp.int32)
    pos = jnp.arange(start, start + tokens, dtype=jnp.int32)[None]
    cache = target.init_cache(1, cache_len)
    step = jax.jit(lambda p, t, q, c: target.apply(p, t, q, c)[0])
    compiled = step.lower(target.params, ids, pos, cache).compile()
    return compiled, (target.params, ids, pos, cache)


def routing_hits(target, tokens: int, **step_kw) -> list[list[int]]:
    """Distinct local experts hit per (MoE layer, device) by one step (a debug callback on the routing);
    `step_kw` as `step_fn` takes them."""
    import collections

    import jax
    import numpy as np

    from jaxspec.models import moe
    from sharding.mesh import MODEL

    n_dev, E = target.mesh.shape[MODEL], target.config.n_routed_experts
    calls = collections.defaultdict(list)  # device -> hits per MoE layer, in layer order

    def record(idx, dev):
        ids, d = np.unique(np.asarray(idx)), int(dev)
        calls[d].append(int(((ids >= d * E // n_dev) & (ids < (d + 1) * E // n_dev)).sum()))

    real = moe.routed_experts

    def spy(x, idx, *args, **kw):
        jax.debug.callback(record, idx, jax.lax.axis_index(MODEL), ordered=False)
        return real(x, idx, *args, **kw)

    with patched_routed_experts(spy):
        compiled, args = step_fn(target, tokens, **step_kw)
    jax.block_until_ready(compiled(*args))
    jax.effects_barrier()
    return [[calls[d][layer] for d in range(n_dev)] for layer in range(target.config.num_moe_layers)]


def floor_bytes(target, hits: list[list[int]], *, embed_rows: int | None = None) -> float:
    """Bytes the step must read, summed over devices: all non-expert weights + the hit experts. With
    `embed_rows`, the embedding table counts only that many rows (a step looks up its tokens' rows, not the table;
    where the vocabulary is large, as Kimi's 163840 x 7168, the whole table would dwarf what a step reads)."""
    from flax import nnx

    from sharding import inspect

    cfg = target.config
    expert = 0
    total = sum(inspect.device_param_bytes(target.params).values())
    for path, var in nnx.to_flat_state(target.params):
        if path[-1] in ("gate", "up", "down") and "moe_layers" in path and path[-2] == "mlp":
            stack = inspect.param_bytes(var.get_value())
            total -= stack
            expert += stack / (cfg.num_moe_layers * cfg.n_routed_experts)
    if embed_rows is not None:
        table = inspect.param_bytes(target.params["embed"].get_value())
        total -= table - table * embed_rows / cfg.vocab_size
    return total + expert * sum(sum(h) for h in hits)


def time_pair(fns, args, repeats: int) -> list[float]:
    import jax

    for f in fns:
        jax.block_until_ready(f(*args))  # warm
    times = [[] for _ in fns]
    for _ in range(repeats):
        for f, t in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure(target, tokens: int, before, repeats: int) -> dict:
    import numpy as np

    from sharding import inspect

    with patched_routed_experts(before):
        old, args = step_fn(target, tokens)
    new, _ = step_fn(target, tokens)
    t_old, t_new = time_pair([old, new], args, repeats)
    diff = float(np.abs(np.asarray(old(*args)) - np.asarray(new(*args))).max())
    hits = routing_hits(target, tokens)
    return dict(
        tokens=tokens,
        before_ms=1e3 * t_old,
        after_ms=1e3 * t_new,
        speedup=t_old / t_new,
        hit_experts_per_device_layer=hits,
        mean_hit_per_device_layer=sum(map(sum, hits)) / sum(map(len, hits)),
        floor_bytes=floor_bytes(target, hits),
        max_abs_logit_diff_after_vs_before=diff,
        temp_bytes_per_device=dict(
            before=inspect.memory_report(old)["temp_bytes"], after=inspect.memory_report(new)["temp_bytes"]
        ),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--prefill", type=int, default=64, help="also time one prefill-sized step (0: skip)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--meshes", default="1x8,1x1")
    p.add_argument("--output", default="benchmarks/results/step_cost.json")
    args = p.parse_args()
    simulate_cpu_devices(8)
    from sharding import inspect
    from sharding.mesh import make_mesh, single_device_mesh

    cfg, before = bench_config(), load_before()
    tokens = [int(t) for t in args.tokens.split(",")]
    result = dict(
        command="python benchmarks/step_cost.py " + f"--tokens {args.tokens} --prefill {args.prefill} "
        f"--repeats {args.repeats} --meshes {args.meshes}",
        before=f"{BEFORE_COMMIT}:jaxspec/models/moe.py routed_experts",
        config=dict(
            hidden=cfg.hidden_size,
            moe_inter=cfg.moe_intermediate_size,
            experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            moe_layers=cfg.num_moe_layers,
            dtype="float32",
            cache_len=CACHE_LEN,
        ),
        meshes={},
    )
    for mesh_name in args.meshes.split(","):
        mesh = single_device_mesh() if mesh_name == "1x1" else make_mesh(mesh_name)
        target = random_target(cfg, mesh)
        experts = sum(
            inspect.param_bytes(target.params["moe_layers"]["mlp"][w].get_value()) for w in ("gate", "up", "down")
        )
        rows = [measure(target, t, before, args.repeats) for t in tokens]
        decode = rows[0]
        for r in rows:
            r["time_ratio_vs_decode"] = r["after_ms"] / decode["after_ms"]
            r["floor_ratio_vs_decode"] = r["floor_bytes"] / decode["floor_bytes"]
            r["time_over_floor_ratio"] = r["time_ratio_vs_decode"] / r["floor_ratio_vs_decode"]
        prefill = measure(target, args.prefill, before, max(3, args.repeats // 2)) if args.prefill else None
        result["meshes"][mesh_name] = dict(int4_expert_bytes=experts, steps=rows, prefill=prefill)
        print(f"[{mesh_name}] INT4 experts {experts / 2**20:.0f} MiB")
        for r in rows + ([prefill] if prefill else []):
            print(
                f"  T={r['tokens']:3d}: before {r['before_ms']:8.2f} ms  after {r['after_ms']:8.2f} ms  "
                f"x{r['speedup']:.2f}  hit/dev/layer {r['mean_hit_per_device_layer']:.2f}  "
                f"time/decode {r.get('time_ratio_vs_decode', float('nan')):.2f}  "
                f"floor/decode {r.get('floor_ratio_vs_decode', float('nan')):.2f}"
            )
        del target
        Path(args.output).write_text(json.dumps(result, indent=1))  # after each mesh: partial results survive
        write_markdown(result, Path(args.output).with_suffix(".md"))


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# step_cost: routed experts before vs after (one run)",
        "",
        f"`{result['command']}`  (before = {result['before']})",
        "",
    ]
    for mesh_name, m in result["meshes"].items():
        lines += [
            f"## mesh {mesh_name}: {m['int4_expert_bytes'] / 2**20:.0f} MiB of INT4 experts",
            "",
            "| T | before ms | after ms | speedup | hit experts / device / layer | time / decode | floor / decode "
            "| (time/decode) / (floor/decode) | max logit diff |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["steps"]:
            lines.append(
                f"| {r['tokens']} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | {r['speedup']:.2f} "
                f"| {r['mean_hit_per_device_layer']:.2f} | {r['time_ratio_vs_decode']:.2f} "
                f"| {r['floor_ratio_vs_decode']:.2f} | {r['time_over_floor_ratio']:.2f} "
                f"| {r['max_abs_logit_diff_after_vs_before']:.1e} |"
            )
        if m["prefill"]:
            r = m["prefill"]
            lines.append(
                f"\nPrefill-sized step (T={r['tokens']}): before {r['before_ms']:.1f} ms, after {r['after_ms']:.1f} ms "
                f"(x{r['speedup']:.2f}), {r['mean_hit_per_device_layer']:.1f} experts hit per device and layer."
            )
        lines.append("")
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
