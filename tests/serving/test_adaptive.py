"""Adaptive speculation on the engine: segments that switch between plain decoding and a chain on one loop state give
the greedy tokens of a fixed shape, keep the drafter current through plain segments (so sampling stays lossless:
each cycle drafts from the drafter's distribution at the row's true prefix), and compile nothing after warm-up."""

import itertools

import jax
import numpy as np
import pytest

from jaxspec.decoding import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.serving.engine import EngineConfig, Request
from jaxspec.serving.executor import Executor
from jaxspec.serving.plan import PrefillChunk, RowAdmission, StepPlan
from tests.serving.conftest import NUM_STEPS, warm_engine

PLAIN, CHAIN = DraftShape(0), DraftShape(NUM_STEPS)
CONFIG = EngineConfig(
    max_batch=2,
    max_context=64,
    draft=CHAIN,
    adaptive=True,
    prefill_chunk=16,
    segment_cycles=2,
    batch_buckets=(2,),
    context_buckets=(64,),
)


class Scripted:
    """A DraftPolicy stand-in: the segments' shapes in a fixed cycle."""

    predicted = None

    def __init__(self, shapes):
        self.shapes = itertools.cycle(shapes)

    def choose(self, rows, generating):
        return next(self.shapes)

    def observe(self, segment, counters, seconds):
        pass


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


def run(engine, requests, script):
    engine.scheduler.policy = Scripted(script)
    for r in requests:
        engine.submit(r)
    drafts = []
    while engine.step():
        drafts.append(engine.scheduler._segment_run and engine.scheduler._segment_run.draft)
    return drafts


@pytest.mark.parametrize("script", [(PLAIN, CHAIN), (CHAIN, CHAIN, PLAIN), (PLAIN, PLAIN, CHAIN)])
def test_switching_shapes_gives_the_greedy_tokens_of_a_fixed_shape(engine, prompts, reference, script):
    """Greedy rows (the static-greedy program) and, alongside a sampled row, the per-row program: the tokens are the
    single-request greedy reference whatever shape each segment ran; and no program compiles after warm-up."""
    alone = [Request(prompts[0], 20), Request(prompts[2], 16)]
    mixed = [Request(prompts[4], 18), Request(prompts[7], 12, Sampling(0.9, top_k=30), seed=3)]
    expected = [reference(r.prompt, r.max_tokens) for r in alone + mixed[:1]]  # generate's programs compile here
    traces = engine.executor.loop.traces
    drafts = run(engine, alone, script)
    assert {PLAIN, CHAIN} <= set(drafts)
    run(engine, mixed, script)
    assert [r.tokens for r in alone + mixed[:1]] == expected
    assert engine.executor.loop.traces == traces


def test_sampled_rows_are_reproducible_under_a_switching_script(engine, prompts):
    """Each row's draws come from its own key, advanced once per cycle whatever the shape: the same seed and the same
    script give the same tokens, next to another request or alone."""
    script = (CHAIN, PLAIN, PLAIN)
    first = Request(prompts[3], 16, Sampling(1.0, top_p=0.9), seed=21)
    run(engine, [first, Request(prompts[1], 10)], script)
    again = Request(prompts[3], 16, Sampling(1.0, top_p=0.9), seed=21)
    run(engine, [again], script)
    assert again.tokens == first.tokens and len(first.tokens) > 1


def test_plain_segments_keep_the_drafter_cache_current(engine, pair, prompts):
    """After plain segments, a sampled row's drafter cache over every processed position equals what a fresh prefill
    of the same tokens writes: the next drafting segment drafts from the drafter's distribution at the true prefix
    (what lossless speculative sampling needs)."""
    request = Request(prompts[3], 24, Sampling(0.9), seed=8)
    engine.scheduler.policy = Scripted((CHAIN, PLAIN, PLAIN, PLAIN))
    engine.submit(request)
    for _ in range(5):  # the prefill steps, a chain segment, then plain ones
        engine.step()
    assert engine.scheduler._segment_run.draft == PLAIN and not request.finished
    state = engine.executor.state
    row = request.slot
    length = int(state.length_B[row])
    history = [int(t) for t in np.asarray(state.tokens_BS[row, : length + 1])]  # + the pending token
    target, drafter, _ = pair
    fresh = Executor(target, drafter, CHAIN, max_batch=1, max_context=64, prefill_chunk=16, stop_ids=engine.stop_ids)
    chunks = tuple(PrefillChunk(0, start) for start in range(0, len(history), 16))
    for i, chunk in enumerate(chunks):
        admit = (RowAdmission(0, tuple(history), 2, Sampling(0.9), seed=8),) if i == 0 else ()
        fresh.run(StepPlan(i + 1, admit=admit, prefill=(chunk,)))
    for ours, theirs in zip(jax.tree.leaves(state.draft_cache), jax.tree.leaves(fresh.state.draft_cache), strict=True):
        np.testing.assert_allclose(
            np.asarray(ours[row, :length], np.float32), np.asarray(theirs[0, :length], np.float32), atol=2e-4, rtol=2e-3
        )
    engine.scheduler.policy = Scripted((CHAIN,))
    engine.run_until_idle()
    assert request.finish_reason in ("stop", "length")
