"""The compiled draft-verify loop: lossless against plain decoding, acceptance bookkeeping, buckets, bad input."""

import math

import numpy as np
import pytest

from jaxspec.decoding.generate import generate
from jaxspec.decoding.sampling import Sampling
from sharding.mesh import make_mesh
from tests.decoding.support import (
    NEW,
    PROMPTS,
    OracleDrafter,
    check_pairs_follow_target,
    random_drafter,
    stop_mid_batch,
)


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy outputs per batch size, and a stop id that ends the middle sequence half way."""
    out = {n: generate(target, None, p, max_new_tokens=NEW, num_steps=0).tokens for n, p in PROMPTS.items()}
    return out


def check_lossless(target, drafter, n, k, plain):
    stop = stop_mid_batch(plain[n])
    ref = generate(target, None, PROMPTS[n], max_new_tokens=NEW, num_steps=0, stop=stop).tokens
    assert any(len(t) < NEW for t in ref), "the stop id must end a sequence early"
    out = generate(target, drafter, PROMPTS[n], max_new_tokens=NEW, num_steps=k, stop=stop)
    assert out.tokens == ref
    return out


# k = 2, 5, 6 run with -m slow (~7-13 s each; test_greedy_full_sweep covers every k on 1 and 8 devices there)
@pytest.mark.parametrize("k", [1, 3, 4, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 5, 6))])
def test_greedy_speculative_equals_plain_batch3(target, drafter, plain, k):
    out = check_lossless(target, drafter, 3, k, plain)
    s = out.stats
    assert len(s["reached"]) == k and s["reached"][0] == sum(s["accepted_length_histogram"])


@pytest.mark.parametrize("n", [1, 8])
def test_greedy_speculative_equals_plain_other_batches(target, drafter, plain, n):
    check_lossless(target, drafter, n, 3, plain)


# -m slow: both meshes (~19 s and ~30 s; test budget; test_sharded_target keeps 1x8 in the default suite)
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.slow) for m in ("1x8", "2x4")])
def test_greedy_on_mesh_equals_single_device(target, plain, mesh):
    sharded = target.on_mesh(make_mesh(mesh))
    check_lossless(sharded, random_drafter(sharded), 8, 2, plain)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, "1x8"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("k", range(1, 7))
def test_greedy_full_sweep(target, plain, mesh, n, k):
    t = target if mesh is None else target.on_mesh(make_mesh(mesh))
    check_lossless(t, random_drafter(t), n, k, plain)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])  # k=1: ~19 s, -m slow
def test_oracle_drafter_accepts_everything(target, plain, k):
    prompts = PROMPTS[3]
    ref = generate(target, None, prompts, max_new_tokens=NEW + k + 1, num_steps=0).tokens
    width = max(len(p) for p in prompts) + NEW + k + 4
    table = np.zeros((4, width), np.int32)
    for i, (p, r) in enumerate(zip(prompts, ref, strict=True)):
        table[i, : len(p) + len(r)] = p + r
    out = generate(target, OracleDrafter(target, table), prompts, max_new_tokens=NEW, num_steps=k)
    assert out.tokens == [r[:NEW] for r in ref]
    s = out.stats
    assert s["accepted"] == s["reached"] and s["accepted_length_histogram"][:-1] == [0] * k
    # The first token comes from prefill; each cycle then emits k + 1 (the last one is cut at the budget).
    assert s["cycles"] == math.ceil((NEW - 1) / (k + 1))


def test_progress_hook_sees_counters_and_finished_prompts(target, drafter, plain):
    """on_progress gets cumulative tokens/cycles/counters every stream_cycles cycles; the last call matches the
    final stats, and `done` flags prompts as they finish."""
    stop = stop_mid_batch(plain[3])
    seen = []
    kwargs = dict(max_new_tokens=NEW, num_steps=2, stop=stop, stream_cycles=2)
    out = generate(target, drafter, PROMPTS[3], **kwargs, on_progress=seen.append)
    assert out.tokens == generate(target, drafter, PROMPTS[3], **kwargs).tokens  # the hook changes nothing
    assert len(seen) >= 3 and [p.cycles for p in seen[:-1]] == [2 * (i + 1) for i in range(len(seen) - 1)]
    for prev, cur in zip(seen, seen[1:], strict=False):
        assert all(len(a) <= len(b) and b[: len(a)] == a for a, b in zip(prev.tokens, cur.tokens, strict=True))
        assert (cur.reached >= prev.reached).all() and (cur.accepted >= prev.accepted).all()
    last = seen[-1]
    assert last.tokens == out.tokens and last.cycles == out.stats["cycles"] and all(last.done)
    assert last.reached.tolist() == out.stats["reached"] and last.accepted.tolist() == out.stats["accepted"]
    for p in seen:  # a prompt flagged done has its final tokens
        assert all(t == final for t, final, d in zip(p.tokens, out.tokens, p.done, strict=True) if d)
    assert any(any(p.done) and not all(p.done) for p in seen)  # the stop id ends a prompt before the others


def test_new_prompt_length_in_bucket_does_not_recompile(target, drafter):
    first = generate(target, drafter, [[5, 6, 7]], max_new_tokens=8, num_steps=2)
    again = generate(target, drafter, [[9, 8, 7, 6, 5, 4, 3]], max_new_tokens=10, num_steps=2)
    assert first.stats["buckets"] == again.stats["buckets"]
    assert again.stats["compiles"] == 0


# Default suite: the random drafter at temperature 1 (the oracle with top-p runs at loop level for trees in
# test_tree_loop); the other three combinations run with -m slow (each case costs ~30-40 s of the 20-minute budget).
@pytest.mark.parametrize(
    "which, sampling",
    [
        ("random", dict(temperature=1.0)),
        pytest.param("oracle", dict(temperature=1.0, top_p=0.6), marks=pytest.mark.slow),
        pytest.param("random", dict(temperature=1.0, top_p=0.6), marks=pytest.mark.slow),
        pytest.param("oracle", dict(temperature=1.0), marks=pytest.mark.slow),
    ],
)
def test_sampling_is_lossless(peaky, sampling, which):
    """The (first, second) generated tokens follow the target's distribution; the second is the first token drawn
    inside the loop (after a draft and a verify), the first comes from prefill."""
    target, prompt, n = peaky, [17, 4, 99], 20_000
    if which == "random":
        d = random_drafter(target)
    else:  # a drafter that always proposes the target's greedy token: q is (nearly) a point mass
        table = np.zeros((n, 32), np.int32)
        table[:, :7] = prompt + generate(target, None, [prompt], max_new_tokens=4, num_steps=0).tokens[0]
        d = OracleDrafter(target, table)
    out = generate(target, d, [prompt] * n, max_new_tokens=2, num_steps=2, seed=3, **sampling)
    pairs = np.array([t for t in out.tokens if len(t) == 2])  # a sequence whose first token is eos stops there
    assert len(pairs) > 0.9 * n

    check_pairs_follow_target(target, prompt, pairs, Sampling(**sampling))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[[]]), "prompts\\[0\\] is empty"),
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 300]]), "token ids must be in \\[0, 256\\)"),
        (dict(prompts=[[1] * 1020]), "exceeds the context of 1024"),
        # a tree's lookahead counts (its 6 verified nodes), as serving counts it: 1010 + 10 + 7 > 1024
        (dict(prompts=[[1] * 1010], max_new_tokens=10, topk=2, num_draft_tokens=6), "\\+ 7 for drafting tree 2x2/6"),
        (dict(num_steps=-1), "num_steps: expected an integer in \\[0, 16\\]"),
        (dict(num_steps=17), "num_steps: expected an integer in \\[0, 16\\]"),
        (dict(temperature=-0.5), "temperature: expected >= 0"),
        (dict(temperature=1.0, top_p=0.0), "top_p: expected a value in \\(0, 1\\]"),
        (dict(temperature=1.0, top_p=1.5), "top_p: expected a value in \\(0, 1\\]"),
        (dict(prompts=["hello"]), "pass tokenizer="),
        (dict(max_new_tokens=0), "max_new_tokens: expected an integer >= 1"),
        (dict(stream_cycles=0), "stream_cycles: expected an integer >= 1"),
    ],
)
def test_bad_input_fails_before_compiling(target, drafter, kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=8, num_steps=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, **args)


def test_steps_without_drafter(target):
    with pytest.raises(ValueError, match="num_steps=2 needs a drafter"):
        generate(target, None, [[1, 2]], num_steps=2)
