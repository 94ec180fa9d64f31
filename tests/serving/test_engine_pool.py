"""The cache pool on the bundled pair: a prefix hit (a shared system prompt, a prompt that is a prefix of another,
one ending inside a block and one on its edge) gives the same greedy and seeded sampled tokens as the cold run, and
requests that together need more positions than the pool all complete with their single-request tokens (greedy and
seeded sampled), preempted and resumed by recompute."""

import dataclasses

import pytest

from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.engine import Engine, EngineConfig, Request
from tests.serving.support import ENGINE as CONFIG

# test_engine's shape (so the loop's programs are shared) with a pool of 10 blocks of 16 positions: two rows that
# each reach past 80 positions do not fit together.
POOL = dataclasses.replace(CONFIG, kv_cache_tokens=160)


@pytest.fixture(scope="module")
def engine(pair):
    target, drafter, tokenizer = pair
    engine = Engine(target, drafter, POOL, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    return engine


def test_pool_flags_and_their_checks():
    import argparse

    from jaxspec.cli.serve import _engine_fields, add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    fields = _engine_fields(p.parse_args(["--kv-cache-tokens", "4096", "--block-size", "16", "--no-prefix-cache"]))
    assert (fields["kv_cache_tokens"], fields["block_size"], fields["prefix_cache"]) == (4096, 16, False)
    assert _engine_fields(p.parse_args([]))["prefix_cache"] is True
    config = EngineConfig(max_batch=4, max_context=512, kv_cache_tokens=1000)
    assert (config.block, config.pool_blocks) == (64, 15) and EngineConfig().pool_blocks == 8 * 1024 // 64
    with pytest.raises(ValueError, match="EngineConfig.block_size: 48 must divide the prefill chunk"):
        EngineConfig(block_size=48)
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_tokens: expected at least max_context"):
        EngineConfig(kv_cache_tokens=512)


def serve(engine, requests: list[Request], *, cache: bool) -> list[Request]:
    """Run `requests` to the end with the prefix cache on or off (off: nothing cached is looked up)."""
    engine.scheduler.tables.caching = cache
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    assert all(r.finish_reason in ("stop", "length") for r in requests)
    return requests


def test_prefix_hits_give_the_cold_greedy_and_sampled_tokens(engine, prompts, reference, coupled_reference):
    system = sum(prompts, [])[:40]  # positions 0..31 reusable (two chunks of 16) when token 32 matches too
    users = [prompts[i][:n] for i, n in ((0, 5), (2, 9), (4, 1))]
    sampling = Sampling(0.9, top_k=40, top_p=0.95)

    def batch():
        chat = [Request(system + u, 12) for u in users]
        edge = Request(system[:32], 8)  # ends on a block edge: reuses 16 (its last position is prefilled)
        inside = Request(system[:37], 8, RowSpec(sampling, seed=3))  # ends inside a block
        return chat + [edge, inside, Request(system + users[0], 10, RowSpec(sampling, seed=7, coupled=True))]

    engine.scheduler.tables.pool.clear()
    cold = serve(engine, batch(), cache=False)
    assert all(r.cached_tokens == 0 for r in cold)
    serve(engine, [Request(system + [1], 2)], cache=True)  # caches the system prompt's blocks
    warm = serve(engine, batch(), cache=True)
    assert [r.cached_tokens for r in warm] == [32, 32, 32, 16, 32, 32]
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    for r in warm[:3]:
        assert r.tokens == reference(r.prompt, 12)
    assert warm[-1].tokens == coupled_reference(warm[-1].prompt, 10, warm[-1].spec)


def test_requests_needing_more_than_the_pool_complete_with_their_single_request_tokens(
    engine, prompts, reference, coupled_reference, monkeypatch
):
    """Two long rows need 11 blocks of the 10: the newer (sampled, seeded, coupled) is preempted, and resumed by
    recomputing its prompt and tokens; each request's tokens are those it gets alone (greedy: the single-request
    reference; coupled: plain coupled sampling's)."""
    text = sum(prompts, [])
    assert len(text) >= 130
    sampling = Sampling(1.0)

    def batch():
        return [
            Request(text[:60], 24),
            Request(text[60:103], 24, RowSpec(sampling, seed=5, coupled=True)),
            Request(text[103:130], 20, RowSpec(sampling, seed=9)),
        ]

    before = engine.scheduler.preemptions
    alone = [serve(engine, [r], cache=False)[0] for r in batch()]
    assert engine.scheduler.preemptions == before
    preempted, preempt = [], engine.scheduler._preempt
    monkeypatch.setattr(
        engine.scheduler,
        "_preempt",
        lambda row: (preempted.append(engine.scheduler.slots[row].request.tokens[:]), preempt(row)),
    )
    together = serve(engine, batch(), cache=True)
    assert preempted and all(preempted)  # preempted while generating
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert together[0].tokens == reference(together[0].prompt, 24)
    assert together[1].tokens == coupled_reference(together[1].prompt, 24, together[1].spec)
    assert engine.scheduler.tables.pool.used == 0
