"""Decode step time against cache BUFFER length at a fixed short LIVE length, before vs after attention over the
live prefix (issue 14 item 3), in one run on the same weights and cache contents.

    python benchmarks/cache_length.py                      # 1 device and 8 simulated devices (1x8), 1k..32k
    python benchmarks/cache_length.py --meshes 1x8 --sizes 1024,32768 --repeats 5

"before" is the attention of commit 88d07ae (full-buffer masked attention, a per-layer slice of the stacked cache
and a full-cache dtype cast), loaded from git history (`git show 88d07ae:jaxspec/models/mla.py` and its kimi.py)
rather than kept as dead code; "after" is the current code. Both run the same random weights on the same random cache
(every position filled, so stale entries past the live length are non-zero) and their logits are compared.

float32 by default: XLA's CPU backend upcasts a bf16 cache update to f32 through the whole buffer (a CPU-only
artifact that hits before and after alike; accelerators update bf16 in place), which would hide what this measures.

Model: a few layers with Kimi-K2.5's attention widths (kv_lora_rank 512 + rope 64 = 576 cached values per token per
layer) and otherwise small, so the cache read dominates the step. Each configuration is compiled and run once (not
timed), then timed over up to --repeats decode steps (at least 3; stopping after --budget seconds): median and
minimum (on the shared 2-core machine other processes interfere; the minimum is the least-disturbed step). Cache bytes
per step are derived from the program's structure: before reads every buffer position of every layer (at least once;
the per-layer slice and the cast move it again), after reads ceil(live / kv_block) blocks per layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BEFORE = "88d07ae"


def load_before_model():
    """The KimiModel class of commit BEFORE (its kimi.py driving its mla.py), accepting and ignoring kv_block."""
    from flax import nnx
    from history import module_at

    module_at(BEFORE, "jaxspec/models/mla.py", "_before_mla")
    replace = {"from jaxspec.models.mla import": "from _before_mla import"}
    kimi = module_at(BEFORE, "jaxspec/models/kimi.py", "_before_kimi", replace=replace)

    class BeforeKimiModel(kimi.KimiModel):
        def __call__(self, *args, kv_block: int | None = None, **kwargs):
            del kv_block  # the old model attends over the whole buffer
            return super().__call__(*args, **kwargs)

    assert issubclass(BeforeKimiModel, nnx.Module)
    return BeforeKimiModel


def bench_config():
    from jaxspec import KimiConfig

    return KimiConfig.preset("tiny").replace(
        hidden_size=256,
        num_hidden_layers=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        max_position_embeddings=1 << 17,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096,16384,32768", help="cache buffer lengths (positions)")
    p.add_argument("--live", type=int, default=64, help="tokens already cached; the step decodes the next one")
    p.add_argument("--meshes", default="1x1,1x8")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget", type=float, default=5.0, help="stop timing a configuration after this many seconds")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output", default="benchmarks/results/cache_length.json")
    p.add_argument(
        "--versions",
        default="before,after",
        help="which to time: 'after' alone re-measures flatness without the old path's minutes-long 32k steps",
    )
    args = p.parse_args()
    from sharding.cpu import simulate_cpu_devices

    simulate_cpu_devices(8)
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxspec import Target
    from jaxspec.models.mla import KV_BLOCK
    from sharding.mesh import make_mesh, parse_shape

    cfg, dtype = bench_config(), jnp.dtype(args.dtype)
    sizes = [int(s) for s in args.sizes.split(",")]
    Before = load_before_model()
    before_graphdef = nnx.split(nnx.eval_shape(lambda: Before(cfg, dtype=dtype, int4_experts=None, rngs=nnx.Rngs(0))))[
        0
    ]
    rng = np.random.default_rng(0)
    host_cache = rng.standard_normal((cfg.num_hidden_layers, 1, max(sizes), cfg.latent_dim)).astype(np.float32)
    host_cache = host_cache.astype(dtype)
    token, pos = np.array([[17]], np.int32), np.array([[args.live]], np.int32)
    rows = []
    for mesh_name in args.meshes.split(","):
        data, model = parse_shape(mesh_name)
        mesh = make_mesh(mesh_name, devices=jax.devices()[: data * model])
        after = Target.random(cfg, mesh=mesh, dtype=dtype, seed=0)
        versions = {"before": dataclasses.replace(after, graphdef=before_graphdef), "after": after}
        versions = {k: v for k, v in versions.items() if k in args.versions.split(",")}
        for S in sizes:
            logits = {}
            for name, target in versions.items():
                step = jax.jit(lambda p, t, q, c, target=target: target.apply(p, t, q, c)[:2], donate_argnums=3)
                sharding = NamedSharding(mesh, target.cache_spec())
                cache = jax.device_put(host_cache[:, :, :S], sharding)
                out, cache = step(target.params, token, pos, cache)  # compile + warm up
                logits[name] = np.asarray(out, np.float32)
                times = []
                while len(times) < args.repeats and (len(times) < 3 or sum(times) < args.budget):
                    t0 = time.perf_counter()
                    out, cache = step(target.params, token, pos, cache)
                    jax.block_until_ready((out, cache))
                    times.append(time.perf_counter() - t0)
                del cache
                live = args.live + 1
                read = S if name == "before" else min(S, -(-live // min(KV_BLOCK, S)) * min(KV_BLOCK, S))
                rows.append(
                    {
                        "mesh": mesh_name,
                        "version": name,
                        "buffer": S,
                        "live": live,
                        "step_ms": 1e3 * statistics.median(times),
                        "step_ms_min": 1e3 * min(times),
                        "steps_timed": len(times),
                        "cache_positions_read_per_layer": read,
                        "cache_bytes_read_per_step_per_device": read
                        * cfg.num_hidden_layers
                        * cfg.latent_dim
                        * dtype.itemsize,
                    }
                )
                print(f"{mesh_name} {name:>6} S={S:>6}: {rows[-1]['step_ms']:8.3f} ms", flush=True)
            if len(logits) == 2:
                err = np.abs(logits["after"] - logits["before"]).max() / logits["before"].std()
                rows[-1]["max_rel_diff_vs_before"] = rows[-2]["max_rel_diff_vs_before"] = float(err)
    write(args, cfg, dtype, sizes, rows, KV_BLOCK, jax)


def write(args, cfg, dtype, sizes, rows, kv_block, jax) -> None:
    def ms(mesh, version, S, key="step_ms"):
        return next(r[key] for r in rows if (r["mesh"], r["version"], r["buffer"]) == (mesh, version, S))

    summary = {}
    for mesh in args.meshes.split(","):
        for version in args.versions.split(","):
            for key in ("step_ms", "step_ms_min"):
                t = [ms(mesh, version, S, key) for S in sizes]
                summary[f"{mesh} {version} ({key}): step at {sizes[-1]} / step at {sizes[0]}"] = t[-1] / t[0]
    command = "python benchmarks/cache_length.py " + " ".join(sys.argv[1:])
    out = {
        "command": command.strip(),
        "before": f"{BEFORE} (git show {BEFORE}:jaxspec/models/mla.py + kimi.py)",
        "config": {
            "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "latent_dim": cfg.latent_dim,
            "dtype": str(dtype),
            "batch": 1,
            "kv_block": kv_block,
        },
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "repeats": args.repeats,
        "rows": rows,
        "summary": summary,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    lines = [
        "# Decode step time vs cache buffer length (live length fixed)",
        "",
        f"`{out['command']}` on {out['platform']}, jax {out['jax']}, {out['measured_at']}. "
        f"{cfg.num_hidden_layers} layers, {cfg.latent_dim} cached values per token per layer, {dtype}, batch 1, "
        f"kv_block {kv_block}; up to {args.repeats} steps timed per row (at least 3, stopping after {args.budget} s). "
        "Bytes: cache read per step per device, by structure.",
        "",
        "| mesh | buffer | before ms (median / min) | after ms (median / min) | before / after (median) |"
        " cache bytes before | cache bytes after | max rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mesh in args.meshes.split(","):
        for S in sizes:
            b, a = (
                next((r for r in rows if (r["mesh"], r["version"], r["buffer"]) == (mesh, v, S)), None)
                for v in ("before", "after")
            )
            times = lambda r: "-" if r is None else f"{r['step_ms']:.2f} / {r['step_ms_min']:.2f}"
            nbytes = lambda r: "-" if r is None else f"{r['cache_bytes_read_per_step_per_device']:,}"
            ratio = "-" if a is None or b is None else f"{b['step_ms'] / a['step_ms']:.2f}"
            diff = "-" if a is None or "max_rel_diff_vs_before" not in a else f"{a['max_rel_diff_vs_before']:.1e}"
            lines.append(f"| {mesh} | {S} | {times(b)} | {times(a)} | {ratio} | {nbytes(b)} | {nbytes(a)} | {diff} |")
    lines += ["", *(f"- {k}: {v:.2f}" for k, v in summary.items()), ""]
    path.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
