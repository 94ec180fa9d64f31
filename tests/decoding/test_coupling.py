"""Coupled sampling (decoding/coupling.py): a seeded row's tokens are those of plain sampling with its seed, whatever
the draft shape, the drafter or the batch, and they follow the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import coupling
from jaxspec.decoding.generate import generate
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import derive_seed
from tests.decoding.support import NEW, PROMPTS, OracleDrafter, check_pairs_follow_target, random_drafter

SETTINGS = dict(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def plain(peaky):
    """Coupled plain sampling of the batch of 3 (seed 11): the tokens every draft shape must give."""
    return generate(peaky, None, PROMPTS[3], max_new_tokens=NEW, num_steps=0, seed=11, sampling="coupled", **SETTINGS)


def oracle(target, prompts, continuations, decoy_every: int) -> OracleDrafter:
    """Proposes the coupled plain continuation (a wrong token first at every `decoy_every`-th position)."""
    table = np.zeros((len(prompts), max(len(p) for p in prompts) + NEW + 8), np.int32)
    for i, (p, r) in enumerate(zip(prompts, continuations, strict=True)):
        table[i, : len(p) + len(r)] = p + r
    return OracleDrafter(target, table, decoy_every=decoy_every)


# Default suite: a chain with the mostly-right drafter (~25 s; trees run coupled in test_engine_tree's default test);
# -m slow adds a tree, more shapes and a drafter that is mostly wrong (every token then a correction).
@pytest.mark.parametrize(
    "draft, wrong",
    [
        (dict(num_steps=3), False),
        pytest.param(dict(num_steps=3, topk=2, num_draft_tokens=7), False, marks=pytest.mark.slow),
        pytest.param(dict(num_steps=1), True, marks=pytest.mark.slow),
        pytest.param(dict(num_steps=3), True, marks=pytest.mark.slow),
        pytest.param(dict(num_steps=4, topk=3, num_draft_tokens=10), True, marks=pytest.mark.slow),
    ],
)
def test_coupled_tokens_do_not_depend_on_the_draft(peaky, plain, draft, wrong):
    """Chains and trees, with a drafter that is mostly right (its drafts are accepted, and corrected at its decoys)
    or one that is mostly wrong: every row's tokens are coupled plain sampling's."""
    drafter = random_drafter(peaky) if wrong else oracle(peaky, PROMPTS[3], plain.tokens, decoy_every=3)
    out = generate(peaky, drafter, PROMPTS[3], max_new_tokens=NEW, seed=11, sampling="coupled", **SETTINGS, **draft)
    assert out.tokens == plain.tokens
    if not wrong:
        assert out.stats["accepted"][0] > 0.5 * out.stats["reached"][0], "the oracle's drafts must be accepted"


@pytest.mark.slow  # ~25 s; the server's n = 3 against n = 1 runs in test_seeded_server's default test
def test_each_row_is_its_seed_alone(peaky, plain):
    """Row j of a batch samples what the same prompt alone does with seed derive_seed(seed, j) (row 0: the seed);
    rejection sampling's tokens differ from coupled ones (the modes are not the same draws)."""
    for j, prompt in enumerate(PROMPTS[3]):
        alone = generate(
            peaky, None, [prompt], max_new_tokens=NEW, num_steps=0, seed=derive_seed(11, j), sampling="coupled",
            **SETTINGS,
        )  # fmt: skip
        assert alone.tokens[0] == plain.tokens[j]
    rejection = generate(peaky, None, PROMPTS[3], max_new_tokens=NEW, num_steps=0, seed=11, **SETTINGS)
    assert rejection.tokens != plain.tokens


@pytest.mark.slow  # ~25 s; a static-greedy program has no coupling to apply (`spec_loop._coupling`)
def test_greedy_is_greedy_either_way(target, drafter):
    prompts = PROMPTS[3]
    ref = generate(target, None, prompts, max_new_tokens=NEW, num_steps=0).tokens
    assert generate(target, drafter, prompts, max_new_tokens=NEW, num_steps=2, sampling="coupled").tokens == ref


def test_coupled_sampling_follows_the_target(peaky):
    """Chi-square over (first, second) tokens of 8,000 rows (each its own seed): the first from the prefill, the
    second from a verify whose draft (the target's greedy token, proposed with the row's noise) is often accepted."""
    target, prompt, n = peaky, [17, 4, 99], 8_000
    table = np.zeros((n, 32), np.int32)
    table[:, :7] = prompt + generate(target, None, [prompt], max_new_tokens=4, num_steps=0).tokens[0]
    out = generate(target, OracleDrafter(target, table), [prompt] * n, max_new_tokens=2, num_steps=2, seed=3,
                   sampling="coupled", temperature=1.0)  # fmt: skip
    pairs = np.array([t for t in out.tokens if len(t) == 2])
    assert len(pairs) > 0.9 * n
    check_pairs_follow_target(target, prompt, pairs, Sampling(1.0))
    assert out.stats["accepted"][0] > 0.1 * out.stats["reached"][0], "drafts must be accepted, not only corrected"


def test_noise_is_keyed_by_the_row_key_and_index_alone():
    keys = jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32))
    at = jnp.array([[5, 6], [5, 9], [5, 6]], jnp.int32)
    g = np.asarray(coupling.noise(keys, at, 64))
    again = np.asarray(coupling.noise(keys[::-1], at[::-1], 64))[::-1]  # another batch order: the same rows' noise
    np.testing.assert_array_equal(g, again)
    assert not np.array_equal(g[0, 0], g[0, 1]) and not np.array_equal(g[0, 0], g[1, 0])  # per index, per row
    ones = jax.vmap(jax.random.key)(jnp.zeros(2, jnp.uint32))
    single = np.asarray(coupling.noise(ones[:1], at[:1, :1], 64))
    np.testing.assert_array_equal(single[0, 0], np.asarray(coupling.noise(ones, at[:2, :1], 64))[1, 0])


def test_select_runs_the_coupled_side_only_for_coupled_rows():
    rows = jnp.array([True, False, True])
    c = coupling.Coupling(jnp.zeros(3), rows)
    got = coupling.select(c, lambda: jnp.full((3, 2), 1), lambda: jnp.full((3, 2), 2))
    np.testing.assert_array_equal(np.asarray(got)[:, 0], [1, 2, 1])
    everyone = coupling.Coupling(jnp.zeros(3), None)
    assert int(coupling.select(everyone, lambda: jnp.int32(1), lambda: jnp.int32(2))) == 1


def test_a_bad_mode_is_refused_by_name(target):
    with pytest.raises(ValueError, match="sampling: expected one of rejection, coupled, got 'gumbel'"):
        generate(target, None, [[1, 2]], max_new_tokens=2, num_steps=0, sampling="gumbel")
