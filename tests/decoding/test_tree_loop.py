"""Tree drafts in the compiled loop (`generate(..., topk=, num_draft_tokens=)`): greedy output equals plain greedy on
ragged batches on 1 and 8 devices; a drafter whose best guess is sometimes wrong shows the tree keeping the branch a
chain loses; tree sampling is distributed as the target; the drafter's tree step scores every node as a chain over
its own path would; bad settings are refused by name."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import tree as tr
from jaxspec.decoding.generate import generate
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.spec_loop import draft_tree
from jaxspec.io.drafter_config import draft_config_for
from jaxspec.runtime import Drafter
from sharding.mesh import make_mesh
from tests.decoding.support import NEW, OracleDrafter, check_pairs_follow_target, random_drafter, stop_mid_batch
from tests.decoding.support import PROMPTS as CHAIN_PROMPTS

PROMPTS = CHAIN_PROMPTS[8]  # the chain tests' batch of 8 and budget: their plain runs are compiled once per session


@pytest.fixture(scope="module")
def plain(target):
    """(the plain greedy continuations, a stop id that ends the middle prompt half way, plain greedy with that stop
    id: ragged ends)."""
    full = generate(target, None, PROMPTS, max_new_tokens=NEW, num_steps=0).tokens
    stop = stop_mid_batch(full)
    ref = generate(target, None, PROMPTS, max_new_tokens=NEW, num_steps=0, stop=stop).tokens
    assert any(len(t) < NEW for t in ref), "the stop id must end a sequence early"
    return full, stop, ref


def test_greedy_tree_equals_plain(target, drafter, plain):
    _, stop, ref = plain
    kwargs = dict(max_new_tokens=NEW, num_steps=2, topk=3, num_draft_tokens=5, stop=stop)
    out = generate(target, drafter, PROMPTS, **kwargs)
    assert out.tokens == ref
    s = out.stats
    assert s["topk"] == 3 and s["num_draft_tokens"] == 5
    assert len(s["reached"]) == 2 and s["reached"][0] == sum(s["accepted_length_histogram"])


@pytest.mark.slow  # the same with every candidate verified (num_draft_tokens default), ~30 s
def test_greedy_tree_all_candidates_equals_plain(target, drafter, plain):
    _, stop, ref = plain
    out = generate(target, drafter, PROMPTS, max_new_tokens=NEW, num_steps=3, topk=2, stop=stop)
    assert out.tokens == ref and out.stats["num_draft_tokens"] == 1 + 2 + 2 * 4


@pytest.mark.parametrize("mesh", ["1x8", pytest.param("2x4", marks=pytest.mark.slow)])  # 2x4: ~40 s, -m slow
def test_greedy_tree_on_eight_devices_equals_plain(target, plain, mesh):
    sharded = target.on_mesh(make_mesh(mesh))
    _, stop, ref = plain
    out = generate(sharded, random_drafter(sharded), PROMPTS, max_new_tokens=NEW, num_steps=2, topk=2, stop=stop)
    assert out.tokens == ref


def oracle(target, prompts, continuations) -> OracleDrafter:
    """Every third guess ranks a wrong token first and the right one (the plain continuation) second."""
    table = np.zeros((len(prompts), max(len(p) for p in prompts) + NEW + 8), np.int32)
    for i, (p, r) in enumerate(zip(prompts, continuations, strict=True)):
        table[i, : len(p) + len(r)] = p + r
    return OracleDrafter(target, table, decoy_every=3)


@pytest.mark.parametrize("mesh", [None, pytest.param("1x8", marks=pytest.mark.slow)])  # 1x8: ~40 s, -m slow
def test_tree_keeps_the_branch_a_chain_loses(target, plain, mesh):
    """The chain is rejected at every decoy; the tree (topk 2) accepts through its second branches, so its accepted
    path leaves node order and its cache entries must be compacted. Both equal plain greedy (ragged ends: a stop id
    ends the middle prompt half way)."""
    t = target if mesh is None else target.on_mesh(make_mesh(mesh))
    full, stop, ref = plain
    drafter = oracle(t, PROMPTS, full)
    chain = generate(t, drafter, PROMPTS, max_new_tokens=NEW, num_steps=3, stop=stop)
    tree = generate(t, drafter, PROMPTS, max_new_tokens=NEW, num_steps=3, topk=2, num_draft_tokens=7, stop=stop)
    assert chain.tokens == ref and tree.tokens == ref
    c, s = chain.stats, tree.stats
    # Any 3 consecutive drafts meet a decoy: the chain never accepts its third. The tree accepts all three in every
    # cycle but a row's last (whose drafts may run past the table or the stop).
    assert c["accepted"][-1] == 0 and s["accepted"][-1] >= s["reached"][0] - len(PROMPTS) > 0
    assert s["cycles"] < c["cycles"]


def test_tree_sampling_is_lossless(peaky):
    """(first, second) generated tokens follow the target's warped distribution. The second comes from the first
    cycle's tree walk; the oracle's tree holds the target's greedy token and a decoy under every node, so the walk
    accepts a child (either of two ranks) or falls back to the target's residual."""
    target, prompt, n = peaky, [17, 4, 99], 4_000
    sampling = dict(temperature=1.0, top_p=0.8)
    table = np.zeros((n, 32), np.int32)
    table[:, :7] = prompt + generate(target, None, [prompt], max_new_tokens=4, num_steps=0).tokens[0]
    oracle = OracleDrafter(target, table, decoy_every=1)
    out = generate(target, oracle, [prompt] * n, max_new_tokens=2, num_steps=2, topk=2, seed=5, **sampling)
    pairs = np.array([t for t in out.tokens if len(t) == 2])
    assert len(pairs) > 0.9 * n

    check_pairs_follow_target(target, prompt, pairs, Sampling(**sampling))
    assert out.stats["accepted"][0] > 0.1 * out.stats["reached"][0], "the walk must accept children, not only fall back"


def mla_drafter(target) -> Drafter:
    cfg = draft_config_for(target.config)
    mla = target.config.replace(hidden_size=cfg.hidden_size, q_lora_rank=24, kv_lora_rank=40)
    return Drafter.random(dataclasses.replace(cfg, mla=mla, format="mla"), target, dtype=jnp.float32, seed=2)


@pytest.mark.parametrize("kind", ["llama", pytest.param("mla", marks=pytest.mark.slow)])  # mla: ~25 s, -m slow
def test_tree_step_scores_each_node_as_a_chain_over_its_path(target, drafter, kind):
    """`draft_tree`'s candidate scores (sums of the drafter's log-probs along each path) equal a chain of ordinary
    drafter steps over that path, written into the cache at consecutive positions. Rows have different prefix
    lengths and the cache holds stale entries past each row's prefix, which no step may see."""
    drafter = drafter if kind == "llama" else mla_drafter(target)
    B, S, steps, topk = 2, 32, 3, 2
    rng = np.random.default_rng(0)
    n_B = jnp.asarray([5, 9], jnp.int32)
    width = len(drafter.capture_layers) * target.config.hidden_size
    prefix = jnp.asarray(rng.integers(2, target.vocab_size, (B, 9)), jnp.int32)
    aux = jnp.asarray(rng.normal(size=(B, 9, width)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (B, 9))
    _, _, cache = drafter.apply(drafter.params, prefix, aux, pos, drafter.init_cache(B, S), first_step=True)
    root = jnp.asarray(rng.normal(size=(B, drafter.config.draft_vocab_size)) * 3, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(B, drafter.config.hidden_size)), jnp.float32)

    draft = jax.jit(draft_tree, static_argnums=(0, 6, 7))(
        drafter, drafter.params, root, hidden, n_B, cache, steps, topk
    )
    tokens, parents, scores = (np.asarray(x) for x in (draft.tokens, draft.parents, draft.scores))

    @partial(jax.jit, static_argnums=0)
    def chain_logp(depth, path_BJ):
        """log-softmax of the drafter after each of `depth` chain steps over `path_BJ` from position n."""
        c, h, out = cache, hidden, []
        for j in range(depth):
            logits, h2, c = drafter.apply(
                drafter.params, path_BJ[:, j : j + 1], h[:, None], (n_B + j)[:, None], c, first_step=False
            )
            out.append(jax.nn.log_softmax(logits[:, 0]))
            h = h2[:, 0]
        return out

    root_logp = np.asarray(jax.nn.log_softmax(root))
    for c in range(tokens.shape[1]):
        paths = []
        for b in range(B):  # the candidate's tokens from depth 1 down to itself
            node, path = c, []
            while node >= 0:
                path.insert(0, int(tokens[b, node]))
                node = int(parents[b, node])
            paths.append(path)
        depth = len(paths[0])
        path_BJ = jnp.asarray(paths, jnp.int32)
        logps = chain_logp(depth - 1, path_BJ) if depth > 1 else []
        for b in range(B):
            ref = root_logp[b, paths[b][0]] + sum(float(lp[b, paths[b][j + 1]]) for j, lp in enumerate(logps))
            np.testing.assert_allclose(scores[b, c], min(ref, 0.0), atol=2e-4, err_msg=f"candidate {c} row {b}")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk=0), "topk: expected an integer in \\[1, 16\\]"),
        (dict(topk=17), "topk: expected an integer in \\[1, 16\\]"),
        (dict(topk=2.0), "topk: expected an integer"),
        (dict(topk=2, num_steps=0), "topk=2 drafts a tree: it needs num_steps >= 1"),
        (dict(topk=2, num_steps=2, num_draft_tokens=8), "num_draft_tokens: expected an integer in \\[2, 7\\]"),
        (dict(topk=2, num_steps=2, num_draft_tokens=1), "num_draft_tokens: expected an integer in \\[2, 7\\]"),
        (dict(topk=1, num_steps=2, num_draft_tokens=5), "a chain \\(topk=1\\) verifies num_steps \\+ 1 = 3"),
        (dict(topk=2, num_draft_tokens="4"), "num_draft_tokens: expected an integer"),
    ],
)
def test_bad_tree_settings_fail_before_compiling(target, drafter, kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=8, num_steps=2) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, **args)


def test_tree_candidates_follow_top_children_of_the_root(target):
    """The first expansion maps draft-vocabulary indices through the drafter's id map (d2t) before they become tree
    tokens: a drafter with its own vocabulary gets target ids."""
    logits = jnp.asarray([[0.0, 5.0, 1.0, 4.0]])
    draft = tr.first_expansion(logits, 2, to_ids=lambda u: u + 100)
    assert np.asarray(draft.tokens).tolist() == [[101, 103]]
