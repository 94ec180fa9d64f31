"""`LoopState` owns its layout: one constructor, row windows and row writes read each field's declared axes."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.decoding import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import MAX_STOP_IDS, RowSpec
from jaxspec.decoding.state import LoopConfig, LoopState, RowInit

B, S = 4, 32


@pytest.fixture(scope="module")
def empty(target, drafter):
    return LoopState.empty(target, drafter, DraftShape(2), B, S, per_row=True, seed=3)


def _numbered(state: LoopState) -> LoopState:
    """Every leaf filled with distinct values (so a misplaced slice shows)."""
    leaves, tree = jax.tree.flatten(state)
    out = []
    for i, x in enumerate(leaves):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            out.append(x)
            continue
        out.append(np.arange(x.size).reshape(x.shape).astype(x.dtype) + np.asarray(i * 1000, x.dtype))
    return jax.tree.unflatten(tree, out)


def _bump(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return ~x if x.dtype == bool else x + np.asarray(1, x.dtype)


def test_empty_declares_every_row_free_with_the_shapes_of_its_draft(empty, target, drafter):
    assert empty.tokens_BS.shape == (B, S) and bool(np.asarray(empty.done_B).all())
    assert empty.target_cache.shape[1:3] == (B, S) and all(c.shape[:2] == (B, S) for c in empty.draft_cache)
    assert empty.reached_J.shape == (2,) and empty.accept_hist_T.shape == (3,)
    assert empty.draft_q_BV.shape == (B, target.vocab_size)  # per-row: a sampled chain keeps its distribution
    assert empty.settings.stop_ids.shape == (B, MAX_STOP_IDS) and empty.key.shape == (B,)
    greedy_plain = LoopState.empty(target, None, DraftShape(0), B, S, greedy=True)
    assert greedy_plain.draft_cache is None and greedy_plain.draft_q_BV.shape == (B, 1) and greedy_plain.key.ndim == 0
    tree = LoopState.empty(target, drafter, DraftShape(2, topk=2), B, S, greedy=True)
    assert tree.draft_q_BV.shape == (B, drafter.config.draft_vocab_size)  # the next root's draft logits


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, B), positions=st.integers(1, S), start=st.integers(0, B - 1))
def test_window_then_put_writes_back_exactly_that_window(empty, rows, positions, start):
    start = min(start, B - rows)
    state = _numbered(empty)
    part = state.window(rows, positions, start)
    for f in dataclasses.fields(LoopState):
        row, pos = f.metadata["row_axis"], f.metadata["position_axis"]
        for x, y in zip(jax.tree.leaves(getattr(state, f.name)), jax.tree.leaves(getattr(part, f.name)), strict=True):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                continue
            want = np.asarray(x)
            if pos is not None:
                want = np.take(want, range(positions), axis=pos)
            if row is not None and want.ndim:
                want = np.take(want, range(start, start + rows), axis=row)
            np.testing.assert_array_equal(np.asarray(y), want, err_msg=f.name)
    # Change the window, write it back: only the window changes (counters are the part's).
    changed = jax.tree.map(_bump, part)
    back = state.put(changed, start)
    tokens, new = np.asarray(state.tokens_BS), np.asarray(back.tokens_BS)
    inside = np.zeros((B, S), bool)
    inside[start : start + rows, :positions] = True
    np.testing.assert_array_equal(new[inside], tokens[inside] + 1)
    np.testing.assert_array_equal(new[~inside], tokens[~inside])
    assert int(back.cycles) == int(state.cycles) + 1


def test_admit_writes_one_row_and_leaves_it_done_until_prefilled(empty):
    init = RowInit.of([5, 6, 7], 9, RowSpec(Sampling(0.7, top_k=4, top_p=0.9), (11, 12), seed=42), context=S)
    state = jax.jit(lambda s: s.admit(2, init))(empty)
    assert np.asarray(state.tokens_BS)[2, :4].tolist() == [5, 6, 7, 0]
    assert (int(state.prompt_len_B[2]), int(state.length_B[2]), int(state.end_B[2])) == (3, 3, 4)
    assert int(state.max_new_B[2]) == 9 and bool(state.done_B[2])
    assert np.asarray(state.settings.stop_ids)[2].tolist() == [11, 12] + [-1] * (MAX_STOP_IDS - 2)
    row_sampling = state.settings.sampling
    assert float(row_sampling.temperature_B[2]) == pytest.approx(0.7) and int(row_sampling.top_k_B[2]) == 4
    key = jax.random.key_data(state.key)
    np.testing.assert_array_equal(key[2], jax.random.key_data(jax.random.key(42)))
    np.testing.assert_array_equal(np.delete(key, 2, 0), np.delete(jax.random.key_data(empty.key), 2, 0))
    for name in ("tokens_BS", "prompt_len_B", "max_new_B"):  # the other rows are untouched
        np.testing.assert_array_equal(
            np.delete(np.asarray(getattr(state, name)), 2, 0), np.delete(np.asarray(getattr(empty, name)), 2, 0)
        )


def test_with_prompts_pads_the_batch_with_done_rows(target):
    state = LoopState.empty(target, None, DraftShape(0), B, S, greedy=True).with_prompts([[1, 2], [3, 4, 5]], 7)
    assert np.asarray(state.prompt_len_B).tolist() == [2, 3, 1, 1]
    assert np.asarray(state.done_B).tolist() == [False, False, True, True]
    assert np.asarray(state.tokens_BS)[1, :3].tolist() == [3, 4, 5] and int(state.max_new_B[0]) == 7


def test_loop_config_takes_one_draft_shape():
    cfg = LoopConfig(DraftShape(4, topk=2, num_draft_tokens=8), None, (0,), 16, 16)
    assert (cfg.num_steps, cfg.topk, cfg.tree, cfg.num_draft_tokens) == (4, 2, True, 8)
    assert LoopConfig(DraftShape(3), None, (), 16, 16).num_draft_tokens == 4  # a chain verifies k + 1
    with pytest.raises(ValueError, match="LoopConfig.draft: expected a DraftShape"):
        LoopConfig(3, None, (), 16, 16)


def test_generate_takes_the_draft_shape_as_one_value(target, drafter):
    from jaxspec.decoding.generate import generate

    kwargs = dict(prompts=[[1, 2, 3]], max_new_tokens=6)
    by_keywords = generate(target, drafter, num_steps=2, **kwargs)
    by_shape = generate(target, drafter, draft=DraftShape(2), **kwargs)
    assert by_shape.tokens == by_keywords.tokens and by_shape.stats["compiles"] == 0  # the same program
    assert by_shape.stats["draft"] == "k=2" and generate(target, drafter, draft=2, **kwargs).tokens == by_shape.tokens
    for bad in ("3", True, 2.0):
        with pytest.raises(ValueError, match="draft: expected a DraftShape or a chain's depth"):
            generate(target, drafter, draft=bad, **kwargs)
    with pytest.raises(ValueError, match="num_steps=2 needs a drafter"):
        generate(target, None, draft=DraftShape(2), **kwargs)
