"""`jaxspec generate`: speculative (or plain) generation; prints the text, and statistics and the speedup on request
(on by default for the bundled pair)."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from jaxspec.cli.args import (
    UsageError,
    add_dcp_arg,
    add_drafter_arg,
    add_kv_cache_dtype_arg,
    add_num_steps_args,
    add_target_args,
    add_tree_args,
    auto_num_steps,
    build_target,
    check_target_args,
    draft_shape,
    int_list,
    use_bundled_pair,
)
from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import VERIFY_MODES

HELP = "speculative (or plain) generation; prints text and statistics"
DESCRIPTION = (
    "Generate with EAGLE-3 speculative decoding. --prompt is text (needs a tokenizer: tiktoken.model "
    "or tokenizer.json in --tokenizer, default the --model directory) or comma-separated token ids with --ids. "
    "With neither --model nor --preset it runs the bundled trained pair (assets/kimi-py-tiny) on a held-out "
    "prompt and also measures plain decoding, printing the text, acceptance statistics and the speedup."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_kv_cache_dtype_arg(p)
    add_dcp_arg(p)
    add_drafter_arg(
        p,
        "EAGLE-3 drafter directory (SGLang or speculators format); with --preset and no --drafter a random "
        "drafter is used (it accepts ~nothing)",
    )
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument(
        "--prompt", action="append", help="a prompt (repeat for a batch; default with the bundled pair: a held-out one)"
    )
    p.add_argument("--ids", action="store_true", help="prompts are comma-separated token ids, not text")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    add_num_steps_args(
        p,
        default="3",
        auto_help="the configuration --tune DIR/tune.json recommends (a tree sets --topk and --num-draft-tokens too, "
        "unless given)",
    )
    add_tree_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (%(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless speculative sampling (%(default)s)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (%(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0 = off (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (%(default)s)")
    p.add_argument(
        "--sampling",
        choices=VERIFY_MODES,
        default="rejection",
        help="with --temperature > 0: rejection (lossless rejection sampling: the most accepted tokens) or coupled "
        "(prompt j's text is what plain sampling with its seed gives, whatever the draft shape) (%(default)s)",
    )
    p.add_argument("--stats", action="store_true", help="print acceptance statistics (on for the bundled pair)")
    p.add_argument(
        "--compare-plain",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run plain decoding (both compiled first, then timed) and print the measured speedup "
        "(default: on for the bundled pair)",
    )
    p.add_argument("--stream", action="store_true", help="print text as cycles complete")


def _fail(message: str) -> NoReturn:
    raise UsageError("generate", message)


def check(args: argparse.Namespace) -> None:
    """Everything checkable without a model, before anything loads: raise UsageError on the first problem. Sets
    `args.draft`, the run's DraftShape."""
    fail = _fail
    check_target_args(args, fail)
    args.num_steps = num_steps(args)
    args.draft = draft_shape(args, fail)
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
    _check_inputs(args, fail)


def _check_inputs(args: argparse.Namespace, fail) -> None:
    """Prompts, drafter and tokenizer: present and well-formed."""
    from pathlib import Path

    bundled = not (args.model or args.preset)
    if not bundled and not args.prompt:
        fail("--prompt is required with --model or --preset")
    if args.ids and args.prompt:
        for p in args.prompt:
            int_list(p, "--ids --prompt", fail)
    if args.drafter and not Path(args.drafter).is_dir():
        fail(f"--drafter: {args.drafter} is not a directory")
    if args.model and not args.draft.plain and not args.drafter:
        fail("--num-steps > 0 with --model needs --drafter (or --num-steps 0)")
    if not bundled and (not args.ids or args.chat):
        tok_dir = args.tokenizer or args.model
        if tok_dir is None:
            fail("text prompts need --tokenizer (or --model with a tokenizer); use --ids for token ids")
        if not Path(tok_dir).is_dir():
            fail(f"--tokenizer: {tok_dir} is not a directory")


def num_steps(args: argparse.Namespace) -> int:
    """--num-steps as an integer ('auto': the recommended configuration of --tune DIR/tune.json; when it is a tree
    and neither --topk nor --num-draft-tokens was given, they are set to the tree's)."""
    if args.num_steps != "auto":
        try:
            return int(args.num_steps)
        except ValueError:
            raise UsageError(
                "generate", f"--num-steps: expected an integer or 'auto', got {args.num_steps!r}"
            ) from None
    if args.tune is None or not (args.tune / "tune.json").is_file():
        raise UsageError("generate", "--num-steps auto needs --tune DIR with the tune.json of 'jaxspec tune'")
    return auto_num_steps(args, args.tune / "tune.json")


def run(args: argparse.Namespace) -> int:
    """Load (or build) the pair, generate, print the text and the statistics asked for."""
    if not hasattr(args, "draft"):  # not yet checked (main() checks it; direct callers may not have)
        args.num_steps = num_steps(args) if isinstance(args.num_steps, str) else args.num_steps
        args.draft = draft_shape(args, _fail)
    bundled = use_bundled_pair(args)
    if bundled:
        from jaxspec.bundled import prompts as held_out_prompts

        args.prompt, args.stats = args.prompt or held_out_prompts()[:1], True
    elif not args.prompt:
        raise SystemExit("jaxspec generate: --prompt is required with --model or --preset")
    compare = bundled if args.compare_plain is None else args.compare_plain
    target, source = build_target(args, abstract=False)
    drafter = _drafter(args, target)
    tokenizer = _tokenizer(args)
    prompts = _prompts(args, tokenizer)
    streaming = args.stream and len(prompts) == 1
    stream, finish_stream = _streamer(tokenizer)
    run_at = _runner(args, target, drafter, prompts, tokenizer)
    if bundled:
        print("--- held-out prompt (never trained on) ---\n" + "\n---\n".join(map(str, prompts)))
        print("--- completion ---")
    plain = DraftShape(0)
    result = run_at(args.draft, stream if streaming else None)
    timed = None
    if compare and not args.draft.plain:
        # Both programs are compiled by a first call (the one above for speculative decoding), then timed warm.
        run_at(plain)
        timed = {"speculative": run_at(args.draft).stats, "plain": run_at(plain).stats}
    if streaming:
        print(finish_stream())
    else:
        for i, toks in enumerate(result.tokens):
            body = result.text[i] if result.text is not None else ",".join(map(str, toks))
            print(f"[{i}] {body}")
    if args.stats:
        _print_stats(result.stats, f"target: {source}; drafter: {args.drafter or ('random' if drafter else 'none')}")
    if timed is not None:
        _print_speedup(args.draft, timed["speculative"], timed["plain"])
    return 0


def _drafter(args: argparse.Namespace, target) -> Any:
    if args.draft.plain:
        return None
    if args.model and not args.drafter:
        raise SystemExit("jaxspec generate: --num-steps > 0 with --model needs --drafter (or --num-steps 0)")
    from jaxspec.io import load_drafter_or_random

    return load_drafter_or_random(args.drafter, target)


def _tokenizer(args: argparse.Namespace) -> Any:
    from jaxspec.tokenizer import load_tokenizer

    if args.ids and not args.chat:
        return None
    tok_dir = args.tokenizer or args.model
    if tok_dir is None:
        raise SystemExit(
            "jaxspec generate: text prompts need --tokenizer (or --model with a tokenizer); use --ids for token ids"
        )
    return load_tokenizer(tok_dir)


def _prompts(args: argparse.Namespace, tokenizer) -> list:
    if args.ids:
        try:
            prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
        except ValueError:
            raise SystemExit("jaxspec generate: --ids expects comma-separated integers") from None
    else:
        prompts = list(args.prompt)
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return prompts


def _runner(args: argparse.Namespace, target, drafter, prompts: list, tokenizer):
    """run(draft, on_cycles=None) -> GenerateResult with this invocation's settings; every run shares one cache of
    compiled loops, so the second run at a shape compiles nothing."""
    from jaxspec.decoding.generate import LoopCache, generate

    loops = LoopCache()

    def run_at(draft: DraftShape, on_cycles=None):
        settings = dict(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, sampling=args.sampling
        )
        return generate(
            target,
            None if draft.plain else drafter,
            prompts,
            draft=draft,
            max_new_tokens=args.max_new_tokens,
            tokenizer=tokenizer,
            on_cycles=on_cycles,
            loops=loops,
            **settings,
        )

    return run_at


def _print_stats(s: dict[str, Any], pair: str) -> None:
    tree = f", topk {s['topk']}, {s['num_draft_tokens']} draft tokens" if s["topk"] > 1 else ""
    print(f"{pair}; num_steps {s['num_steps']}{tree}")
    print(
        f"{s['new_tokens']} new tokens in {s['cycles']} cycles, {s['seconds']:.2f}s "
        f"({s['tokens_per_second']:.1f} tok/s incl. compile on first call; {s['compiles']} compile(s))"
    )
    print(f"mean accepted length (incl. bonus): {s['mean_accepted_length']:.2f}")
    for j, (r, a) in enumerate(zip(s["reached"], s["accepted"], strict=True), start=1):
        print(
            f"  draft {'depth' if s['topk'] > 1 else 'position'} {j}: reached {r}, accepted {a} ({a / max(r, 1):.1%})"
        )


def _print_speedup(draft: DraftShape, spec: dict[str, Any], plain: dict[str, Any]) -> None:
    print(
        f"speculative ({draft.label}) {spec['tokens_per_second']:.1f} tok/s vs plain "
        f"{plain['tokens_per_second']:.1f} tok/s (both compiled, timed on a second run): "
        f"speedup {spec['tokens_per_second'] / plain['tokens_per_second']:.2f}x"
    )


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
