"""`jaxspec serve`: load a target + drafter (default: the bundled pair), compile the engine, serve HTTP with uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from jaxspec.cli.args import (
    add_drafter_arg,
    add_dtype_arg,
    add_kv_cache_dtype_arg,
    add_mesh_arg,
    add_model_arg,
    add_num_steps_args,
    add_tree_args,
    auto_num_steps,
    use_bundled_pair,
)

log = logging.getLogger("jaxspec.serving")
HELP = "OpenAI-compatible HTTP server: continuous batching with speculative decoding"
DESCRIPTION = "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "target checkpoint directory (default: the bundled pair, assets/kimi-py-tiny)")
    add_drafter_arg(p, "EAGLE-3 drafter directory (default with the bundled pair: its drafter)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    add_num_steps_args(
        p,
        default="auto",
        auto_help="the configuration --tune DIR/tune.json recommends (a tree sets --topk and --num-draft-tokens "
        "too, unless given), for the bundled pair its committed tuning result",
    )
    add_tree_args(p)
    p.add_argument("--max-batch", type=int, default=8, help="slots: the batch of the compiled loop (%(default)s)")
    p.add_argument(
        "--max-context",
        type=int,
        default=1024,
        help="positions per slot: prompt + max_tokens + k + 2, for a tree + its draft tokens + 1 (%(default)s)",
    )
    p.add_argument(
        "--batch-buckets",
        default="",
        help="comma-separated segment batch sizes to compile (default: powers of two up to --max-batch)",
    )
    p.add_argument(
        "--context-buckets",
        default="",
        help="comma-separated segment context sizes to compile (default: powers of two from 256 up to --max-context)",
    )
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per prefill call (%(default)s)")
    p.add_argument("--segment-cycles", type=int, default=4, help="cycles between admissions (%(default)s)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="(%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(%(default)s)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model directory's name)")
    p.add_argument(
        "--chat-format",
        default="auto",
        choices=["auto", "kimi", "plain"],
        help="auto: Kimi's chat template when the vocabulary has its tokens, else plain 'role: content' lines",
    )
    add_mesh_arg(p, "mesh shape 1xMODEL (default: one device)")
    add_dtype_arg(p, help="(default: float32 for the bundled pair, else bfloat16)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _num_steps(args, bundled: bool) -> int:
    if args.num_steps != "auto":
        try:
            return int(args.num_steps)
        except ValueError:
            raise SystemExit(
                f"jaxspec serve: --num-steps expects an integer or 'auto', got {args.num_steps!r}"
            ) from None
    if args.tune is not None:
        path = args.tune / "tune.json"
    elif bundled:
        from jaxspec.bundled import ROOT

        path = ROOT.parent.parent / "benchmarks" / "results" / "tune_bundled" / "tune.json"
    else:
        raise SystemExit("jaxspec serve: --num-steps auto needs --tune DIR (the output of 'jaxspec tune')")
    if not path.is_file():
        raise SystemExit(f"jaxspec serve: --num-steps auto: {path} not found (run 'jaxspec tune')")
    k = auto_num_steps(args, path)
    tree = f", topk {args.topk}, {args.num_draft_tokens} draft tokens" if args.topk > 1 else ""
    log.info("--num-steps auto: k = %d%s (the recommendation of %s)", k, tree, path)
    return k


def run(args: argparse.Namespace) -> int:
    """Load the pair, compile the engine (warm-up), then serve until interrupted."""
    import jax.numpy as jnp
    import uvicorn

    from jaxspec.io import load_drafter, load_target
    from jaxspec.serving.app import create_app
    from jaxspec.serving.engine import Engine
    from jaxspec.serving.metrics import Metrics
    from jaxspec.tokenizer import load_tokenizer
    from sharding.mesh import make_mesh

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    bundled = use_bundled_pair(args)
    num_steps = _num_steps(args, bundled)
    if num_steps and not args.drafter:
        raise SystemExit("jaxspec serve: --num-steps > 0 needs --drafter (or --num-steps 0)")
    config = _engine_config(args, num_steps)
    dtype = jnp.dtype(args.dtype or "bfloat16")
    log.info("loading %s (%s)", args.model, dtype)
    mesh = make_mesh(args.mesh) if args.mesh else None
    target = load_target(args.model, mesh=mesh, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype)
    drafter = load_drafter(args.drafter, target, dtype=dtype) if num_steps else None
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    metrics = Metrics(num_steps, config.max_batch, topk=config.topk, verify_tokens=config.verify_tokens)
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids, metrics=metrics)
    engine.warmup(log.info)
    name = args.served_model_name or ("kimi-py-tiny" if bundled else Path(args.model).resolve().name)
    app = create_app(engine, tokenizer, name, chat_format=args.chat_format)
    log.info("serving %s on http://%s:%d (k = %d)", name, args.host, args.port, num_steps)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=60)
    return 0


def _engine_config(args: argparse.Namespace, num_steps: int):
    """The engine settings of the flags (errors as one line naming the problem)."""
    from jaxspec.serving.engine import EngineConfig

    try:
        return EngineConfig(
            max_batch=args.max_batch,
            max_context=args.max_context,
            num_steps=num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
            prefill_chunk=args.prefill_chunk,
            segment_cycles=args.segment_cycles,
            max_queue=args.max_queue,
            batch_buckets=tuple(int(b) for b in args.batch_buckets.split(",") if b.strip()),
            context_buckets=tuple(int(s) for s in args.context_buckets.split(",") if s.strip()),
        )
    except ValueError as e:  # also a --batch-buckets or --context-buckets entry that is not an integer
        raise SystemExit(f"jaxspec serve: {e}") from None
