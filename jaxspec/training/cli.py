"""`jaxspec train-drafter`: generate the target's responses to a prompt set (or reuse a dataset) and train a drafter.

    jaxspec train-drafter --target DIR --prompts prompts.txt --out OUT [--steps ...]   generate into OUT/data, train
    jaxspec train-drafter --target DIR --data DATA --out OUT                          train on an existing dataset
    jaxspec train-drafter ... --resume                                                 continue both phases

Prompt files: `.jsonl` with one {"prompt": "text"} or {"ids": [token ids]} object per line, or plain text with one
prompt per line (with --ids: comma-separated token ids per line). Text needs the tokenizer of the --target directory
(or --tokenizer DIR). Every argument is checked before the target's weights are loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_DRAFT_VOCAB = 32000


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `jaxspec train-drafter` (register with `sub.add_parser(...)`, dispatch to `cmd_train_drafter`)."""
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory (HF layout or converted)")
    p.add_argument("--mesh", default=None, help="mesh DATAxMODEL; e.g. 8x1 = 8-way data parallel (default 1xN)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="target (and drafter) dtype")
    p.add_argument("--out", type=Path, required=True, help="output directory: checkpoints, logs, the trained drafter")
    data = p.add_argument_group("data")
    data.add_argument("--prompts", type=Path, help="prompt file (.jsonl or one prompt per line) to generate data from")
    data.add_argument("--data", type=Path, help="dataset directory (default with --prompts: OUT/data)")
    data.add_argument("--ids", action="store_true", help="prompt lines are comma-separated token ids")
    data.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    data.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --target)")
    data.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt (%(default)s)")
    data.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the responses")
    data.add_argument("--shard-size", type=int, default=64, help="prompts per generated shard (%(default)s)")
    tr = p.add_argument_group("training")
    tr.add_argument(
        "--draft-vocab", type=int, default=None, help=f"draft vocabulary size (default {DEFAULT_DRAFT_VOCAB})"
    )
    tr.add_argument("--ttt-depth", type=int, default=3, help="training-time-test steps (%(default)s)")
    tr.add_argument("--steps", type=int, default=1000, help="optimizer steps (%(default)s)")
    tr.add_argument("--batch-size", type=int, default=8, help="sequences per step (%(default)s)")
    tr.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the dataset's)")
    tr.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (%(default)s)")
    tr.add_argument("--warmup", type=int, default=None, help="warmup steps (default min(100, steps/10))")
    tr.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (%(default)s)")
    tr.add_argument("--clip", type=float, default=0.5, help="gradient clipping global norm (%(default)s)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the init, data order and sampling (%(default)s)")
    tr.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (%(default)s)")
    tr.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    tr.add_argument("--heads", type=int, default=None, help="drafter attention heads (default: the target's)")
    tr.add_argument("--kv-heads", type=int, default=None, help="drafter KV heads (default heads/8)")
    tr.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    tr.add_argument("--capture-layers", default=None, help="target layer outputs to capture, e.g. 1,29,57")


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"jaxspec train-drafter: {msg}")


def read_prompt_file(path: Path, *, ids: bool) -> list[str | list[int]]:
    """Prompts from a .jsonl file ({"prompt": text} or {"ids": [...]}) or one per line (text, or ids with `ids`)."""
    if not path.is_file():
        raise _fail(f"--prompts: {path} is not a file")
    prompts: list[str | list[int]] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts {path}:{n}"
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(f"{where}: not valid JSON ({e})") from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            elif isinstance(obj, dict) and isinstance(obj.get("ids"), list) and obj["ids"]:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in obj["ids"]):
                    raise _fail(f'{where}: "ids" must be a list of integers')
                prompts.append(list(obj["ids"]))
            else:
                raise _fail(f'{where}: expected {{"prompt": "text"}} or {{"ids": [token ids]}}')
        elif ids:
            try:
                prompts.append([int(t) for t in line.split(",")])
            except ValueError:
                raise _fail(f"{where}: expected comma-separated token ids, got {line.strip()!r}") from None
        else:
            prompts.append(line)
    if not prompts:
        raise _fail(f"--prompts: {path} holds no prompts")
    return prompts


def _check_args(args) -> tuple:
    """Everything that can be checked without the target's weights: (config, prompts or None, data dir, layers)."""
    from jaxspec.config import ConfigError, KimiConfig
    from jaxspec.training.data import DatasetError, read_manifest

    if not args.target.is_dir():
        raise _fail(f"--target: {args.target} is not a directory")
    try:
        cfg = KimiConfig.from_pretrained(args.target)
    except (FileNotFoundError, ConfigError) as e:
        raise _fail(f"--target: {e}") from None
    V = cfg.vocab_size
    if args.draft_vocab is None:
        args.draft_vocab = min(DEFAULT_DRAFT_VOCAB, V)
    if not 0 < args.draft_vocab <= V:
        raise _fail(f"--draft-vocab: {args.draft_vocab} must be in [1, {V}] (the target's vocab_size)")
    for flag in ("ttt_depth", "steps", "batch_size", "max_new_tokens", "checkpoint_every", "shard_size"):
        if getattr(args, flag) < 1:
            raise _fail(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    layers = None
    if args.capture_layers:
        try:
            layers = tuple(int(x) for x in args.capture_layers.split(","))
        except ValueError:
            raise _fail(f"--capture-layers: expected comma-separated integers, got {args.capture_layers!r}") from None
        if not all(0 <= x < cfg.num_hidden_layers for x in layers):
            raise _fail(f"--capture-layers: {list(layers)} must be layer outputs in [0, {cfg.num_hidden_layers})")
    if (args.out / "train_config.json").is_file() and not args.resume:
        raise _fail(f"--out: {args.out} holds an earlier training run; pass --resume to continue it, or another --out")

    prompts = None
    if args.prompts is not None:
        prompts = read_prompt_file(args.prompts, ids=args.ids)
        data_dir = args.data or args.out / "data"
    elif args.data is not None:
        data_dir = args.data
        try:
            manifest = read_manifest(data_dir)
        except DatasetError as e:
            raise _fail(f"--data: {e}") from None
        if manifest["target"]["vocab_size"] != V:
            raise _fail(
                f"--data: {data_dir} was generated for a vocabulary of {manifest['target']['vocab_size']} tokens, "
                f"the target has {V}"
            )
    else:
        raise _fail("give --prompts FILE (generate the data) or --data DIR (an existing dataset)")
    return cfg, prompts, data_dir, layers


def _encode(args, prompts: list, vocab_size: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """Token ids of every prompt (text through the tokenizer) and the tokenizer's stop ids."""
    from jaxspec.tokenizer import load_tokenizer

    tokenizer, stop = None, ()
    if args.chat or any(isinstance(p, str) for p in prompts):
        try:
            tokenizer = load_tokenizer(args.tokenizer or args.target)
        except (OSError, ValueError) as e:
            raise _fail(f"text prompts need a tokenizer: {e}") from None
        stop = tuple(tokenizer.stop_ids)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else tokenizer.encode(p)
        if not p or min(p) < 0 or max(p) >= vocab_size:
            raise _fail(f"--prompts: prompt {i + 1} has token ids outside [0, {vocab_size}) or is empty")
        out.append(list(p))
    return out, stop


def cmd_train_drafter(args: argparse.Namespace) -> int:
    """`jaxspec train-drafter`: check the arguments, load the target, generate data if asked, train, export."""
    import jax.numpy as jnp

    from jaxspec.io import load_target
    from jaxspec.training.data import generate_dataset
    from jaxspec.training.trainer import train_drafter
    from sharding.mesh import make_mesh

    cfg, prompts, data_dir, layers = _check_args(args)
    if prompts is not None:
        prompts, stop = _encode(args, prompts, cfg.vocab_size)
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        raise _fail(f"--mesh: {e}") from None
    target = load_target(args.target, mesh=mesh, dtype=jnp.dtype(args.dtype))
    print(f"target: {args.target} ({cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}); mesh {dict(mesh.shape)}")
    try:
        if prompts is not None:
            generate_dataset(
                target,
                prompts,
                data_dir,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
                stop=stop,
                shard_size=args.shard_size,
            )
            print(f"dataset: {data_dir}")
        drafter = train_drafter(
            target,
            data_dir,
            args.out,
            draft_vocab_size=args.draft_vocab,
            ttt_depth=args.ttt_depth,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            warmup=args.warmup,
            weight_decay=args.weight_decay,
            clip=args.clip,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            capture_layers=layers,
        )
    except (ValueError, FileExistsError) as e:
        raise _fail(str(e)) from None
    last = (args.out / "train_log.jsonl").read_text().splitlines()[-1]
    m = json.loads(last)
    acc = "/".join(f"{a:.3f}" for a in m["acc_j"])
    print(f"step {m['step']}: loss {m['loss']:.4f}, accuracy per depth {acc}")
    print(f"drafter ({drafter.config.draft_vocab_size}-token draft vocabulary) written to {args.out}")
    return 0
