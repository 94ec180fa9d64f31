"""The slot engine in-process: admission into free slots between segments, chunked per-slot prefill, eviction,
cancellation, the bounded queue, per-row sampling, and greedy output independent of the rest of the batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.sampling import RowSampling, Sampling, sample_rows, warp, warp_rows
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.engine import QueueFull, Request
from tests.serving.support import ENGINE as CONFIG
from tests.serving.support import warm_engine


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


def test_admission_eviction_and_batch_independent_greedy(engine, prompts, reference):
    """Six requests through two slots: each waits in the queue, is admitted when a slot frees (its prefill chunks
    interleaved with the other slot's segments), leaves at once when done, and its greedy output equals the
    single-request `jaxspec.generate` output. A seeded sampled request rides along and comes out the same as alone."""
    budgets = [12, 5, 20, 7, 16, 9]
    greedy = [Request(prompts[i], budgets[i]) for i in range(5)]
    sampled = Request(prompts[5], budgets[5], RowSpec(Sampling(0.9, top_k=40, top_p=0.95), seed=11))
    occupancy = []
    for r in greedy[:3] + [sampled] + greedy[3:]:
        engine.submit(r)
    assert engine.queue_depth == 6
    while engine.step():
        occupancy.append(engine.occupancy)
        assert engine.occupancy <= CONFIG.max_batch
    assert max(occupancy) == CONFIG.max_batch and engine.occupancy == 0 and engine.queue_depth == 0
    for r, budget in zip(greedy, budgets, strict=False):
        assert r.finished and r.slot is None
        assert r.tokens == reference(r.prompt, budget), r.prompt
        assert r.finish_reason == ("stop" if r.tokens[-1] in engine.stop_ids else "length")
    alone = Request(prompts[5], budgets[5], RowSpec(Sampling(0.9, top_k=40, top_p=0.95), seed=11))
    engine.submit(alone)
    engine.run_until_idle()
    # alone reuses the cached blocks of sampled's prompt (and its key skips their chunks): the same draws
    assert alone.tokens == sampled.tokens and len(alone.tokens) > 0 and alone.cached_tokens > 0


def test_cancel_frees_the_slot_and_the_other_request_is_unaffected(engine, prompts, reference):
    updates = []
    keep = Request(prompts[1], 14)
    cancel = Request(prompts[2], 40, on_update=lambda r, new: updates.append((list(new), r.finish_reason)))
    engine.submit(keep)
    engine.submit(cancel)
    while not cancel.tokens:
        engine.step()
    assert cancel.slot is not None
    engine.cancel(cancel)
    engine.step()
    assert cancel.finish_reason == "cancelled" and cancel.slot is None and len(cancel.tokens) < 40
    assert updates[-1] == ([], "cancelled")
    queued = Request(prompts[3], 4)
    engine.submit(queued)
    engine.cancel(queued)  # cancelled while waiting: never takes a slot
    engine.run_until_idle()
    assert queued.finish_reason == "cancelled" and queued.tokens == []
    assert keep.tokens == reference(keep.prompt, 14)
    assert engine.scheduler.slots == [None, None]


def test_bounded_queue_and_bad_requests(engine, prompts):
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        engine.submit(Request(prompts[5], 100))
    with pytest.raises(ValueError, match="token ids in \\[0, 4096\\)"):
        engine.submit(Request([1, 5000], 4))
    with pytest.raises(ValueError, match="max_tokens: expected an integer >= 1"):
        engine.submit(Request([1, 2], 0))
    waiting = [Request(prompts[0], 2) for _ in range(CONFIG.max_queue)]
    for r in waiting:
        engine.submit(r)
    with pytest.raises(QueueFull):
        engine.submit(Request(prompts[0], 2))
    engine.run_until_idle()
    assert all(r.finished for r in waiting)


def test_warp_rows_equals_warp_per_row():
    """Each row of `warp_rows` is `warp` with that row's settings (greedy, temperature, top-k, top-p, tiny T)."""
    rng = np.random.default_rng(0)
    settings = [
        Sampling(0.0),
        Sampling(0.7, top_k=5),
        Sampling(1.3, top_p=0.8),
        Sampling(0.5, top_k=20, top_p=0.6),
        Sampling(2.0, top_k=1),
    ]
    logits = jnp.asarray(rng.standard_normal((len(settings), 3, 64)) * 3, jnp.float32)
    got = np.asarray(warp_rows(logits, RowSampling.of(settings)))
    for b, s in enumerate(settings):
        want = np.asarray(warp(logits[b], s))
        assert np.array_equal(np.isfinite(got[b]), np.isfinite(want)), s
        np.testing.assert_allclose(np.exp(got[b]), np.exp(want), atol=1e-6, err_msg=str(s))
    tiny = np.asarray(warp_rows(logits[:1], RowSampling.of([Sampling(1e-30)])))
    assert not np.isnan(tiny).any() and (np.exp(tiny).sum(-1) > 0.999).all()


def test_sample_rows_draws_no_noise_where_every_row_is_greedy():
    """All rows greedy: `sample_rows` gives what drawing from warp_rows' one-hots gives (the first maximum, ties
    included), and its program draws no Gumbel noise where that is so; a batch with a sampling row draws every row
    as before (the greedy ones still their argmax)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(np.round(rng.standard_normal((3, 2, 64)) * 2), jnp.float32)  # rounded: ties
    logits = logits.at[0, 0, 7].set(9.0).at[0, 0, 9].set(9.0)  # a tie at the maximum: the first wins
    keys = jax.random.split(jax.random.key(3), 3)
    draw = lambda rows: jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, warp_rows(logits, rows))
    greedy = RowSampling.of([Sampling(0.0)] * 3)
    got = np.asarray(sample_rows(keys, logits, greedy))
    assert np.array_equal(got, np.asarray(draw(greedy))) and got[0, 0] == 7
    assert np.array_equal(got, np.asarray(jnp.argmax(logits, -1)))
    mixed = RowSampling.of([Sampling(0.0), Sampling(0.9), Sampling(0.0)])
    assert np.array_equal(np.asarray(sample_rows(keys, logits, mixed)), np.asarray(draw(mixed)))
    conds = lambda f: len(re.findall(r"= \S+ conditional\(", jax.jit(f).lower(greedy).compile().as_text()))
    assert conds(lambda rows: sample_rows(keys, logits, rows)) == conds(draw) + 1  # the draw: a branch of its own


def test_a_logged_sequence_of_plans_replayed_by_a_fresh_executor_reproduces_the_run(engine, prompts, pair):
    """Every plan of a serving run (greedy and sampled requests, one without a seed, one cancelled mid-run), sent
    through its serialised form to a fresh executor, gives back the same results: tokens, done flags and counters.
    Counters count from the run's start (the fresh executor's start at 0). The plan is all an executor needs (what
    the other processes of a multi-process server get) and the pool's blocks it reuses: the run starts with an empty
    prefix cache, as the fresh executor's pool is."""
    from jaxspec.serving.executor import Executor
    from jaxspec.serving.plan import StepPlan

    log, run, before = [], engine.executor.run, engine.executor.counters()  # the module's earlier tests counted too
    engine.scheduler.tables.pool.clear()
    engine.executor.run = lambda plan: log.append((plan.to_bytes(), run(plan))) or log[-1][1]
    try:
        requests = [
            Request(prompts[0], 10),
            Request(prompts[3], 12, RowSpec(Sampling(0.8, top_k=20), seed=5)),
            Request(prompts[6], 9, RowSpec(Sampling(1.0))),  # no seed: the scheduler draws one into the plan
            Request(prompts[1], 30),
        ]
        for r in requests:
            engine.submit(r)
        while not requests[3].tokens:
            engine.step()
        engine.cancel(requests[3])
        engine.run_until_idle()
    finally:
        del engine.executor.run
    assert all(r.finished for r in requests) and requests[3].finish_reason == "cancelled"
    target, drafter, _ = pair
    fresh = Executor.of(target, drafter, engine.config, stop_ids=engine.stop_ids)
    replayed = [fresh.run(StepPlan.from_bytes(plan)) for plan, _ in log]
    assert [r.rows for r in replayed] == [r.rows for _, r in log]
    assert [r.counters for r in replayed] == [r.counters and r.counters.minus(before) for _, r in log]
    assert sum(len(row.tokens) for result in replayed for row in result.rows) == sum(len(r.tokens) for r in requests)
