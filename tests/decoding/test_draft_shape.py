"""DraftShape: one value for a cycle's draft shape (chains, trees, plain decoding)."""

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.decoding.draft_shape import MAX_DRAFT_TOKENS, MAX_NUM_STEPS, DraftShape, num_candidates
from jaxspec.decoding.generate import LoopCache
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.state import LoopConfig, LoopState
from sharding.multihost import to_host


@pytest.mark.parametrize(
    "shape, tree, verify, lookahead, label",
    [
        (DraftShape(0), False, 1, 1, "k=0"),
        (DraftShape(3), False, 4, 4, "k=3"),
        (DraftShape(3, 1, 4), False, 4, 4, "k=3"),
        (DraftShape(4, 2, 8), True, 8, 8, "tree 4x2/8"),
        (DraftShape(3, 2), True, 11, 11, "tree 3x2/11"),  # every candidate: 2 + 2 * 4 = 10, plus the root
        (DraftShape(2, 2, 2), True, 2, 3, "tree 2x2/2"),  # draft-extend writes num_steps + 1 slots
        (DraftShape(16, 4), True, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, f"tree 16x4/{MAX_DRAFT_TOKENS}"),
    ],
)
def test_shape_properties(shape, tree, verify, lookahead, label):
    assert (shape.tree, shape.verify_tokens, shape.lookahead, shape.label) == (tree, verify, lookahead, label)
    assert shape.num_draft_tokens == verify
    assert DraftShape.parse(shape.label) == shape == DraftShape.parse(shape.spec)


@pytest.mark.parametrize(
    "args, field",
    [
        ((-1,), "num_steps"),
        ((MAX_NUM_STEPS + 1,), "num_steps"),
        ((True,), "num_steps"),
        ((3, 0), "topk"),
        ((0, 2), "topk=2 drafts a tree"),
        ((3, 1, 3), "a chain"),
        ((3, 2, 1), "num_draft_tokens"),
        ((1, 2, 4), "num_draft_tokens"),  # one step of topk 2 holds 2 candidates: at most 3 tokens
        ((3, 2, "8"), "num_draft_tokens"),
    ],
)
def test_bad_shapes_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        DraftShape(*args)


@pytest.mark.parametrize("text", ["", "x", "1:2", "3:2:8:1", "k=a"])
def test_parse_refuses(text):
    with pytest.raises(ValueError, match="expected K or STEPS:TOPK:TOKENS"):
        DraftShape.parse(text)


def test_drafter_vocabulary_limits_topk():
    DraftShape(2, 4).check_drafter(4)
    with pytest.raises(ValueError, match="draft vocabulary"):
        DraftShape(2, 4).check_drafter(3)


@settings(deadline=None)  # pure Python, but the suite's two workers share two cores
@given(st.integers(1, MAX_NUM_STEPS), st.integers(1, 16), st.data())
def test_round_trips(steps, topk, data):
    most = min(num_candidates(topk, steps) + 1, MAX_DRAFT_TOKENS) if topk > 1 else steps + 1
    tokens = data.draw(st.integers(2, most)) if topk > 1 else None
    shape = DraftShape(steps, topk, tokens)
    assert DraftShape.parse(shape.label) == shape
    assert DraftShape.from_dict(shape.to_dict()) == shape
    assert DraftShape.of(shape) is shape and DraftShape.of(steps) == DraftShape(steps)
    assert shape.lookahead >= shape.verify_tokens >= 2


@pytest.mark.parametrize("shape", [DraftShape(3), DraftShape(2, topk=2, num_draft_tokens=6)], ids=str)
def test_reach_bounds_what_the_loop_writes(target, drafter, shape):
    """`DraftShape.reach` against the loop's own bookkeeping, one cycle at a time: a cycle at length n writes below
    n + lookahead + 1 (cache slots to n + lookahead, the token buffer to n + num_steps + 2), and after c cycles every
    row's writes stay inside the reach it had before the first (its prompt and first token, its budget, c cycles),
    and inside its whole budget's reach however many cycles run (done rows ride along at their length)."""
    prompts, max_new = [[1, 2, 3, 4, 5], [7] * 9], 11
    loop = LoopCache.of(target).loop(target, drafter)
    cfg = LoopConfig(shape, Sampling(), (), 16, 16)
    params = target.params, drafter.params
    state = LoopState.empty(target, drafter, shape, 2, 64, greedy=True).with_prompts(prompts, max_new)
    state = loop.prefill(cfg, *params, state)
    lengths = []  # each cycle's starting lengths
    while len(lengths) < 2 * max_new:
        length_B, done_B = to_host((state.length_B, state.done_B))
        if done_B.all():
            break
        lengths.append(length_B.copy())
        state = loop.run(cfg, *params, state, jnp.int32(1))
    assert len(lengths) > 2
    for row, prompt in enumerate(prompts):
        tokens, budget = len(prompt) + 1, len(prompt) + max_new  # after the prefill: the prompt and its first token
        wrote = [int(n[row]) + shape.lookahead + 1 for n in lengths]
        for c in range(1, len(wrote) + 1):
            assert max(wrote[:c]) <= shape.reach(tokens, budget, c), (row, c, wrote)
        assert max(wrote) <= shape.reach(tokens, budget)
    assert shape.reach(10, 12, 1) == 10 + shape.lookahead + 1 and shape.reach(10, 12) == 12 + shape.lookahead + 1
