"""A request's speculation counts (speculation.py) and their vLLM-shaped object, as a scenario table: per-position
accepted counts determine the accepted-length histogram exactly, plain cycles are no verify steps, a tree drafts its
nodes past the root, and several choices add up."""

import pytest

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.serving.speculation import Speculation

TREE = DraftShape(3, topk=2, num_draft_tokens=6)

# (segments: (shape, cycles, accepted per position), the object's expected fields)
SCENARIOS = {
    "chain": (
        [(DraftShape(3), 4, (3, 2, 1))],  # steps accepting 3, 2, 1, 0 drafts
        dict(acceptance_histogram=[1, 1, 1, 1], num_spec_steps=4, num_accepted_draft_tokens=6, num_draft_tokens=12),
    ),
    "chains of two depths and plain cycles": (
        [(DraftShape(3), 2, (2, 1, 0)), (DraftShape(0), 5, (0, 0, 0)), (DraftShape(1), 3, (1, 0, 0))],
        dict(
            acceptance_histogram=[2, 2, 1, 0],
            num_spec_steps=5,
            num_accepted_draft_tokens=4,
            num_draft_tokens=9,
            draft_shapes={"chain k=3": 2, "plain": 5, "chain k=1": 3},
            mean_acceptance_length=1.8,
        ),
    ),
    "tree": (
        [(TREE, 2, (2, 2, 1))],  # paths of 3 and 2 drafts; 5 nodes verified per step
        dict(acceptance_histogram=[0, 0, 1, 1], num_draft_tokens=10, draft_shapes={"tree 3x2/6": 2}),
    ),
    "plain only": (
        [(DraftShape(0), 7, (0, 0, 0))],
        dict(
            acceptance_histogram=[0, 0, 0, 0],
            num_spec_steps=0,
            mean_acceptance_length=1.0,
            draft_acceptance_rate=0.0,
            draft_shapes={"plain": 7},
        ),
    ),
}


@pytest.mark.parametrize("segments, want", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_the_object_from_per_position_counts(segments, want):
    spec = Speculation(3)
    for shape, cycles, accepted in segments:
        spec = spec.plus(shape, cycles, accepted)
    out = spec.to_dict()
    assert {k: out[k] for k in want} == want
    hist = out["acceptance_histogram"]
    assert sum(hist) == out["num_spec_steps"] and out["num_spec_tokens"] == 3
    assert sum(j * c for j, c in enumerate(hist)) == out["num_accepted_draft_tokens"]
    both = Speculation.total([spec, spec]).to_dict()
    assert both["acceptance_histogram"] == [2 * c for c in hist]
    assert both["draft_shapes"] == {k: 2 * v for k, v in out["draft_shapes"].items()}


def test_counts_are_gains():
    with pytest.raises(ValueError, match="Speculation.plus: expected counts gained"):
        Speculation(3).plus(DraftShape(3), 1, (1, 0))
    with pytest.raises(ValueError, match="Speculation.plus: expected counts gained"):
        Speculation(3).plus(DraftShape(3), -1, (0, 0, 0))
    assert Speculation(3).plus(DraftShape(3), 0, (0, 0, 0)) == Speculation(3)
