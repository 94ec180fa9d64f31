"""From the published Kimi-K2.5 checkpoint to a tuned speculative deployment on one host with 8 accelerators.

    python demos/multi_gpu.py --src Kimi-K2.5/ --dst kimi-k25-jax/ --drafter kimi-k2.5-eagle3/ \\
        --prompt "Write a function that merges two sorted lists." --chat
    python demos/multi_gpu.py --dry-run             # the same steps on the bundled pair (8 simulated CPU devices
                                                    # when there is no accelerator)
    python demos/multi_gpu.py --dry-run abstract    # the real Kimi-K2.5 config with abstract weights: plan, compile
                                                    # a decode and a verify step, report collectives and memory

Steps, each printed as it runs:
  1. platform and collective preset: XLA flags (and NCCL / libtpu settings) are read once, when JAX starts its
     backend, so the preset is applied before anything touches a device (`sharding/collectives.py`);
  2. plan: the target's config on the mesh with abstract weights (nothing allocated): the mesh must divide heads,
     experts, vocabulary and MLP widths; parameter bytes per device (INT4 experts at 4 bits) and KV cache per token;
  3. convert the HF checkpoint to an Orbax checkpoint (`jaxspec-convert target`): streamed one layer at a time,
     resumable (rerun after an interruption), skipped when DST already holds a complete conversion;
  4. restore the target on the mesh (each device reads only its own slices) and load the EAGLE-3 drafter;
  5. tune the draft depth: sweep k = 0..MAX_K (and with --trees, draft trees) on the prompts, time each phase, fit
     the cost model, write DST/tune/tune.json and tune.png, and take the recommendation (`jaxspec tune`);
  6. generate with it and print the text and acceptance statistics.

The same program runs on 8 GPUs, a TPU slice with 8 devices, or 8 simulated CPU devices. Several hosts (a TPU v5p-16,
GPU nodes) run it once per host with jaxspec's global flags (`--coordinator HOST:PORT --num-processes N --process-id I`,
or `--distributed` to read the cluster from the environment); see docs/multi-host.md. Process 0 prints and writes;
convert with `jaxspec-convert target` first (one process), since step 3 then only checks DST.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from a checkout: make the repository's packages importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PRESET_FOR_PLATFORM = {"gpu": "gpu-latency", "tpu": "tpu-async", "cpu": "cpu-sim"}
# XLA's CPU backend converts bf16 weights to f32 and hoists that convert for whole layer stacks out of the layer
# scan; accelerators have bf16 dots and no such convert. The abstract dry-run disables that one CPU pass so its
# memory figures describe the program (see benchmarks/kimi_k25_mesh.py).
CPU_LICM_OFF = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="demos/multi_gpu.py",
        description="Convert Kimi-K2.5, restore it on an 8-device mesh, choose a collective preset, tune the draft\n"
        "depth k and generate with EAGLE-3 speculative decoding. Each step is printed as it runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python demos/multi_gpu.py --src Kimi-K2.5/ --dst kimi-k25-jax/ --drafter kimi-k2.5-eagle3/ "
        '--prompt "def quicksort(xs):"\n'
        "  python demos/multi_gpu.py --dry-run            # rehearse every step on the bundled pair\n"
        "  python demos/multi_gpu.py --dry-run abstract   # real Kimi-K2.5 shapes, nothing allocated",
    )
    p.add_argument(
        "--dry-run",
        nargs="?",
        const="pair",
        choices=["pair", "abstract"],
        help="'pair' (default): run every step on the bundled pair (converted into a temporary directory unless "
        "--dst is given); 'abstract': the real Kimi-K2.5 config (or --src's config.json) with abstract weights: plan, "
        "compile one decode and one verify step, report collectives and memory per device",
    )
    src = p.add_argument_group("checkpoints")
    src.add_argument("--src", type=Path, help="published HF checkpoint directory (config.json + safetensors)")
    src.add_argument("--dst", type=Path, help="Orbax output directory of the conversion (and DST/tune/)")
    src.add_argument("--drafter", type=Path, help="EAGLE-3 drafter directory (SGLang/SpecForge or speculators)")
    src.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --src)")
    src.add_argument("--verify", action="store_true", help="after converting, re-read sample tensors and compare")
    dev = p.add_argument_group("devices")
    dev.add_argument(
        "--platform",
        default="auto",
        choices=["auto", "gpu", "tpu", "cpu"],
        help="auto: ask JAX in a separate process (the backend must not start in this one before the preset is "
        "applied)",
    )
    dev.add_argument("--mesh", default="1x8", help="mesh DATAxMODEL (default: %(default)s, all 8 on the model axis)")
    dev.add_argument(
        "--collective-preset",
        default="auto",
        metavar="NAME",
        help="auto (gpu -> gpu-latency, tpu -> tpu-async, cpu -> cpu-sim), or any preset of sharding/collectives.py: "
        "default, gpu-latency, gpu-throughput, tpu-async, cpu-sim",
    )
    dev.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 (float32 for a CPU dry run)")
    gen = p.add_argument_group("tuning and generation")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default with --dry-run: one "
                     "held-out prompt of the bundled pair")  # fmt: skip
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    gen.add_argument("--tune-prompts", type=Path, help="text prompts for tuning, one per line (default: --prompt)")
    gen.add_argument("--max-k", type=int, help="sweep k = 0..MAX_K (default 6; 2 with --dry-run)")
    gen.add_argument("--num-steps", type=int, help="skip tuning and generate with this k")
    gen.add_argument("--trees", help="also tune draft trees: STEPS:TOPK:TOKENS,... or 'default' (see jaxspec tune)")
    gen.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 128; 32 with --dry-run)")
    gen.add_argument("--cache-len", type=int, default=4096, help="--dry-run abstract: cache length (%(default)s)")
    from jaxspec.cli.args import add_distributed_args

    add_distributed_args(p.add_argument_group("several processes (one per host)"))
    return p


def step(n: int | str, text: str) -> None:
    print(f"\n[{n}] {text}", flush=True)


def size(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def detect_platform() -> str:
    """jax.default_backend() of a fresh process, so this one's backend starts only after the preset is applied."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},  # do not grab GPU memory just to look
    )
    if probe.returncode != 0:
        raise SystemExit(f"multi_gpu: could not start JAX to detect the platform:\n{probe.stderr[-2000:]}")
    return probe.stdout.split()[-1]


def setup_devices(args) -> tuple[str, dict]:
    """Step 1: platform, collective preset, simulated CPU devices; returns (platform, preset record)."""
    from sharding.collectives import PRESETS, apply_preset, describe
    from sharding.mesh import parse_shape

    step(1, "platform and collective preset")
    platform = detect_platform() if args.platform == "auto" else args.platform
    data, model = parse_shape(args.mesh)
    name = PRESET_FOR_PLATFORM.get(platform, "default") if args.collective_preset == "auto" else args.collective_preset
    if platform == "cpu" and args.dry_run == "abstract":
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_LICM_OFF}".strip()
    applied = apply_preset(name)
    if platform == "cpu":
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(data * model // (args.num_processes or 1))  # each process holds its share
    from jaxspec.cli.args import join_distributed

    args.leader = join_distributed(args)
    if not args.leader:  # every process computes; process 0 alone prints
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the run)
    import jax

    print(f"platform {platform}: {jax.device_count()} device(s) ({jax.devices()[0].device_kind})")
    print(f"collective preset {name!r}: {PRESETS[name].description}")
    for key, values in applied["added"].items():
        print(f"  {key} += {' '.join(values)}")
    for key, values in applied["kept_user"].items():
        print(f"  {key}: kept your {' '.join(values)} over the preset's")
    return platform, describe(name)


def plan(cfg, mesh, dtype) -> None:
    """Step 2: check the config against the mesh and report the per-device footprint (abstract: no allocation)."""
    import jax.numpy as jnp

    from jaxspec import Target
    from sharding.inspect import per_device_param_bytes

    step(2, f"plan: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts on mesh {dict(mesh.shape)}")
    target = Target.abstract(cfg, mesh=mesh, dtype=dtype)  # raises if the mesh does not divide the model
    params = per_device_param_bytes(target.params)
    kv_token = cfg.num_hidden_layers * cfg.latent_dim * jnp.dtype(dtype).itemsize
    line = f"parameters per device: {size(params)} (INT4 experts: {cfg.quant is not None})"
    stats = mesh.devices.flat[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - params
        line += f"; device memory {size(stats['bytes_limit'])}, ~{size(max(free, 0))} left"
        line += f" = ~{max(free, 0) // kv_token:,} cached tokens before activations"
    print(line)
    print(f"latent KV cache: {kv_token / 1024:.1f} KiB per token (all layers, replicated on every device)")


def convert(src: Path, dst: Path, dtype: str, verify: bool) -> None:
    """Step 3: HF -> Orbax, streamed and resumable; a complete DST is reused."""
    from converters.target import convert_target
    from jaxspec.io.orbax import MARKER

    step(3, f"convert {src} -> {dst}")
    if (dst / MARKER).is_file():
        print(f"{dst} holds a complete conversion ({MARKER}); reusing it")
        return
    import jax

    if jax.process_count() > 1:
        raise SystemExit(
            f"multi_gpu: {dst} holds no complete conversion: run `jaxspec-convert target` first (one process)"
        )
    start = time.perf_counter()
    r = convert_target(src, dst, dtype=dtype, verify=verify)
    print(
        f"wrote {len(r.written)} group(s) ({size(r.bytes_written)}) in {time.perf_counter() - start:.0f}s; "
        f"{len(r.skipped)} already complete from an earlier run; skipped {r.skipped_vision} vision and "
        f"{r.skipped_mtp} MTP tensor(s)" + (f"; verified {', '.join(r.verified)}" if verify else "")
    )


def restore(dst: Path, drafter_dir: Path, mesh, dtype):
    """Step 4: the converted target on the mesh, and the drafter on the target's mesh."""
    from jaxspec import load_drafter, load_target
    from sharding.inspect import per_device_param_bytes

    step(4, f"restore the target on mesh {dict(mesh.shape)} and load the drafter")
    start = time.perf_counter()
    target = load_target(dst, mesh=mesh, dtype=dtype)
    drafter = load_drafter(drafter_dir, target, dtype=dtype)
    print(
        f"restored in {time.perf_counter() - start:.1f}s: {size(per_device_param_bytes(target.params))} of target "
        f"weights per device; drafter captures target layers {list(drafter.capture_layers)}, draft "
        f"vocabulary {drafter.config.draft_vocab_size}"
    )
    return target, drafter


def choose_k(args, target, drafter, prompts: list[list[int]], out: Path, preset: dict):
    """Step 5: sweep k (and --trees) and return the recommended DraftShape (or --num-steps' chain)."""
    from jaxspec.decoding import DraftShape
    from jaxspec.profiling.tune import parse_trees, report_rows, row_shape, tune

    if args.num_steps is not None:
        step(5, f"tuning skipped: --num-steps {args.num_steps}")
        return DraftShape(args.num_steps)
    trees = parse_trees(args.trees) if args.trees else []
    also = f" and {len(trees)} tree shape(s)" if trees else ""
    step(5, f"tune k = 0..{args.max_k}{also} on {len(prompts)} prompt(s), {args.max_new_tokens} new tokens each")
    report = tune(
        target,
        drafter,
        prompts,
        [*range(0, args.max_k + 1), *trees],
        max_new_tokens=args.max_new_tokens,
        output_dir=out if args.leader else None,  # every process measures; process 0 writes
        collective_preset=preset,
        repeats=1 if args.dry_run else 3,
    )
    rows = {row_shape(r): r for r in report_rows(report)}
    best = DraftShape.from_dict(report["recommended"])
    measured, plain = rows[best]["measured_tok_s"], rows[DraftShape(0)]["measured_tok_s"]
    print(
        f"recommended {best.label}: measured {measured:.1f} tok/s vs {plain:.1f} plain ({measured / plain:.2f}x); "
        f"wrote {out}/tune.json, tune.png"
    )
    return best


def generate_text(args, target, drafter, prompts: list[list[int]], tokenizer, draft) -> None:
    """Step 6: generate with the chosen DraftShape and print the text and acceptance statistics."""
    from jaxspec import generate

    step(6, f"generate with {draft.label}")
    kwargs = dict(tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, draft=draft)
    use = None if draft.plain else drafter
    generate(target, use, prompts, **kwargs)  # compile (shapes are bucketed)
    result = generate(target, use, prompts, **kwargs)
    for i, text in enumerate(result.text):
        print(f"--- [{i}]\n{tokenizer.decode(prompts[i])}{text}")
    s = result.stats
    print(
        f"---\n{s['new_tokens']} tokens in {s['cycles']} cycles, {s['seconds']:.2f}s ({s['tokens_per_second']:.1f} "
        f"tok/s, {s['compiles']} compile(s)); mean accepted length {s['mean_accepted_length']:.2f}"
    )
    for j, (r, a) in enumerate(zip(s["reached"], s["accepted"], strict=True), start=1):
        print(f"  draft {'depth' if draft.tree else 'position'} {j}: reached {r}, accepted {a} ({a / max(r, 1):.0%})")


def run_abstract(args, preset: dict) -> int:
    """--dry-run abstract: the real config on the mesh with abstract weights; compile decode, verify and tree verify
    steps."""
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target
    from sharding import inspect
    from sharding.mesh import make_mesh

    cfg = KimiConfig.from_pretrained(args.src) if args.src else KimiConfig.preset("kimi-k2.5")
    mesh, dtype = make_mesh(args.mesh), jnp.dtype(args.dtype or "bfloat16")
    plan(cfg, mesh, dtype)
    step(3, "convert, restore: skipped (abstract weights: shapes, dtypes and shardings only)")
    target = Target.abstract(cfg, mesh=mesh, dtype=dtype)
    k = args.num_steps if args.num_steps is not None else 3
    steps = (("decode", 1, False), (f"verify k={k}", k + 1, False), ("tree verify (16 nodes)", 16, True))
    for n, (name, tokens, tree) in enumerate(steps, start=4):
        step(n, f"compile one {name} step: batch 1, {tokens} token(s), cache {args.cache_len}")
        start = time.perf_counter()
        compiled = target.compile_step(1, tokens, args.cache_len, tree=tree)
        print(f"compiled in {time.perf_counter() - start:.1f}s (preset {preset['name']!r})")
        print(inspect.format_report(inspect.collective_census(compiled), inspect.memory_report(compiled)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.cli.args import check_distributed_args

    check_distributed_args(args, lambda message: sys.exit(f"multi_gpu: {message}"))
    if args.dry_run is None and not (args.src and args.dst and args.drafter and (args.prompt or args.tune_prompts)):
        raise SystemExit("multi_gpu: give --src, --dst, --drafter and --prompt (or --dry-run to rehearse)")
    args.max_k = args.max_k if args.max_k is not None else (2 if args.dry_run else 6)
    args.max_new_tokens = args.max_new_tokens or (32 if args.dry_run else 128)
    if args.max_k < 0 or (args.num_steps is not None and args.num_steps < 0):
        raise SystemExit("multi_gpu: --max-k and --num-steps must be >= 0")
    platform, preset = setup_devices(args)
    if args.dry_run == "abstract":
        return run_abstract(args, preset)

    import jax.numpy as jnp

    from jaxspec import KimiConfig
    from jaxspec.tokenizer import load_tokenizer
    from sharding.mesh import make_mesh

    tmp = None
    if args.dry_run:
        from jaxspec import bundled

        args.src, args.drafter = bundled.paths()
        args.prompt = args.prompt or bundled.prompts()[:1]
        if args.dst is None:
            tmp = tempfile.TemporaryDirectory(prefix="jaxspec-dry-run-")
            args.dst = Path(tmp.name) / "converted"
            print(f"dry run: converting into {args.dst}, removed at exit (pass --dst DIR to keep it)")
    dtype_name = args.dtype or ("float32" if args.dry_run and platform == "cpu" else "bfloat16")
    mesh, dtype = make_mesh(args.mesh), jnp.dtype(dtype_name)

    tokenizer = load_tokenizer(args.tokenizer or args.src)

    def encode(text: str) -> list[int]:
        return (
            tokenizer.apply_chat_template([{"role": "user", "content": text}]) if args.chat else tokenizer.encode(text)
        )

    prompts = [encode(p) for p in args.prompt or []]
    tune_texts = [t for t in args.tune_prompts.read_text().splitlines() if t.strip()] if args.tune_prompts else None
    tune_prompts = [encode(t) for t in tune_texts] if tune_texts else prompts
    try:
        plan(KimiConfig.from_pretrained(args.src), mesh, dtype)
        convert(args.src, args.dst, dtype_name, args.verify)
        target, drafter = restore(args.dst, args.drafter, mesh, dtype)
        draft = choose_k(args, target, drafter, tune_prompts, args.dst / "tune", preset)
        if prompts:
            generate_text(args, target, drafter, prompts, tokenizer, draft)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print("\ndone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
