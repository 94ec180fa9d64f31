"""The slot engine drafting trees (EngineConfig.draft a tree): continuous batching with a tree cycle in every segment.
Greedy output equals the single-request `jaxspec.generate` output whatever shares the batch, sampled requests come out
the same alone and in a batch (tree acceptance walks the tree with each row's own key), and the segments switch
between the static-greedy and the per-row program as sampled requests come and go."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.decoding import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.engine import EngineConfig, Request
from tests.serving.support import TREE_ENGINE as CONFIG
from tests.serving.support import Scripted, assert_drafter_cache_kept, prefill_all, run, warm_engine


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


def test_tree_engine_greedy_equals_generate_and_sampling_is_batch_independent(engine, prompts, reference):
    before = engine.executor.counters()  # the warm-up's cycles counted too
    budgets = [12, 20, 7, 16]
    greedy = [Request(prompts[i], budgets[i]) for i in range(4)]
    settings = Sampling(0.9, top_k=40, top_p=0.95)
    sampled = Request(prompts[5], 9, RowSpec(settings, seed=11))
    for r in greedy[:2] + [sampled] + greedy[2:]:
        engine.submit(r)
    engine.run_until_idle()
    for r, budget in zip(greedy, budgets, strict=True):
        assert r.finished and r.tokens == reference(r.prompt, budget), r.prompt
    alone = Request(prompts[5], 9, RowSpec(settings, seed=11))
    engine.submit(alone)
    engine.run_until_idle()
    # alone reuses the batch's cached prompt blocks: a tree's cache compaction never rewrites a shared block
    assert alone.tokens == sampled.tokens and len(alone.tokens) > 0 and alone.cached_tokens > 0
    assert engine.executor.per_row.tree and engine.executor.per_row.num_draft_tokens == 6
    # The tree's per-depth counters account for the tokens: every row-cycle verifies depth 1, depth j + 1 is reached
    # exactly when depth j is accepted, a row-cycle accepting t drafts emits t + 1 tokens (the last one of a request
    # at most J = 3 past its budget), and the tree's full depth was accepted.
    c = engine.executor.counters().minus(before)
    requests = [*greedy, sampled, alone]
    emitted = sum((t + 1) * n for t, n in enumerate(c.accept_hist))
    produced = sum(len(r.tokens) - 1 for r in requests)  # each request's first token comes from its prefill
    assert c.cycles > 0 and sum(c.accept_hist) == c.reached[0] and c.reached[1:] == c.accepted[:-1], c
    assert produced <= emitted <= produced + 3 * len(requests), (produced, c)
    assert c.accepted[-1] > 0, c


def test_engine_refuses_a_draft_that_is_not_a_shape():
    with pytest.raises(ValueError, match="EngineConfig.draft: expected a DraftShape"):
        EngineConfig(draft=3)


def test_the_context_a_request_needs_counts_the_trees_verify_width(engine):
    """A tree writes its 6 verified nodes past a row's length, not num_steps + 1 = 4: a request that fits a chain's
    lookahead but not the tree's is refused."""
    assert CONFIG.draft.lookahead == 6 and DraftShape(3).lookahead == 4
    assert engine.check(100, 128 - 100 - 7) is None
    assert "exceeds the context of 128" in engine.check(100, 128 - 100 - 6)


def test_an_adaptive_tree_engine_switches_with_plain_decoding_on_one_state(pair, prompts, reference, coupled_reference):
    """`--num-steps auto --topk N`: plain decoding and the tree are the candidates, on one loop state (plain segments
    keep the target states a tree's catch-up then drafts from). Whatever shape each segment runs: greedy rows give
    the single-request reference, a sampled row the same tokens under the same script, a coupled row plain
    sampling's tokens under any script, nothing compiles after warm-up; the tree's counters are its own (per
    depth)."""
    engine = warm_engine(pair, dataclasses.replace(CONFIG, adaptive=True))
    plain, tree = DraftShape(0), CONFIG.draft
    assert engine.config.shapes == (plain, tree) and set(engine.scheduler.policy.shapes) == {plain, tree}
    traces = engine.executor.loop.traces
    for script in ((plain, tree), (tree, plain, plain)):
        greedy = [Request(prompts[0], 20), Request(prompts[2], 16)]
        drafts = run(engine, greedy, script)
        assert {plain, tree} <= set(drafts)
        assert [r.tokens for r in greedy] == [reference(r.prompt, r.max_tokens) for r in greedy]
    unfed = [Request(prompts[5], 14), Request(prompts[1], 12)]  # no drafter at prefill: a tree later catches it up
    before = jax.tree.map(np.asarray, engine.executor.pool.drafter)
    engine.scheduler.policy = Scripted((tree, plain), feed=False)
    prefill_all(engine, unfed)
    for r in unfed:
        assert_drafter_cache_kept(engine.executor, before, r.slot, len(r.prompt) - 1, CONFIG.block)
    engine.run_until_idle()
    assert [r.tokens for r in unfed] == [reference(r.prompt, r.max_tokens) for r in unfed]
    sampled = [Request(prompts[3], 12, RowSpec(Sampling(0.9, top_k=40), seed=5)) for _ in range(2)]
    for r in sampled:
        run(engine, [r], (tree, plain))
    assert sampled[0].tokens == sampled[1].tokens and len(sampled[0].tokens) == 12
    spec = RowSpec(Sampling(1.0, top_p=0.9), seed=6, coupled=True)  # coupled: plain sampling's tokens, any script
    for script in ((tree, plain), (plain, tree, tree)):
        coupled = Request(prompts[1], 16, spec)
        run(engine, [coupled, Request(prompts[4], 10, RowSpec(Sampling(0.8), seed=2))], script)
        assert coupled.tokens == coupled_reference(prompts[1], 16, spec)
    assert engine.executor.loop.traces == traces
