"""Token logprobs in the loop itself (LoopConfig.logprobs on a per-row state), on the tiny random config with a random
drafter (the bundled pair is tested through the engine in tests/serving/test_logprobs.py): a greedy chain and a greedy
tree report what plain decoding reports, and all equal one full forward of the final sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import DraftShape
from jaxspec.decoding.generate import LoopCache
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.decoding.state import LoopConfig, LoopState, RowInit

CHUNK, CONTEXT, NEW = 8, 64, 12
PROMPTS = [[17, 4, 99, 3, 250, 8, 61, 7, 7, 120, 33], [5, 200, 9]]  # two prefill chunks, and one
_admit = jax.jit(LoopState.admit)


def decode(target, drafter, draft: DraftShape):
    """Admit and prefill every prompt row by row (as the serving executor does), run until done; returns host
    (tokens [B, S], end [B], token logprobs [B, S], top ids [B, S, N])."""
    drafter = None if draft.plain else drafter
    loop = LoopCache.of(target).loop(target, drafter)
    cfg = LoopConfig(draft, None, (), CHUNK, CHUNK, logprobs=True)
    params = target.params, drafter.params if drafter is not None else None
    state = LoopState.empty(target, drafter, draft, len(PROMPTS), CONTEXT, per_row=True, logprobs=True)
    for row, prompt in enumerate(PROMPTS):
        init = RowInit.of(prompt, NEW, RowSpec(seed=row, logprobs=True), CONTEXT)
        state = _admit(state, np.int32(row), init)
        for start in range(0, len(prompt), CHUNK):
            state = loop.prefill_slot(cfg, *params, state, np.int32(row), np.int32(start))
    state = loop.run(cfg, *params, state, jnp.int32(NEW + 1))
    return tuple(
        np.asarray(x) for x in (state.tokens_BS, state.end_B, state.logprobs.token_BS, state.logprobs.top_ids_BSN)
    )


@pytest.fixture(scope="module")
def plain(target):
    return decode(target, None, DraftShape(0))


# the chain with -m slow (~16 s, test budget: serving's logprobs test runs a chain)
@pytest.mark.parametrize(
    "draft",
    [
        pytest.param(DraftShape(3), marks=pytest.mark.slow, id="chain"),
        pytest.param(DraftShape(3, topk=2, num_draft_tokens=6), id="tree"),
    ],
)
def test_greedy_speculative_logprobs_equal_plain_and_one_full_forward(target, drafter, plain, draft):
    tokens, end, token_lp, top_ids = decode(target, drafter, draft)
    want_tokens, want_end, want_lp, want_ids = plain
    np.testing.assert_array_equal(end, want_end)
    for row, prompt in enumerate(PROMPTS):
        n = end[row]
        np.testing.assert_array_equal(tokens[row, :n], want_tokens[row, :n])
        # position p scores token p + 1: the prompt's tokens 1.. (echo) and every generated token
        np.testing.assert_allclose(token_lp[row, : n - 1], want_lp[row, : n - 1], atol=1e-4)
        np.testing.assert_array_equal(top_ids[row, : n - 1, :5], want_ids[row, : n - 1, :5])
        forward = np.asarray(jax.nn.log_softmax(target.logits([tokens[row, :n].tolist()])[0], axis=-1))
        scored = forward[np.arange(n - 1), tokens[row, 1:n]]
        np.testing.assert_allclose(token_lp[row, : n - 1], scored, atol=1e-4)
        assert (
            n - len(prompt) == NEW and (top_ids[row, len(prompt) - 1 : n - 1, 0] == tokens[row, len(prompt) : n]).all()
        )
