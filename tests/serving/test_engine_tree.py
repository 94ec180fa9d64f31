"""The slot engine drafting trees (EngineConfig.topk > 1): continuous batching with a tree cycle in every segment.
Greedy output equals the single-request `jaxspec.generate` output whatever shares the batch, sampled requests come out
the same alone and in a batch (tree acceptance walks the tree with each row's own key), and the segments switch
between the static-greedy and the per-row program as sampled requests come and go."""

import pytest

from jaxspec.decoding.sampling import Sampling
from jaxspec.serving.engine import EngineConfig, Request
from tests.serving.conftest import warm_engine

# 2 slots of 128 positions (one context bucket), both segment programs (static-greedy and per-row).
CONFIG = EngineConfig(
    max_batch=2,
    max_context=128,
    num_steps=3,
    topk=2,
    num_draft_tokens=6,
    prefill_chunk=16,
    segment_cycles=2,
    max_queue=6,
    batch_buckets=(2,),
)


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


def test_tree_engine_greedy_equals_generate_and_sampling_is_batch_independent(engine, prompts, reference):
    budgets = [12, 20, 7, 16]
    greedy = [Request(prompts[i], budgets[i]) for i in range(4)]
    settings = Sampling(0.9, top_k=40, top_p=0.95)
    sampled = Request(prompts[5], 9, settings, seed=11)
    for r in greedy[:2] + [sampled] + greedy[2:]:
        engine.submit(r)
    engine.run_until_idle()
    for r, budget in zip(greedy, budgets, strict=True):
        assert r.finished and r.tokens == reference(r.prompt, budget), r.prompt
    alone = Request(prompts[5], 9, settings, seed=11)
    engine.submit(alone)
    engine.run_until_idle()
    assert alone.tokens == sampled.tokens and len(alone.tokens) > 0
    assert engine.loop_cfg.tree and engine.loop_cfg.num_draft_tokens == 6
    cycles, reached, accepted = (int(engine.state.cycles), engine.state.reached_J, engine.state.accepted_J)
    assert cycles > 0 and reached.shape == (3,) and int(accepted[0]) > 0  # per-depth counters of the tree


def test_tree_settings_are_checked_by_name():
    for kwargs, match in [
        (dict(topk=2, num_draft_tokens=9), "EngineConfig.num_draft_tokens: expected 2..7"),
        (dict(topk=0), "EngineConfig.topk"),
        (dict(topk=2, num_steps=0), "EngineConfig.topk=2 drafts a tree"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**({"num_steps": 2} | kwargs))
    # The context a request needs counts the tree's verify width (6 nodes) instead of num_steps + 1.
    assert CONFIG.lookahead == 6 and EngineConfig(num_steps=3).lookahead == 4
