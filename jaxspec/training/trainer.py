"""Train an EAGLE-3 drafter for a target: optax AdamW + warmup/cosine + grad clipping, Orbax checkpoints, resume.

One training step (one compiled program):
1. the target runs over the batch once (`Target.apply(..., capture=drafter layers)`): logits + captured states;
2. the target's logits are restricted to the draft vocabulary (a vocab-split gather) and its argmax is checked
   against the draft vocabulary;
3. the drafter's training-time-test unroll (`ttt.ttt_forward`, `ttt_depth` steps) and the weighted loss, per device
   inside one shard_map; gradients flow only into the drafter's own weights (the embedding is the target's, frozen
   and shared);
4. clip_by_global_norm -> AdamW(b1 0.9, b2 0.95) with a warmup + cosine learning rate.

Parallelism: data parallel. The batch is split over the mesh's data axis, the drafter's trainable weights and the
optimizer state are replicated, the target keeps its own layout (`mesh=make_mesh("8x1")` for 8-way data parallel).

Determinism and resume: batch k of the run is a pure function of (seed, k) (an epoch-wise permutation of the
dataset), so a resumed run sees exactly the batches the uninterrupted one would. Orbax checkpoints (every
`checkpoint_every` steps, at the end, and on KeyboardInterrupt) hold the drafter weights, the optimizer state, the step
and the data cursor. `OUT/train_config.json` records the run's settings; `resume=True` refuses to continue a run with
different ones.

    OUT/train_config.json   settings (written at the start)
    OUT/train_log.jsonl     one line per step: loss, per-depth loss and accuracy, learning rate, grad norm
    OUT/checkpoints/<step>/ Orbax checkpoints
    OUT/config.json, OUT/model.safetensors   the trained drafter, written at the end: SGLang format (with d2t/t2d),
                                             or Eagle3DeepseekV2ForCausalLM for an MLA drafter (attention="mla")
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxspec.config import KimiConfig
from jaxspec.io import save_drafter
from jaxspec.io.drafter_config import draft_config_for, hf_config, read_drafter_config
from jaxspec.models.eagle3 import Eagle3Config, Eagle3Model, Split, concat_captured
from jaxspec.pytree import get_path
from jaxspec.runtime import Drafter, Target
from jaxspec.training.data import load_dataset, target_fingerprint
from jaxspec.training.ttt import combine_terms, restrict_to_draft_vocab, ttt_forward, ttt_loss_terms
from jaxspec.training.vocab import build_draft_vocab, draft_to_target_ids
from sharding.mesh import DATA

TRAIN_CONFIG = "train_config.json"
TRAIN_LOG = "train_log.jsonl"
CHECKPOINTS = "checkpoints"


DEFAULT_DRAFT_VOCAB = 32000
ATTENTION_KINDS = ("gqa", "mla")
# EAGLE 3.1 as the published Kimi 3.1 drafters set it: fc_norm and norm_output (see jaxspec/models/eagle3.py).
VARIANTS = {"eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True}}


def _setting(default: Any, help: str, flag: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A TrainConfig field: its default, the help of its command-line flag, the flag when not --<field-name>, and
    the values it accepts when they are a fixed set."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings that determine a training run: the one declaration behind `train_drafter`, the flags of
    `jaxspec train-drafter` (generated from these fields) and OUT/train_config.json (a resume must match it).

    None means "derived from the target or the dataset"; `resolve` fills those in and checks every value."""

    draft_vocab_size: int | None = _setting(
        None, f"draft vocabulary size (default {DEFAULT_DRAFT_VOCAB})", flag="--draft-vocab"
    )
    ttt_depth: int = _setting(3, "training-time-test steps")
    steps: int = _setting(1000, "optimizer steps")
    batch_size: int = _setting(8, "sequences per step")
    seq_len: int | None = _setting(None, "tokens per sequence (default: the dataset's)")
    lr: float = _setting(1e-4, "peak learning rate")
    warmup: int | None = _setting(None, "warmup steps (default min(100, steps/10))")
    weight_decay: float = _setting(0.0, "AdamW weight decay")
    clip: float = _setting(0.5, "gradient clipping global norm")
    seed: int = _setting(0, "seed of the init, data order and sampling")
    heads: int | None = _setting(None, "drafter attention heads (default: the target's)")
    kv_heads: int | None = _setting(None, "drafter KV heads (default heads/8)")
    intermediate_size: int | None = _setting(None, "drafter MLP width (default: the target's)")
    capture_layers: tuple[int, ...] | None = _setting(None, "target layer outputs to capture, e.g. 1,29,57")
    attention: str = _setting(
        "gqa",
        "drafter attention: gqa (Llama drafter) or mla (the target's MLA, exported as Eagle3DeepseekV2ForCausalLM)",
        choices=ATTENTION_KINDS,
    )
    variant: str = _setting(
        "eagle3",
        "drafter variant: eagle3, or eagle3.1 (fc_norm: an RMSNorm per captured state before fc; norm_output: the "
        "post-norm output fed to the next draft step), as the published Kimi EAGLE 3.1 drafters",
        choices=tuple(VARIANTS),
    )

    def resolve(self, tcfg: KimiConfig, dataset_seq_len: int) -> TrainConfig:
        """Every setting checked (all problems named at once, as ValueError) and filled in for this target and
        dataset."""
        _check_types(self)
        heads = self.heads or tcfg.num_attention_heads
        mla = self.attention == "mla"
        layers = tuple(sorted(int(x) for x in self.capture_layers)) if self.capture_layers else None
        out = dataclasses.replace(
            self,
            draft_vocab_size=self.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, tcfg.vocab_size),
            seq_len=self.seq_len or dataset_seq_len,
            warmup=self.warmup if self.warmup is not None else min(100, self.steps // 10),
            heads=heads,
            # MLA expands every head's keys and values from the one shared latent: no separate KV heads.
            kv_heads=self.kv_heads or (heads if mla or heads % 8 else heads // 8),
            intermediate_size=self.intermediate_size or tcfg.intermediate_size,
            capture_layers=layers,
        )
        _check_against_target(out, tcfg)
        if layers is None:
            layers = draft_config_for(tcfg, heads=out.heads, kv_heads=out.kv_heads).capture_layers
        numbers = {k: _number(k, v) for k, v in _scalars(out)}
        return dataclasses.replace(out, capture_layers=layers, **numbers)


def _number(name: str, value: Any) -> Any:
    if name in ("attention", "variant"):
        return value
    return float(value) if name in ("lr", "weight_decay", "clip") else int(value)


def _scalars(config: TrainConfig) -> list[tuple[str, Any]]:
    return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "capture_layers"]


def _check_types(config: TrainConfig) -> None:
    """Counts must be positive integers (None where it means "derived")."""
    optional = ("draft_vocab_size", "seq_len", "heads", "kv_heads", "intermediate_size")
    problems = []
    for name in ("draft_vocab_size", "ttt_depth", "steps", "batch_size", *optional[1:]):
        v = getattr(config, name)
        if not (v is None and name in optional) and (
            isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1
        ):
            problems.append(f"{name}: expected a positive integer, got {v!r}")
    if config.attention not in ATTENTION_KINDS:
        problems.append(f"attention: expected one of {list(ATTENTION_KINDS)}, got {config.attention!r}")
    if config.variant not in VARIANTS:
        problems.append(f"variant: expected one of {list(VARIANTS)}, got {config.variant!r}")
    if problems:
        raise ValueError("train_drafter: " + "; ".join(problems))


def _check_against_target(c: TrainConfig, tcfg: KimiConfig) -> None:
    """The filled-in settings against each other and the target (all problems at once)."""
    problems = []
    V, L, D = tcfg.vocab_size, tcfg.num_hidden_layers, tcfg.hidden_size
    if c.draft_vocab_size > V:
        problems.append(f"draft_vocab_size: {c.draft_vocab_size} exceeds the target's vocab_size {V}")
    if c.seq_len < c.ttt_depth + 2:
        problems.append(f"seq_len: {c.seq_len} is too short for ttt_depth {c.ttt_depth} (needs >= depth + 2)")
    if c.seq_len > tcfg.max_position_embeddings:
        problems.append(f"seq_len: {c.seq_len} exceeds the target's context of {tcfg.max_position_embeddings}")
    if isinstance(c.warmup, bool) or not isinstance(c.warmup, int) or not 0 <= c.warmup < c.steps:
        problems.append(f"warmup: expected an integer in [0, steps={c.steps}), got {c.warmup!r}")
    if not c.lr > 0:
        problems.append(f"lr: expected > 0, got {c.lr!r}")
    if not c.clip > 0:
        problems.append(f"clip: expected > 0, got {c.clip!r}")
    if not c.weight_decay >= 0:
        problems.append(f"weight_decay: expected >= 0, got {c.weight_decay!r}")
    if c.attention == "mla":  # head dims, ranks and RoPE are the target's attention's
        if tcfg.q_lora_rank is None:
            problems.append("attention: an MLA drafter needs a query LoRA, and this target has q_lora_rank null")
        if c.kv_heads != c.heads:
            problems.append(f"kv_heads: an MLA drafter has one KV head per query head ({c.heads}), got {c.kv_heads}")
    elif D % c.heads or (D // c.heads) % 2:
        problems.append(f"heads: hidden_size {D} / heads {c.heads} must be an even integer head dim (for RoPE)")
    elif c.heads % c.kv_heads:
        problems.append(f"kv_heads: {c.kv_heads} must divide heads {c.heads}")
    layers = c.capture_layers
    if layers is not None and (len(set(layers)) != len(layers) or not all(0 <= x < L for x in layers)):
        problems.append(f"capture_layers: {list(layers)} must be distinct target layer outputs in [0, {L})")
    if problems:
        raise ValueError("train_drafter: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of the compiled step (hashable; the Target hashes by identity)."""

    target: Target
    graphdef: Any
    embed_spec: PartitionSpec
    config: TrainConfig


def make_optimizer(config: TrainConfig):
    """clip_by_global_norm(clip) -> AdamW(b1 0.9, b2 0.95); lr: linear warmup from lr/warmup to `lr` over `warmup`
    steps, then cosine decay to 0 at `steps`. Weight decay applies to matrices only (not to norm scales).
    `config` must be resolved (`TrainConfig.resolve`)."""
    lr, warmup, steps, weight_decay, clip = config.lr, config.warmup, config.steps, config.weight_decay, config.clip
    schedule = optax.warmup_cosine_decay_schedule(lr / max(warmup, 1), lr, warmup, steps, 0.0)
    # Norm scales are not decayed, fc_norm's [X, D] stack of per-state scales included.
    decayed = lambda path, x: x.ndim >= 2 and "norm" not in jax.tree_util.keystr(path)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(decayed, params)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(clip), adamw), schedule


def batch_indices(seed: int, step: int, batch_size: int, num_examples: int) -> np.ndarray:
    """Dataset rows of batch `step`: consecutive slices of one permutation per epoch (a function of seed and epoch)."""
    flat = step * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(flat, num_examples)
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_examples)
        out[epochs == epoch] = perm[offsets[epochs == epoch]]
    return out


# ----------------------------------------------------------------------------------------------- the step
def _target_side(plan: _Plan, tparams, ids_BT, draft_ids_U, t2d_V):
    """Target forward: (aux [B,T,X*D], restricted target logits [B,T,U], argmax-in-draft-vocab [B,T])."""
    target, batch = plan.target, plan.target.rules.batch
    pos_BT = jnp.broadcast_to(jnp.arange(ids_BT.shape[1], dtype=jnp.int32), ids_BT.shape)
    logits_BTV, _, captured = target.apply(
        tparams, ids_BT, pos_BT, None, capture=plan.config.capture_layers, impl="expanded"
    )
    restrict = jax.shard_map(
        functools.partial(restrict_to_draft_vocab, axis=target.rules.model_axis),
        mesh=target.mesh,
        in_specs=(PartitionSpec(batch, None, target.rules.model_axis), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(batch, None, None), PartitionSpec(batch, None)),
    )
    tgt_BTU, in_vocab_BT = restrict(logits_BTV, draft_ids_U, t2d_V)
    return concat_captured(captured), tgt_BTU, in_vocab_BT


def _loss(plan: _Plan, params, embed_VD, ids_BT, aux_BTI, tgt_BTU, in_vocab_BT, mask_BT):
    batch = plan.target.rules.batch

    def local(params, embed, ids, aux, tgt, in_vocab, mask):
        state = nnx.State({"embed": nnx.Param(embed), **jax.tree.map(nnx.Param, params)})
        logits_JBTU = ttt_forward(nnx.merge(plan.graphdef, state), ids, aux, plan.config.ttt_depth)
        terms = ttt_loss_terms(logits_JBTU, tgt, in_vocab, mask)
        return terms if batch is None else jax.tree.map(lambda x: jax.lax.psum(x, batch), terms)

    rows, rows3 = PartitionSpec(batch, None), PartitionSpec(batch, None, None)
    fn = jax.shard_map(
        local,
        mesh=plan.target.mesh,
        in_specs=(jax.tree.map(lambda _: PartitionSpec(), params), plan.embed_spec, rows, rows3, rows3, rows, rows),
        out_specs=PartitionSpec(),
    )
    return combine_terms(fn(params, embed_VD, ids_BT, aux_BTI, tgt_BTU, in_vocab_BT, mask_BT))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _train_step(plan: _Plan, params, opt_state, tparams, ids_BT, mask_BT, draft_ids_U, t2d_V):
    aux_BTI, tgt_BTU, in_vocab_BT = _target_side(plan, tparams, ids_BT, draft_ids_U, t2d_V)
    embed_VD = tparams["embed"].get_value()
    loss_fn = lambda p: _loss(plan, p, embed_VD, ids_BT, aux_BTI, tgt_BTU, in_vocab_BT, mask_BT)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    optimizer, _ = make_optimizer(plan.config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}


# ----------------------------------------------------------------------------------------------- the run
def train_drafter(
    target: Target,
    dataset_dir: str | Path,
    out_dir: str | Path,
    config: TrainConfig | None = None,
    *,
    checkpoint_every: int = 500,
    resume: bool = False,
    mesh: Mesh | None = None,
    dtype=None,
    progress: bool = True,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    **settings: Any,
) -> Drafter:
    """Train a drafter for `target` on a dataset from `generate_dataset`; export it to `out_dir` and return it.

    config: the run's `TrainConfig` (default: its defaults); `settings` are TrainConfig fields that override it, so
    `train_drafter(target, data, out, draft_vocab_size=32000, steps=20000, batch_size=16)` works too. The fields'
    defaults: draft_vocab_size the most frequent min(32000, vocab_size) response tokens (== vocab_size: the full
    vocabulary); seq_len the dataset's (longer rows are cut, shorter padded and masked); warmup min(100, steps//10);
    heads / kv_heads / intermediate_size / capture_layers the target's attention heads, heads/8 KV heads, the target's
    dense intermediate size and SpecForge's capture layers (target-layer outputs, 0-indexed); attention "gqa" (a
    Llama drafter) or "mla" (one MLA layer with the target's ranks, head dims and RoPE; needs a target q_lora_rank);
    variant "eagle3" or "eagle3.1" (fc_norm + norm_output, for either attention).
    checkpoint_every: steps between Orbax checkpoints. resume: continue from the latest checkpoint in `out_dir`.
    mesh: train on this mesh instead of the target's (data parallel over its data axis). dtype: of the returned and
    exported drafter (default: the target's); training is in float32. on_step(step, metrics) is called after every
    step (`step` = steps done). KeyboardInterrupt saves a checkpoint, then propagates.
    """
    if mesh is not None:
        target = target.on_mesh(mesh)
    data = load_dataset(dataset_dir, vocab_size=target.config.vocab_size)
    if data.manifest["target"] != target_fingerprint(target.config):
        warnings.warn(
            f"{dataset_dir}: generated by a target with a different config (same vocabulary); training on it anyway",
            stacklevel=2,
        )
    config = _with_settings(config or TrainConfig(), settings).resolve(target.config, data.seq_len)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: expected an integer >= 1, got {checkpoint_every!r}")
    n_data = target.mesh.shape[DATA]
    if config.batch_size % n_data:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by the mesh's data axis ({n_data})")
    run = _Run.begin(target, data, config, Path(out_dir), resume)
    try:
        run.train(checkpoint_every, progress, on_step)
    finally:
        run.mngr.close()  # waits for any save in flight
    draft_cfg = _draft_config(target.config, config)
    d2t = None if draft_cfg.full_vocab else run.d2t
    final = _export_drafter(draft_cfg, target, run.params, d2t, dtype or target.dtype)
    save_drafter(final, out_dir, format="mla" if draft_cfg.mla is not None else "sglang")
    return final


def _with_settings(config: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"train_drafter: unknown setting(s) {unknown}; TrainConfig has {names}")
    return dataclasses.replace(config, **settings)


@dataclasses.dataclass
class _Run:
    """One training run in progress: the data in rows, the draft vocabulary, the trainable state and its checkpoints."""

    target: Target
    config: TrainConfig
    out: Path
    ids: np.ndarray
    mask: np.ndarray
    d2t: np.ndarray
    t2d: np.ndarray
    coverage: float
    mngr: ocp.CheckpointManager
    start: int
    params: Any = None
    opt_state: Any = None

    @classmethod
    def begin(cls, target: Target, data, config: TrainConfig, out: Path, resume: bool) -> _Run:
        """Fit the rows, build the draft vocabulary, open (or resume) the run in `out`, initialise the weights."""
        tcfg = target.config
        ids, mask = _fit_length(data.ids, data.loss_mask, config.seq_len)
        d2t, t2d = build_draft_vocab(ids, mask, config.draft_vocab_size, tcfg.vocab_size)
        coverage = float(t2d[ids[mask]].mean()) if mask.any() else 0.0
        record = {
            "config": _jsonable(dataclasses.asdict(config)),
            "dataset": {k: data.manifest.get(k) for k in ("target", "prompts_sha256", "num_sequences", "seq_len")},
            "d2t_sha256": hashlib.sha256(d2t.tobytes()).hexdigest(),
            "draft_vocab_coverage": coverage,
        }
        mngr, start = _open_run(out, record, resume)
        run = cls(target, config, out, ids, mask, d2t, t2d, coverage, mngr, start)
        run.init_state()
        _truncate_log(out / TRAIN_LOG, start)
        return run

    def init_state(self) -> None:
        """Random init of the drafter's own weights (float32 master copies, replicated; the embedding is the
        target's) and of the optimizer state, or the checkpoint being resumed from."""
        draft_cfg = _draft_config(self.target.config, self.config)
        replicated = NamedSharding(self.target.mesh, PartitionSpec())
        # RBG keys: same values for a seed on a given backend, and far cheaper to compile than threefry on CPU.
        key = jax.random.key(self.config.seed, impl="rbg")
        self.params = jax.device_put(_init_params(draft_cfg, key), replicated)
        self.opt_state = jax.device_put(make_optimizer(self.config)[0].init(self.params), replicated)
        if self.start:
            self.params, self.opt_state = _restore(self.mngr, self.start, self.params, self.opt_state)

    def save(self, step: int) -> None:
        meta = {"step": step, "seed": self.config.seed, "examples_seen": step * self.config.batch_size}
        state = {"params": self.params, "opt_state": self.opt_state}
        composite = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.mngr.save(step, args=composite)

    def train(self, checkpoint_every: int, progress: bool, on_step) -> None:
        """Steps from `start` to `config.steps`: log each, checkpoint every `checkpoint_every` and at the end (and on
        KeyboardInterrupt, which then propagates)."""
        config, start = self.config, self.start
        step_fn = self._step_fn()
        step = start
        bar = tqdm(total=config.steps, initial=start, desc="training drafter", unit="step", disable=not progress)
        if progress:
            bar.write(
                f"draft vocabulary: {config.draft_vocab_size} tokens cover {self.coverage:.1%} of the response "
                f"tokens; {len(self.ids)} sequences of {config.seq_len} tokens"
                + (f"; resuming at step {start}" if start else "")
            )
        try:
            with bar, open(self.out / TRAIN_LOG, "a") as log:
                while step < config.steps:
                    m = step_fn(step)
                    step += 1
                    log.write(json.dumps({"step": step, **m}) + "\n")
                    log.flush()
                    acc = "/".join(f"{a:.2f}" for a in m["acc_j"])
                    bar.set_postfix_str(f"loss {m['loss']:.3f} acc {acc} lr {m['lr']:.2e}")
                    bar.update(1)
                    if step % checkpoint_every == 0 and step < config.steps:
                        self.save(step)
                    if on_step is not None:
                        on_step(step, m)
            if step not in self.mngr.all_steps():
                self.save(step)
        except KeyboardInterrupt:
            if step > start and step not in self.mngr.all_steps() and not _deleted(self.params, self.opt_state):
                self.save(step)
                print(f"interrupted: checkpoint at step {step} in {self.out / CHECKPOINTS}; rerun with resume=True")
            raise

    def _step_fn(self) -> Callable[[int], dict[str, Any]]:
        """step(i): run optimizer step i (updating params and optimizer state) and return its host metrics."""
        target, config = self.target, self.config
        draft_cfg = _draft_config(target.config, config)
        graphdef = nnx.split(nnx.eval_shape(lambda: Eagle3Model(draft_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))[0]
        plan = _Plan(target, graphdef, target.params["embed"].get_value().sharding.spec, config)
        replicated = NamedSharding(target.mesh, PartitionSpec())
        rows = NamedSharding(target.mesh, PartitionSpec(target.rules.batch, None))
        draft_ids = jax.device_put(draft_to_target_ids(self.d2t).astype(np.int32), replicated)
        t2d = jax.device_put(self.t2d, replicated)
        _, schedule = make_optimizer(config)

        def step_fn(step: int) -> dict[str, Any]:
            idx = batch_indices(config.seed, step, config.batch_size, len(self.ids))
            batch_ids, batch_mask = jax.device_put((self.ids[idx], self.mask[idx]), rows)
            self.params, self.opt_state, metrics = _train_step(
                plan, self.params, self.opt_state, target.params, batch_ids, batch_mask, draft_ids, t2d
            )
            return _host_metrics(metrics, float(schedule(step)))

        return step_fn


def _draft_config(tcfg: KimiConfig, config: TrainConfig) -> Eagle3Config:
    """The drafter's config; an MLA drafter's is the one its export reads back (the published layout's, parsed)."""
    cfg = draft_config_for(tcfg, heads=config.heads, kv_heads=config.kv_heads, capture_layers=config.capture_layers)
    cfg = dataclasses.replace(
        cfg,
        intermediate_size=config.intermediate_size,
        draft_vocab_size=config.draft_vocab_size,
        **VARIANTS[config.variant],
    )
    if config.attention == "gqa":
        return cfg
    mla = tcfg.replace(hidden_size=cfg.hidden_size, num_attention_heads=config.heads)
    cfg = dataclasses.replace(cfg, format="mla", mla=mla, num_key_value_heads=config.heads, head_dim=mla.qk_head_dim)
    return read_drafter_config(hf_config(cfg, "mla"), target_config=tcfg)


def _fit_length(ids: np.ndarray, mask: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut or right-pad (masked) the rows to `seq_len` tokens."""
    T = ids.shape[1]
    if seq_len <= T:
        return np.ascontiguousarray(ids[:, :seq_len]), np.ascontiguousarray(mask[:, :seq_len])
    pad = ((0, 0), (0, seq_len - T))
    return np.pad(ids, pad), np.pad(mask, pad)


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=list))


def _open_run(out: Path, record: dict[str, Any], resume: bool) -> tuple[ocp.CheckpointManager, int]:
    """The checkpoint manager and the step to start from (0, or the latest checkpoint when resuming)."""
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = (out / CHECKPOINTS).absolute()
    existing = (out / TRAIN_CONFIG).is_file() or ckpt_dir.is_dir()
    if existing and not resume:
        raise FileExistsError(
            f"{out}: holds an earlier training run; pass resume=True (--resume) to continue it, or use another --out"
        )
    if resume and (out / TRAIN_CONFIG).is_file():
        old = json.loads((out / TRAIN_CONFIG).read_text())
        # A setting added since the run started was at its default then (variant: EAGLE-3).
        was = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name == "variant"} | old["config"]
        diff = [f"{k} ({was.get(k)!r} -> {v!r})" for k, v in record["config"].items() if was.get(k) != v]
        diff += [k for k in ("dataset", "d2t_sha256") if old.get(k) != record[k]]
        if diff:
            raise ValueError(f"{out}: cannot resume, the run's settings changed: {', '.join(diff)}")
    (out / TRAIN_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    # Synchronous saves: the next step donates the buffers being saved.
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    mngr = ocp.CheckpointManager(ckpt_dir, options=options, item_names=("state", "meta"))
    latest = mngr.latest_step() if resume else None
    return mngr, int(latest or 0)


def _restore(mngr: ocp.CheckpointManager, step: int, params, opt_state):
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": params, "opt_state": opt_state},
    )
    restored = mngr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
    )
    if restored["meta"]["step"] != step:
        raise ValueError(f"checkpoint {step}: its metadata says step {restored['meta']['step']}")
    return restored["state"]["params"], restored["state"]["opt_state"]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past `step` (written after the checkpoint a resumed run starts from)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def _deleted(*trees) -> bool:
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(trees))


def _host_metrics(metrics: dict[str, jax.Array], lr: float) -> dict[str, Any]:
    m = jax.device_get(metrics)
    return {
        "loss": float(m["loss"]),
        "loss_j": [float(x) for x in m["loss_j"]],
        "acc_j": [float(x) for x in m["acc_j"]],
        "valid_j": [int(x) for x in m["valid_j"]],
        "grad_norm": float(m["grad_norm"]),
        "lr": lr,
    }


@functools.partial(jax.jit, static_argnums=0)
def _init_params(cfg: Eagle3Config, key: jax.Array) -> dict[str, Any]:
    """The drafter's initial weights (its own declared initializers), float32, without the embedding (XLA drops its
    init: it is the target's), nested like the model (an MLA drafter's attention under "attn"). Compiled once per
    config."""
    state = nnx.to_pure_dict(nnx.state(Eagle3Model(cfg, dtype=jnp.float32, rngs=nnx.Rngs(params=key))))
    return {k: v for k, v in state.items() if k != "embed"}


def _export_drafter(cfg: Eagle3Config, target: Target, params: dict[str, Any], d2t, dtype) -> Drafter:
    """The trained weights as a Drafter in `dtype`, laid out like an inference drafter on the target's mesh."""
    split = Split.plan(cfg, target.mesh.shape[target.rules.model_axis], target.rules)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Eagle3Model(cfg, dtype=dtype, split=split, rngs=nnx.Rngs(0))))
    specs = Target.param_specs(abstract, split.rules_for(target.rules))

    def place(path, var):
        if path == ("embed",):  # the target's own array, shared
            return path, var.replace(target.params["embed"].get_value())
        value = get_path(params, path).astype(dtype)
        return path, var.replace(jax.device_put(value, NamedSharding(target.mesh, get_path(specs, path))))

    state = nnx.from_flat_state([place(p, v) for p, v in nnx.to_flat_state(abstract)])
    d2t = None if d2t is None else np.asarray(d2t, np.int32)
    return Drafter(cfg, target, graphdef, state, d2t, ("embed",))
