"""The cache pool striped by position over 8 devices (`--dcp 8`, models/dcp.py) on the bundled pair on a 1x8 mesh:
prefix hits and preemption give the single-request tokens, as with the unstriped pool (the same tests as
test_engine_pool.py, on a striped engine: a block's positions are striped, its table entry and hash unchanged)."""

import pytest

from jaxspec import bundled
from jaxspec.serving.engine import Engine
from sharding.mesh import make_mesh
from tests.serving.test_engine_pool import (  # noqa: F401  (collected here with this module's engine)
    POOL,
    test_prefix_hits_give_the_cold_greedy_and_sampled_tokens,
    test_requests_needing_more_than_the_pool_complete_with_their_single_request_tokens,
)

pytestmark = pytest.mark.slow  # the bundled pair on 8 devices, compiled again


@pytest.fixture(scope="module")
def engine():
    target, drafter, tokenizer = bundled.load_pair(mesh=make_mesh("1x8"))
    engine = Engine(target.with_dcp(8), drafter, POOL, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    return engine
