"""Analytic table: weight and cache bytes one step of the real Kimi-K2.5 reads per device, before vs after.

    python benchmarks/full_size_bytes.py [--mesh 1x8] [--cache-len 4096] [--live 100]

Derived from the program's structure, nothing allocated: parameter bytes per device come from the abstract
target's shardings (`Target.abstract`, int4 as 4 bits); routed experts are read per expert. "before" is the
routed-expert path of commit 88d07ae: min(E_local, M*K) experts per layer rounded up to whole chunks of 8, each
read whole. "after" reads exactly the distinct local experts hit; under uniform routing a local expert is hit by
one of M tokens with probability 1 - (1 - K/E)^M. Cache: the MLA latent cache [L, B, S, C+R] is read over the whole
buffer S (attention over the live prefix is issue 14 item 3, another branch; its row uses the live length).
The floor is non-expert weights + hit experts (+ the live cache).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sharding.cpu import simulate_cpu_devices

BEFORE_CHUNK = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="1x8")
    p.add_argument("--cache-len", type=int, default=4096, help="cache buffer positions S")
    p.add_argument("--live", type=int, default=100, help="live context length (positions in use)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--output", default="benchmarks/results/full_size_bytes.json")
    args = p.parse_args()
    simulate_cpu_devices(8)
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec import KimiConfig, Target
    from sharding import inspect
    from sharding.mesh import MODEL, make_mesh

    cfg = KimiConfig.preset("kimi-k2.5")
    mesh = make_mesh(args.mesh)
    target = Target.abstract(cfg, mesh=mesh, dtype=jnp.bfloat16)
    n_dev = mesh.shape[MODEL]
    per_device = max(inspect.device_param_bytes(target.params).values())
    expert_stack = sum(
        inspect.param_bytes(var.get_value())
        for path, var in nnx.to_flat_state(target.params)
        if path[0] == "moe_layers" and path[-2] == "mlp" and path[-1] in ("gate", "up", "down")
    )
    L, E, K = cfg.num_moe_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = expert_stack / (L * E)  # packed INT4 + bf16 scales of gate, up and down
    non_expert = per_device - expert_stack / n_dev
    E_local = E // n_dev
    cache_row = cfg.num_hidden_layers * args.batch * cfg.latent_dim * 2  # bf16 bytes per cache position
    rows = []
    for name, T in (("decode", 1), ("verify", 4)):
        M = args.batch * T
        hit = E_local * (1 - (1 - K / E) ** M)
        before = -(-min(E_local, M * K) // min(BEFORE_CHUNK, E_local)) * min(BEFORE_CHUNK, E_local)
        row = dict(
            step=name,
            tokens=T,
            experts_read_per_layer_before=before,
            experts_hit_per_layer=hit,
            weight_bytes_before=non_expert + L * before * per_expert,
            weight_bytes_after=non_expert + L * hit * per_expert,
            cache_bytes_whole_buffer=cache_row * args.cache_len,
            cache_bytes_live=cache_row * args.live,
        )
        row["floor_bytes"] = row["weight_bytes_after"] + row["cache_bytes_live"]
        rows.append(row)
    for key in ("weight_bytes_before", "weight_bytes_after", "floor_bytes"):
        rows[1][f"verify_over_decode_{key}"] = rows[1][key] / rows[0][key]
    result = dict(
        command=f"python benchmarks/full_size_bytes.py --mesh {args.mesh} --cache-len {args.cache_len} "
        f"--live {args.live} --batch {args.batch}",
        per_device_param_bytes=per_device,
        non_expert_bytes_per_device=non_expert,
        bytes_per_expert=per_expert,
        experts_per_device=E_local,
        steps=rows,
    )
    Path(args.output).write_text(json.dumps(result, indent=1))
    md = [
        f"# Kimi-K2.5 on {args.mesh}: bytes one step reads per device (batch {args.batch})",
        "",
        f"`{result['command']}`",
        "",
        f"Non-expert weights {non_expert / 1e9:.2f} GB/device; one routed expert {per_expert / 1e6:.1f} MB "
        f"(INT4 + bf16 scales); {E_local} experts/device; latent cache {cache_row / 1e3:.0f} kB per position.",
        "",
        "| step | experts read / layer before | hit / layer (after) | weights before GB | weights after GB | "
        f"cache, whole buffer S={args.cache_len} GB | cache, live {args.live} GB | floor GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['step']} T={r['tokens']} | {r['experts_read_per_layer_before']} | {r['experts_hit_per_layer']:.2f} "
            f"| {r['weight_bytes_before'] / 1e9:.2f} | {r['weight_bytes_after'] / 1e9:.2f} "
            f"| {r['cache_bytes_whole_buffer'] / 1e9:.3f} | {r['cache_bytes_live'] / 1e9:.4f} "
            f"| {r['floor_bytes'] / 1e9:.2f} |"
        )
    v = rows[1]
    md += [
        "",
        f"verify/decode weight bytes: before {v['verify_over_decode_weight_bytes_before']:.2f}x, "
        f"after {v['verify_over_decode_weight_bytes_after']:.2f}x, floor {v['verify_over_decode_floor_bytes']:.2f}x.",
        "",
    ]
    Path(args.output).with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
