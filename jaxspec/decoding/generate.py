"""`jaxspec.generate`: speculative (or plain, num_steps=0) generation from token ids or strings.

Shapes are bucketed (batch to a power of two up to 8, then a multiple of 8; prompt length to a power of two >= 16;
the token buffer to a power of two), so new prompt lengths or budgets within a bucket reuse the compiled programs;
`stats["compiles"]` says how many traces a call caused. Everything is validated before anything compiles.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.coupling import check_mode
from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import derive_seed
from jaxspec.decoding.spec_loop import SpecLoop
from jaxspec.decoding.state import LoopConfig, LoopState
from sharding.mesh import DATA
from sharding.multihost import to_host

MIN_PROMPT_BUCKET = 16
PREFILL_CHUNK = 256


@dataclasses.dataclass
class GenerateResult:
    """tokens: new token ids per prompt (up to and including a stop token); text: decoded (with a tokenizer)."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict[str, Any]


@dataclasses.dataclass
class Progress:
    """What `generate(..., on_progress=)` sees after every `stream_cycles` cycles: the tokens generated so far per
    prompt, cycles run, the per-position reached/accepted counters so far, and which prompts are finished."""

    tokens: list[list[int]]
    cycles: int
    reached: np.ndarray
    accepted: np.ndarray
    done: list[bool]


def bucket(n: int, minimum: int = 1) -> int:
    """The padded size of `n`: the next power of two, at least `minimum`."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


class LoopCache:
    """Compiled decoding loops kept for reuse across `generate` calls: one `SpecLoop` (its jitted prefill and cycle
    programs and their trace counter) per (target, drafter).

    The loops hold programs that take seconds to minutes to compile, so they must outlive a call; who keeps them is
    the owner of this object, in sight of the caller (it replaces a module-level registry, which hid that and kept
    every target alive):
    - `generate(..., loops=cache)` shares programs between the calls you make with that cache (the CLI keeps one per
      command, the tuner one per sweep);
    - without `loops=`, `generate` uses `LoopCache.of(target)`, the cache held by the target itself, so the programs
      live exactly as long as the target object (as `Target.logits` keeps its jitted programs per target).
    """

    # Attribute of the Target instance holding its cache (set on first use; Target is a frozen dataclass, so the
    # instance dict is written directly, as functools.cached_property does).
    ATTRIBUTE = "decoding_loops"

    def __init__(self) -> None:
        self._loops: dict[tuple[int, int | None], SpecLoop] = {}

    def loop(self, target, drafter) -> SpecLoop:
        """The loop of (target, drafter); drafter None: plain decoding. Keyed by identity."""
        key = (id(target), None if drafter is None else id(drafter))
        loop = self._loops.get(key)
        if loop is None or loop.target is not target or loop.drafter is not drafter:  # ids of dead objects reused
            loop = self._loops[key] = SpecLoop(target, drafter)
        return loop

    @classmethod
    def of(cls, target) -> LoopCache:
        """The cache held by `target` (created on first use)."""
        return vars(target).setdefault(cls.ATTRIBUTE, cls())


def _prompt_ids(prompts, tokenizer) -> list[list[int]]:
    if isinstance(prompts, np.ndarray):  # [T] or [B, T] of ids
        if prompts.ndim not in (1, 2):
            raise ValueError(f"prompts: a numpy array must be [T] or [B, T] token ids, got shape {prompts.shape}")
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of strings or of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string: pass tokenizer= to encode it (or give token ids)")
            p = tokenizer.encode(p)
        ids = np.asarray(p)
        if ids.size == 0:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}]: expected a flat list of integer token ids, got {ids.dtype} {ids.shape}")
        out.append([int(t) for t in ids])
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _check_seed_and_stop(seed: Any, stop: Any, vocab_size: int) -> list[int]:
    """Validate `seed` and `stop` (extra stop ids) before anything is traced; returns the stop ids as ints."""
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"seed: expected an integer in [0, 2**32), got {seed!r}")
    if stop is None:
        return []
    if isinstance(stop, str | bytes) or not isinstance(stop, Sequence | np.ndarray):
        raise ValueError(f"stop: expected a list of token ids, got {stop!r}")
    bad = [s for s in stop if not _is_int(s) or not 0 <= s < vocab_size]
    if bad:
        raise ValueError(f"stop: token ids must be integers in [0, vocab_size={vocab_size}), got {bad!r}")
    return [int(s) for s in stop]


# long: the public entry point; its signature and docstring are most of it
def generate(
    target,
    drafter,
    prompts,
    *,
    draft: DraftShape | int | None = None,
    max_new_tokens: int = 128,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    sampling: str = "rejection",
    stop: Sequence[int] | None = None,
    tokenizer=None,
    on_cycles: Callable[[list[list[int]]], None] | None = None,
    stream_cycles: int = 8,
    on_progress: Callable[[Progress], None] | None = None,
    loops: LoopCache | None = None,
    dcp: int | None = None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` per prompt with EAGLE-3 speculative decoding. Greedy at temperature 0 (output
    identical to plain greedy); otherwise lossless speculative sampling with temperature / top-k / top-p applied
    identically to target and draft.

    `draft`: what a cycle drafts, a `DraftShape` (or a chain's depth as an int): `DraftShape(3)` a chain of 3 draft
    tokens, `DraftShape(0)` plain decoding (drafter may then be None), `DraftShape(4, topk=2, num_draft_tokens=8)` a
    tree of 4 levels of the 2 best children per frontier node whose 8 best nodes (the root included) are verified in
    one forward (decoding/tree.py). Without `draft`, `num_steps`, `topk` and `num_draft_tokens` give the shape.

    `sampling`: "rejection" (the most accepted tokens) or "coupled": prompt j's tokens are plain sampling's with seed
    `derive_seed(seed, j)` (row 0: `seed`), whatever the draft shape or batch, as `jaxspec serve` samples (coupling.py).

    `stop`: extra stop token ids (the target config's eos and the tokenizer's stop ids always apply). `on_cycles`
    receives the tokens generated so far after every `stream_cycles` cycles (for streaming output); `on_progress`
    receives a `Progress` (tokens, cycles, acceptance counters, finished prompts) at the same points. The time spent
    inside the callbacks is counted in `stats["seconds"]`. `loops`: where the compiled loop is kept (see `LoopCache`;
    default: the target's own cache). `dcp`: the target's cache striped over that many devices (`Target.with_dcp`).
    """
    coupled = check_mode("sampling", sampling) == "coupled" and temperature != 0  # greedy is greedy either way
    target = target if dcp is None else target.with_dcp(dcp)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    shape = draft_shape(draft, num_steps, topk, num_draft_tokens, drafter)
    _check_counts(max_new_tokens, stream_cycles)
    cfg = target.config
    stop, ids = _check_seed_and_stop(seed, stop, cfg.vocab_size), _prompt_ids(prompts, tokenizer)
    layout = _Layout.of(ids, target, max_new_tokens, shape)
    stop_ids = set(cfg.stop_token_ids) | set(stop) | set(getattr(tokenizer, "stop_ids", ()) or ())

    loop = (loops if loops is not None else LoopCache.of(target)).loop(target, drafter)
    traces_before = loop.traces
    loop_cfg = LoopConfig(shape, sampling, tuple(sorted(stop_ids)), layout.prompt, layout.chunk, coupled=coupled)
    state = _start(target, drafter, shape, layout, loop_cfg, seed).with_prompts(ids, max_new_tokens)
    budget = stream_cycles if on_cycles is not None or on_progress is not None else max_new_tokens + 1
    start = time.perf_counter()
    state = _decode(loop, loop_cfg, target, drafter, state, budget, (on_cycles, on_progress), len(ids))
    seconds = time.perf_counter() - start
    out = _collect(state, len(ids))
    stats = _stats(state, out, shape, seconds) | {"compiles": loop.traces - traces_before, "buckets": layout.buckets}
    return GenerateResult(out, [tokenizer.decode(t) for t in out] if tokenizer is not None else None, stats)


def _start(target, drafter, shape: DraftShape, layout: _Layout, loop_cfg: LoopConfig, seed: int) -> LoopState:
    """The empty state for `loop_cfg`: one key from `seed`, or (coupled) row j's key from derive_seed(seed, j)."""
    greedy = loop_cfg.sampling.greedy
    state = LoopState.empty(target, drafter, shape, layout.batch, layout.buffer, greedy=greedy, seed=seed)
    if not loop_cfg.coupled:
        return state
    return state.with_row_seeds([derive_seed(seed, row) for row in range(layout.batch)])


def _decode(loop: SpecLoop, loop_cfg: LoopConfig, target, drafter, state: LoopState, budget: int, callbacks, n: int):
    """Prefill, then run the loop `budget` cycles at a time (handing the progress to the callbacks after each run)
    until every row is done; returns the final LoopState."""
    on_cycles, on_progress = callbacks
    dparams = drafter.params if drafter is not None and not loop_cfg.draft.plain else None
    state = loop.prefill(loop_cfg, target.params, dparams, state)
    while True:
        state = loop.run(loop_cfg, target.params, dparams, state, jnp.int32(budget))
        done_B = to_host(state.done_B)
        if on_cycles is not None or on_progress is not None:
            _report(state, done_B, n, on_cycles, on_progress)
        if done_B.all():
            return state


def draft_shape(draft: Any, num_steps: Any, topk: Any, num_draft_tokens: Any, drafter) -> DraftShape:
    """The call's draft shape: `draft` (a DraftShape or a chain's depth), else the three keywords; checked against
    the drafter (a draft needs one; a tree's topk at most its vocabulary)."""
    if draft is None:
        shape = DraftShape(num_steps, topk, num_draft_tokens)
    elif isinstance(draft, DraftShape | int) and not isinstance(draft, bool):
        shape = DraftShape.of(draft)
    else:
        raise ValueError(f"draft: expected a DraftShape or a chain's depth (an int), got {draft!r}")
    if drafter is None:
        if not shape.plain:
            raise ValueError(f"num_steps={shape.num_steps} needs a drafter (pass num_steps=0 for plain decoding)")
        return shape
    return shape.check_drafter(drafter.config.draft_vocab_size)


def _check_counts(max_new_tokens: Any, stream_cycles: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    if isinstance(stream_cycles, bool) or not isinstance(stream_cycles, int) or stream_cycles < 1:
        raise ValueError(f"stream_cycles: expected an integer >= 1, got {stream_cycles!r}")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The bucketed shapes of one call: padded batch, prompt length and token buffer."""

    batch: int
    prompt: int
    buffer: int

    @classmethod
    def of(cls, ids: list[list[int]], target, max_new_tokens: int, draft: DraftShape) -> _Layout:
        """Check the prompts against the target's vocabulary and context, and bucket the shapes (the buffer holds what
        a row reaches: `DraftShape.reach`, a cycle's lookahead included)."""
        cfg = target.config
        for i, p in enumerate(ids):
            if min(p) < 0 or max(p) >= cfg.vocab_size:
                raise ValueError(
                    f"prompts[{i}]: token ids must be in [0, {cfg.vocab_size}); got min {min(p)}, max {max(p)}"
                )
        longest = max(len(p) for p in ids)
        prompt = bucket(longest, MIN_PROMPT_BUCKET)
        if draft.reach(longest, longest + max_new_tokens) > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} (+ {draft.lookahead + 1} for drafting "
                f"{draft.label}) exceeds the context of {cfg.max_position_embeddings} positions"
            )
        data = target.mesh.shape[DATA]
        # Small batches to powers of two, larger ones to multiples of 8 (bounded padding); always whole data shards.
        batch = bucket(len(ids)) if len(ids) <= 8 else -(-len(ids) // 8) * 8
        batch = -(-batch // data) * data
        return cls(batch, prompt, bucket(draft.reach(prompt, prompt + max_new_tokens)))

    @property
    def chunk(self) -> int:
        """Prompt positions per prefill chunk."""
        return min(PREFILL_CHUNK, self.prompt)

    @property
    def buckets(self) -> dict[str, int]:
        """What `generate`'s stats report as its buckets."""
        return {"batch": self.batch, "prompt": self.prompt, "buffer": self.buffer}


def _report(state, done_B: np.ndarray, n: int, on_cycles, on_progress) -> None:
    """Hand the tokens so far (and with `on_progress`, the counters) to the streaming callbacks."""
    tokens_so_far = _collect(state, n)
    if on_cycles is not None:
        on_cycles(tokens_so_far)
    if on_progress is not None:
        reached, accepted, cycles = to_host((state.reached_J, state.accepted_J, state.cycles))
        on_progress(Progress(tokens_so_far, int(cycles), reached.copy(), accepted.copy(), done_B[:n].tolist()))


def _stats(state, out: list[list[int]], draft: DraftShape, seconds: float) -> dict[str, Any]:
    num_steps = draft.num_steps
    reached, accepted, hist, cycles = to_host((state.reached_J, state.accepted_J, state.accept_hist_T, state.cycles))
    new_tokens = sum(len(t) for t in out)
    return {
        "cycles": int(cycles),
        "new_tokens": new_tokens,
        "num_steps": num_steps,
        "draft": draft.label,
        "topk": draft.topk,
        "num_draft_tokens": draft.verify_tokens,  # tokens one verify step takes
        "reached": reached.tolist(),
        "accepted": accepted.tolist(),
        "acceptance_rate": (accepted / np.maximum(reached, 1)).tolist(),
        "accepted_length_histogram": hist.tolist(),
        "mean_accepted_length": float((hist * np.arange(num_steps + 1)).sum() / max(hist.sum(), 1) + 1),
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else float("nan"),
    }


def _collect(state, n: int) -> list[list[int]]:
    tokens, start, end = to_host((state.tokens_BS, state.prompt_len_B, state.end_B))  # on every process
    return [tokens[i, start[i] : end[i]].tolist() for i in range(n)]
