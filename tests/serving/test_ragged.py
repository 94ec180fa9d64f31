"""Rows of different lengths in one batch: attention reads each row's own cache blocks as far as its own length, so a
long row beside short ones changes none of their tokens (float32, the bundled pair): each row, greedy or seeded
sampled, gets the tokens it gets alone."""

import dataclasses

import pytest

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.engine import EngineConfig, Request
from tests.serving.support import warm_engine

# 4 slots of 256 positions, one batch bucket, the per-row program only (few programs to compile).
CONFIG = EngineConfig(
    max_batch=4,
    max_context=256,
    draft=DraftShape(3),
    prefill_chunk=32,
    segment_cycles=2,
    batch_buckets=(4,),
    greedy_program=False,
)


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


def run(engine, requests: list[Request]) -> list[list[int]]:
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    assert all(r.finish_reason in ("stop", "length") for r in requests)
    return [r.tokens for r in requests]


def test_a_long_row_beside_short_ones_changes_none_of_their_tokens(engine, prompts):
    long = (sum(prompts, []) * 2)[:200]  # 200 prompt tokens; the short ones have 5, 9 and 12
    specs = [RowSpec(), RowSpec(Sampling(0.9, top_p=0.95), seed=4), RowSpec(), RowSpec(Sampling(1.0), seed=9)]
    batch = [long, prompts[0], prompts[4], prompts[7]]
    make = lambda: [Request(p, 24, s) for p, s in zip(batch, specs, strict=True)]  # noqa: E731
    together = run(engine, make())
    alone = [run(engine, [r])[0] for r in make()]
    assert together == alone
    assert len(set(map(tuple, together))) == 4 and all(len(t) == 24 for t in together)


def test_the_config_has_no_context_size():
    """Segments have one size per batch bucket: the engine's config names no context buckets."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "context_buckets" not in fields and not hasattr(CONFIG, "contexts")
