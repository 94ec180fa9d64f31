"""The `jaxspec` command.

    jaxspec generate  speculative (or plain) generation with a target and an EAGLE-3 drafter
    jaxspec predict   load a target and print its next-token predictions for a prompt of token ids
    jaxspec tune      sweep the draft depth, time each phase, model the trade-off and recommend k
    jaxspec train-drafter  train an EAGLE-3 drafter on the target's own responses (exports SGLang format)
    jaxspec serve     OpenAI-compatible HTTP server (continuous batching, speculative decoding, /metrics)
    jaxspec inspect   compile one decode/verify step (abstract weights: nothing allocated) and report its
                      collectives and per-device memory

Process-wide settings (simulated CPU devices, collective presets) must be made before JAX starts its backend,
so they are global options handled before anything touches a device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF-layout checkpoint directory (config.json + safetensors)")
    p.add_argument("--preset", default=None, help="a named config instead of --model: tiny, tiny-dsv3, kimi-k2.5")
    p.add_argument("--mesh", default=None, help="mesh shape DATAxMODEL, e.g. 1x8 (default: all devices on MODEL)")
    p.add_argument(
        "--devices",
        default=None,
        metavar="SPEC",
        help="use a subset of the devices for the mesh: a count (4 = the first four), ids (0,2,4,6) or a range (4-7)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="compute dtype (default: bfloat16; float32 for the bundled pair, which CPUs run faster in float32)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="EAGLE-3 speculative decoding for Kimi-K2.5 in JAX.")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        metavar="N",
        help="simulate N CPU devices (try meshes without accelerators; sets PJRT_NPROC too)",
    )
    p.add_argument(
        "--collective-preset",
        default="default",
        metavar="NAME",
        help="XLA collective preset applied before JAX starts: default, gpu-latency, gpu-throughput, "
        "tpu-async, cpu-sim (see sharding/collectives.py)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser(
        "predict",
        help="print next-token predictions of a target for a prompt of token ids",
        description="Load a target (--model DIR, or random weights of --preset, default tiny) "
        "and print the top next-token candidates after each prompt position.",
    )
    _add_target_args(pr)
    pr.add_argument("--prompt", default="1,17,42,7,99", help="comma-separated token ids (default: %(default)s)")
    pr.add_argument("--top", type=int, default=5, help="candidates per position (default: %(default)s)")

    gen = sub.add_parser(
        "generate",
        help="speculative (or plain) generation; prints text and statistics",
        description="Generate with EAGLE-3 speculative decoding. --prompt is text (needs a tokenizer: tiktoken.model "
        "or tokenizer.json in --tokenizer, default the --model directory) or comma-separated token ids with --ids. "
        "With neither --model nor --preset it runs the bundled trained pair (assets/kimi-py-tiny) on a held-out "
        "prompt and also measures plain decoding, printing the text, acceptance statistics and the speedup.",
    )
    _add_target_args(gen)
    gen.add_argument(
        "--drafter",
        help="EAGLE-3 drafter directory (SGLang or speculators format); with --preset and no --drafter a random "
        "drafter is used (it accepts ~nothing)",
    )
    gen.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeat for a batch; default with the bundled pair: a held-out one)"
    )
    gen.add_argument("--ids", action="store_true", help="prompts are comma-separated token ids, not text")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    gen.add_argument(
        "--num-steps",
        default="3",
        help="draft tokens per cycle, 0 = plain, or 'auto' = the recommended_k of --tune DIR/tune.json "
        "(written by 'jaxspec tune') (default: %(default)s)",
    )
    gen.add_argument("--tune", type=Path, help="directory holding tune.json from 'jaxspec tune' (for --num-steps auto)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (%(default)s)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless speculative sampling (%(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (%(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0 = off (%(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (%(default)s)")
    gen.add_argument("--stats", action="store_true", help="print acceptance statistics (on for the bundled pair)")
    gen.add_argument(
        "--compare-plain",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run plain decoding (both compiled first, then timed) and print the measured speedup "
        "(default: on for the bundled pair)",
    )
    gen.add_argument("--stream", action="store_true", help="print text as cycles complete")

    from jaxspec.profiling.tune import add_tune_arguments

    tune = sub.add_parser(
        "tune",
        help="sweep the draft depth k, time every phase, fit the cost model and recommend k",
        description="Run the real loop for k = 0..K on a prompt set, time each phase alone, predict tokens/s with "
        "the step-count cost model, and write DIR/tune.json and DIR/tune.png.",
    )
    add_tune_arguments(tune)

    from jaxspec.training.cli import add_train_arguments

    train = sub.add_parser(
        "train-drafter",
        help="train an EAGLE-3 drafter for a target (optax, Orbax checkpoints, resumable); exports SGLang format",
        description="Generate the target's own responses to --prompts (or reuse --data), then train an EAGLE-3 "
        "drafter with the training-time-test unroll and export it to --out.",
    )
    add_train_arguments(train)

    from jaxspec.serving.cli import add_serve_arguments

    add_serve_arguments(
        sub.add_parser(
            "serve",
            help="OpenAI-compatible HTTP server: continuous batching with speculative decoding",
            description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
        )
    )

    ins = sub.add_parser(
        "inspect",
        help="collectives and per-device memory of a compiled decode/verify step",
        description="Compile one cached step of a target config on a mesh with abstract weights "
        "and report collectives (counted per execution) and per-device memory.",
    )
    _add_target_args(ins)
    ins.add_argument("--batch", type=int, default=1, help="sequences per step (default: %(default)s)")
    ins.add_argument(
        "--tokens", type=int, default=1, help="query tokens per step: 1 = decode, k+1 = verify (default: %(default)s)"
    )
    ins.add_argument("--cache-len", type=int, default=4096, help="KV cache positions (default: %(default)s)")
    ins.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    return p


class UsageError(SystemExit):
    """A bad argument or input file, reported as one argparse-style line (no traceback)."""

    def __init__(self, command: str, message: str):
        super().__init__(f"jaxspec {command}: error: {message}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.config import ConfigError
    from jaxspec.io import CheckpointError
    from sharding.collectives import PRESETS, apply_preset, describe

    if args.collective_preset not in PRESETS:
        valid = ", ".join(sorted(PRESETS))
        raise UsageError(
            args.command, f"--collective-preset: unknown collective preset {args.collective_preset!r} (valid: {valid})"
        )
    if args.command in ("generate", "predict", "inspect"):
        check_args(args)  # everything checkable without loading a model, before anything loads
    applied = apply_preset(args.collective_preset)
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    args.preset_record = describe(applied["preset"])
    if args.command == "tune":
        from jaxspec.profiling.tune import cmd_tune

        return cmd_tune(args)
    if args.command == "serve":
        from jaxspec.serving.cli import cmd_serve

        return cmd_serve(args)
    if args.command == "train-drafter":
        from jaxspec.training.cli import cmd_train_drafter

        return cmd_train_drafter(args)
    try:
        return {"generate": cmd_generate, "predict": cmd_predict, "inspect": cmd_inspect}[args.command](args)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:  # bad input files: one line, not a traceback
        raise UsageError(args.command, str(e)) from None


def check_args(args) -> None:
    """Argument checks for generate / predict / inspect that need no model: raise UsageError on the first problem."""
    cmd = args.command

    def fail(message: str):
        raise UsageError(cmd, message)

    if args.model and args.preset:
        fail("give --model or --preset, not both")
    if args.model:
        model = Path(args.model)
        if not model.is_dir():
            fail(f"--model: {model} is not a directory")
        if not (model / "config.json").is_file():
            fail(f"--model: {model} holds no config.json")
    if args.preset:
        from jaxspec.config import PRESETS

        if args.preset not in PRESETS:
            fail(f"--preset: unknown preset {args.preset!r} (available: {', '.join(sorted(PRESETS))})")
    if args.mesh is not None:
        from sharding.mesh import parse_shape

        try:
            parse_shape(args.mesh)
        except ValueError as e:
            fail(f"--mesh: {e}")
    if getattr(args, "devices", None) is not None:  # `tune` declares its own target flags, without --devices
        from sharding.mesh import parse_devices

        try:
            parse_devices(args.devices)
        except ValueError as e:
            fail(f"--{e}")
    if cmd == "predict":
        _int_list(args.prompt, "--prompt", fail)
        if args.top < 1:
            fail(f"--top: expected an integer >= 1, got {args.top}")
    elif cmd == "inspect":
        for name in ("batch", "tokens", "cache_len"):
            if getattr(args, name) < 1:
                fail(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    else:
        _check_generate_args(args, fail)


def _int_list(text: str, flag: str, fail) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        fail(f"{flag}: expected comma-separated integers, got {text!r}")
    if min(ids) < 0:
        fail(f"{flag}: token ids must be >= 0, got {text!r}")
    return ids


def _check_generate_args(args, fail) -> None:
    from jaxspec.decoding.generate import MAX_NUM_STEPS

    args.num_steps = _num_steps(args)
    if not 0 <= args.num_steps <= MAX_NUM_STEPS:
        fail(f"--num-steps: expected 0..{MAX_NUM_STEPS} draft tokens per cycle, got {args.num_steps}")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        fail(f"--temperature: expected a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        fail(f"--top-k: expected an integer >= 0 (0 = off), got {args.top_k}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed: expected an integer in [0, 2**32), got {args.seed}")
    bundled = not (args.model or args.preset)
    if not bundled and not args.prompt:
        fail("--prompt is required with --model or --preset")
    if args.ids and args.prompt:
        for p in args.prompt:
            _int_list(p, "--ids --prompt", fail)
    if args.drafter and not Path(args.drafter).is_dir():
        fail(f"--drafter: {args.drafter} is not a directory")
    if args.model and args.num_steps and not args.drafter:
        fail("--num-steps > 0 with --model needs --drafter (or --num-steps 0)")
    if not bundled and (not args.ids or args.chat):
        tok_dir = args.tokenizer or args.model
        if tok_dir is None:
            fail("text prompts need --tokenizer (or --model with a tokenizer); use --ids for token ids")
        if not Path(tok_dir).is_dir():
            fail(f"--tokenizer: {tok_dir} is not a directory")


def _target(args, *, abstract: bool):
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target, load_target
    from sharding.mesh import make_mesh, select_devices

    if args.model and args.preset:
        raise UsageError(args.command, "give --model or --preset, not both")
    try:
        devices = select_devices(args.devices) if getattr(args, "devices", None) else None
        mesh = make_mesh(args.mesh, devices)
    except ValueError as e:
        raise UsageError(args.command, f"--mesh/--devices: {e}") from None
    dtype = jnp.dtype(args.dtype or "bfloat16")
    if args.model:
        if abstract:
            return Target.abstract(KimiConfig.from_pretrained(args.model), mesh=mesh, dtype=dtype), args.model
        return load_target(args.model, mesh=mesh, dtype=dtype), args.model
    name = args.preset or "tiny"
    cfg = KimiConfig.preset(name)
    if abstract:
        return Target.abstract(cfg, mesh=mesh, dtype=dtype), f"preset {name!r}"
    return Target.random(cfg, mesh=mesh, dtype=dtype), f"preset {name!r} (random weights)"


def _num_steps(args) -> int:
    if args.num_steps != "auto":
        try:
            return int(args.num_steps)
        except ValueError:
            raise UsageError(
                "generate", f"--num-steps: expected an integer or 'auto', got {args.num_steps!r}"
            ) from None
    if args.tune is None or not (args.tune / "tune.json").is_file():
        raise UsageError("generate", "--num-steps auto needs --tune DIR with the tune.json of 'jaxspec tune'")
    return int(json.loads((args.tune / "tune.json").read_text())["recommended_k"])


def use_bundled_pair(args) -> bool:
    """With neither --model nor --preset, point the arguments at the bundled trained pair (target, drafter, float32
    unless --dtype says otherwise) and return True; otherwise leave them alone and return False."""
    if args.model or args.preset:
        return False
    from jaxspec import bundled

    target_dir, drafter_dir = bundled.paths()
    args.model, args.drafter = str(target_dir), args.drafter or str(drafter_dir)
    args.dtype = args.dtype or "float32"
    return True


def cmd_generate(args) -> int:
    from jaxspec.decoding.generate import generate
    from jaxspec.io import load_drafter
    from jaxspec.models.eagle3 import draft_config_for
    from jaxspec.runtime import Drafter
    from jaxspec.tokenizer import load_tokenizer

    if isinstance(args.num_steps, str):  # not yet checked (main() checks it; direct callers may not have)
        args.num_steps = _num_steps(args)
    bundled = use_bundled_pair(args)
    if bundled:
        from jaxspec.bundled import prompts as held_out_prompts

        args.prompt, args.stats = args.prompt or held_out_prompts()[:1], True
    elif not args.prompt:
        raise SystemExit("jaxspec generate: --prompt is required with --model or --preset")
    compare = bundled if args.compare_plain is None else args.compare_plain
    target, source = _target(args, abstract=False)
    drafter = None
    if args.num_steps:
        if args.drafter:
            drafter = load_drafter(args.drafter, target, dtype=target.dtype)
        elif args.model:
            raise SystemExit("jaxspec generate: --num-steps > 0 with --model needs --drafter (or --num-steps 0)")
        else:
            drafter = Drafter.random(draft_config_for(target.config), target, dtype=target.dtype)
    tokenizer = None
    if not args.ids or args.chat:
        tok_dir = args.tokenizer or args.model
        if tok_dir is None:
            raise SystemExit(
                "jaxspec generate: text prompts need --tokenizer (or --model with a tokenizer); use --ids for token ids"
            )
        tokenizer = load_tokenizer(tok_dir)
    if args.ids:
        try:
            prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
        except ValueError:
            raise SystemExit("jaxspec generate: --ids expects comma-separated integers") from None
    else:
        prompts = list(args.prompt)
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]

    stream, finish_stream = _streamer(tokenizer)

    def run(num_steps: int, on_cycles=None):
        return generate(
            target,
            drafter if num_steps else None,
            prompts,
            max_new_tokens=args.max_new_tokens,
            num_steps=num_steps,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            tokenizer=tokenizer,
            on_cycles=on_cycles,
        )

    if bundled:
        print("--- held-out prompt (never trained on) ---\n" + "\n---\n".join(map(str, prompts)))
        print("--- completion ---")
    result = run(args.num_steps, stream if args.stream and len(prompts) == 1 else None)
    timed = None
    if compare and args.num_steps:
        # Both programs are compiled by a first call (the one above for speculative decoding), then timed warm.
        run(0)
        timed = {"speculative": run(args.num_steps).stats, "plain": run(0).stats}
    if args.stream and len(prompts) == 1:
        print(finish_stream())
    else:
        for i, toks in enumerate(result.tokens):
            body = result.text[i] if result.text is not None else ",".join(map(str, toks))
            print(f"[{i}] {body}")
    if args.stats:
        s = result.stats
        print(
            f"target: {source}; drafter: {args.drafter or ('random' if drafter else 'none')}; "
            f"num_steps {s['num_steps']}"
        )
        print(
            f"{s['new_tokens']} new tokens in {s['cycles']} cycles, {s['seconds']:.2f}s "
            f"({s['tokens_per_second']:.1f} tok/s incl. compile on first call; {s['compiles']} compile(s))"
        )
        print(f"mean accepted length (incl. bonus): {s['mean_accepted_length']:.2f}")
        for j, (r, a) in enumerate(zip(s["reached"], s["accepted"], strict=True), start=1):
            print(f"  draft position {j}: reached {r}, accepted {a} ({a / max(r, 1):.1%})")
    if timed is not None:
        spec, plain = timed["speculative"], timed["plain"]
        print(
            f"speculative (k={args.num_steps}) {spec['tokens_per_second']:.1f} tok/s vs plain "
            f"{plain['tokens_per_second']:.1f} tok/s (both compiled, timed on a second run): "
            f"speedup {spec['tokens_per_second'] / plain['tokens_per_second']:.2f}x"
        )
    return 0


def _streamer(tokenizer):
    """(on_cycles callback printing one prompt's new text, finish() -> the held-back rest). Text goes through
    `StreamDecoder`, which holds back a character split across a chunk boundary instead of printing U+FFFD."""
    from jaxspec.tokenizer import StreamDecoder

    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    seen = [0]

    def stream(tokens: list[list[int]]) -> None:
        new, seen[0] = tokens[0][seen[0] :], len(tokens[0])
        if decoder is not None:
            text = decoder.push(new)
        else:
            text = "".join(("," if seen[0] - len(new) + i else "") + str(t) for i, t in enumerate(new))
        print(text, end="", flush=True)

    return stream, (lambda: decoder.flush() if decoder is not None else "")


def cmd_predict(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        tokens = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        raise SystemExit(f"jaxspec predict: --prompt expects comma-separated integers, got {args.prompt!r}") from None
    start = time.perf_counter()
    target, source = _target(args, abstract=False)
    logits = np.asarray(target.logits([tokens]).astype(jnp.float32))[0]
    elapsed = time.perf_counter() - start
    cfg = target.config
    print(
        f"target: {source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, "
        f"experts {'INT4' if cfg.quant else (args.dtype or 'bfloat16')}"
    )
    print(f"mesh: {dict(target.mesh.shape)} on {jax.devices()[0].platform}; load + compile + run {elapsed:.1f}s")
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[: args.top]
        print(f"after {tokens[: pos + 1]}: next token candidates " + ", ".join(f"{t} ({row[t]:.2f})" for t in top))
    return 0


def cmd_inspect(args) -> int:
    from sharding import inspect

    target, source = _target(args, abstract=True)
    start = time.perf_counter()
    compiled = target.compile_step(args.batch, args.tokens, args.cache_len)
    seconds = time.perf_counter() - start
    census, memory = inspect.collective_census(compiled), inspect.memory_report(compiled)
    params = inspect.per_device_param_bytes(target.params)
    print(
        f"{source} on mesh {dict(target.mesh.shape)}: batch {args.batch}, {args.tokens} token(s)/step, "
        f"cache {args.cache_len}; compiled in {seconds:.1f}s"
    )
    print(f"parameters per device: {params / 1e9:.2f} GB (4-bit experts counted as 4 bits)")
    print(inspect.format_report(census, memory))
    if args.json:
        report = {
            "source": source,
            "mesh": dict(target.mesh.shape),
            "batch": args.batch,
            "tokens": args.tokens,
            "cache_len": args.cache_len,
            "compile_seconds": seconds,
            "per_device_param_bytes": params,
            "collectives": census,
            "memory": memory,
            "collective_preset": args.preset_record,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
