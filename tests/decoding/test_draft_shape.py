"""DraftShape: one value for a cycle's draft shape (chains, trees, plain decoding)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxspec.decoding.draft_shape import MAX_DRAFT_TOKENS, MAX_NUM_STEPS, DraftShape, num_candidates


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


@given(st.integers(1, MAX_NUM_STEPS), st.integers(1, 16), st.data())
def test_round_trips(steps, topk, data):
    most = min(num_candidates(topk, steps) + 1, MAX_DRAFT_TOKENS) if topk > 1 else steps + 1
    tokens = data.draw(st.integers(2, most)) if topk > 1 else None
    shape = DraftShape(steps, topk, tokens)
    assert DraftShape.parse(shape.label) == shape
    assert DraftShape.from_dict(shape.to_dict()) == shape
    assert DraftShape.of(shape) is shape and DraftShape.of(steps) == DraftShape(steps)
    assert shape.lookahead >= shape.verify_tokens >= 2
