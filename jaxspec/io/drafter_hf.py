"""EAGLE-3 drafter checkpoints in HF layout: SGLang/SpecForge, speculators/vLLM and MLA (Eagle3DeepseekV2).

Both Llama layouts hold the same tensors (HF [out, in] weights); they differ in the layer prefix (`midlayer.` vs
`layers.0.`), in config.json, and in the meaning of the capture-layer ids (config.json is `drafter_config.py`'s).
One name table (`_table`, `_mla_table`) serves `read_tensors` and `save_drafter`; `jaxspec.io.load_drafter` reads
either layout, converts the ids to the internal output-of-layer-k convention, checks every tensor against the config
and the target, and only then places anything on devices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxspec.io.drafter_config import Format, hf_config
from jaxspec.io.hf import CheckpointError, SafetensorsDir
from jaxspec.models.eagle3 import Eagle3Config
from jaxspec.pytree import get_path
from jaxspec.runtime.drafter import Drafter

LAYER_PREFIX: dict[str, str] = {"sglang": "midlayer.", "speculators": "layers.0.", "mla": "midlayer."}
# Tensors some writers add that inference never reads (speculators' frozen verifier copies, rotary buffers).
IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")


def _table(cfg: Eagle3Config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(param name, HF name with `{L}` for the layer prefix, HF shape). Ours = HF.T reshaped (vectors as-is).

    An MLA drafter's attention is not in it (see `_mla_table`)."""
    rows = _llama_table(cfg)
    return rows if cfg.mla is None else [r for r in rows if not r[1].startswith("{L}self_attn.")]


def _mla_table(cfg: Eagle3Config) -> list[tuple[str, tuple[int, ...], Any, Any]]:
    """An MLA drafter's attention: (HF name with `{L}`, HF shape, HF -> {param key: ours}, ours (by key) -> HF).

    HF layout as the target's DeepseekV3 attention, with 2D-wide q_a_proj / kv_a_proj_with_mqa inputs."""
    m, D = cfg.mla, cfg.hidden_size
    N, H, R, A = m.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    Q, C = m.q_lora_rank, m.kv_lora_rank

    def heads(w, *widths):  # [N * sum(widths), in] -> one [in, N, width] block per width
        w = w.reshape(N, sum(widths), -1)
        bounds = np.cumsum((0, *widths))
        return [w[:, lo:hi].transpose(2, 0, 1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    def rows(*parts):  # the inverse: per-head blocks [in, N, h_i] -> [N * sum(h_i), in]
        w = np.concatenate(parts, axis=-1)
        return w.transpose(1, 2, 0).reshape(-1, w.shape[0])

    a = "attn."
    vec = lambda key: (lambda w: {a + key: w}, lambda get: get(a + key))
    return [
        ("{L}self_attn.q_a_proj.weight", (Q, 2 * D), lambda w: {a + "q_a": w.T}, lambda get: get(a + "q_a").T),
        ("{L}self_attn.q_a_layernorm.weight", (Q,), *vec("q_a_norm")),
        (
            "{L}self_attn.q_b_proj.weight",
            (N * (H + R), Q),
            lambda w: dict(zip((a + "q_b_nope", a + "q_b_rope"), heads(w, H, R), strict=True)),
            lambda get: rows(get(a + "q_b_nope"), get(a + "q_b_rope")),
        ),
        (
            "{L}self_attn.kv_a_proj_with_mqa.weight",
            (C + R, 2 * D),
            lambda w: {a + "kv_a_latent": w[:C].T, a + "kv_a_rope": w[C:].T},
            lambda get: np.concatenate([get(a + "kv_a_latent"), get(a + "kv_a_rope")], axis=1).T,
        ),
        ("{L}self_attn.kv_a_layernorm.weight", (C,), *vec("kv_a_norm")),
        (
            "{L}self_attn.kv_b_proj.weight",
            (N * (H + A), C),
            lambda w: dict(zip((a + "kv_b_k", a + "kv_b_v"), heads(w, H, A), strict=True)),
            lambda get: rows(get(a + "kv_b_k"), get(a + "kv_b_v")),
        ),
        (
            "{L}self_attn.o_proj.weight",
            (D, N * A),
            lambda w: {a + "o": w.reshape(D, N, A).transpose(1, 2, 0)},
            lambda get: get(a + "o").transpose(2, 0, 1).reshape(D, N * A),
        ),
    ]


def _fc_norm_table(cfg: Eagle3Config) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """EAGLE 3.1's norms before fc: (param key, its HF names (one per row of the param), the shape of each). Top-level
    names in every format: `fc_norm.{i}.weight` per captured state (vLLM, SGLang, speculators), `input_norm.weight`
    over the concatenation (speculators' norm_before_fc)."""
    X, Dt = len(cfg.capture_layers), cfg.target_hidden_size
    rows = []
    if cfg.fc_norm:
        rows.append(("fc_norm", [f"fc_norm.{i}.weight" for i in range(X)], (Dt,)))
    if cfg.norm_before_fc:
        rows.append(("fc_input_norm", ["input_norm.weight"], (X * Dt,)))
    return rows


def _llama_table(cfg: Eagle3Config) -> list[tuple[str, str, tuple[int, ...]]]:
    D, F, U = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    NZ, JZ = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    XD = len(cfg.capture_layers) * cfg.target_hidden_size
    return [
        ("fc", "fc.weight", (D, XD)),
        ("input_norm", "{L}input_layernorm.weight", (D,)),
        ("hidden_norm", "{L}hidden_norm.weight", (D,)),
        ("q", "{L}self_attn.q_proj.weight", (NZ, 2 * D)),
        ("k", "{L}self_attn.k_proj.weight", (JZ, 2 * D)),
        ("v", "{L}self_attn.v_proj.weight", (JZ, 2 * D)),
        ("o", "{L}self_attn.o_proj.weight", (D, NZ)),
        ("post_attn_norm", "{L}post_attention_layernorm.weight", (D,)),
        ("gate", "{L}mlp.gate_proj.weight", (F, D)),
        ("up", "{L}mlp.up_proj.weight", (F, D)),
        ("down", "{L}mlp.down_proj.weight", (D, F)),
        ("final_norm", "norm.weight", (D,)),
        ("lm_head", "lm_head.weight", (U, D)),
    ]


class _Reader:
    """Reads a drafter's tensors by name, recording what was used and every problem."""

    def __init__(self, path: str | Path):
        self.ckpt = SafetensorsDir(path)
        self.names, self.used, self.problems = set(self.ckpt.names()), set(), []

    def get(self, name: str, shape: tuple[int, ...], hint: str = "") -> np.ndarray | None:
        if name not in self.names:
            self.problems.append(f"missing tensor {name} (expected shape {list(shape)}){hint}")
            return None
        self.used.add(name)
        if self.ckpt.shape(name) != shape:
            self.problems.append(f"{name}: expected shape {list(shape)}{hint}, got {list(self.ckpt.shape(name))}")
            return None
        return self.ckpt.get(name)


def read_tensors(
    path: str | Path, cfg: Eagle3Config, target_hidden: int, dtype: np.dtype
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Read and check every tensor: {param name: HF weight transposed (vectors as-is)} in `dtype`, and d2t.

    Raises CheckpointError listing every missing, unexpected, mis-shaped or inconsistent tensor.
    """
    r = _Reader(path)
    prefixes = [p for p in dict.fromkeys(LAYER_PREFIX.values()) if any(n.startswith(p) for n in r.names)]
    if len(prefixes) > 1:
        r.problems.append(f"both {' and '.join(p + '*' for p in prefixes)} tensors present; expected one layer prefix")
    prefix = prefixes[0] if prefixes else LAYER_PREFIX[cfg.format]
    host = _read_weights(r, cfg, prefix, target_hidden, dtype)
    d2t = _read_vocab_map(r, cfg)
    unexpected = sorted(n for n in r.names - r.used if n not in IGNORED and not n.endswith("rotary_emb.inv_freq"))
    problems = r.problems + [f"unexpected tensor {n}" for n in unexpected]
    if problems:
        raise CheckpointError(
            f"{path}: {len(problems)} problem(s) with the drafter checkpoint:\n  " + "\n  ".join(problems)
        )
    return host, d2t


def _read_weights(r: _Reader, cfg: Eagle3Config, prefix: str, target_hidden: int, dtype) -> dict[str, np.ndarray]:
    """{param name: array in our layout} through the name table, plus the drafter's own embedding if it ships one."""
    host: dict[str, np.ndarray] = {}
    X = len(cfg.capture_layers)
    for key, name, shape in _table(cfg):
        hint = f" ({X} captured states x target hidden_size {cfg.target_hidden_size})" if key == "fc" else ""
        if key == "lm_head" and cfg.full_vocab and name not in r.names and cfg.hidden_size == target_hidden:
            continue  # no draft vocabulary and no head: use the target's lm_head, as SGLang does
        w = r.get(name.format(L=prefix), shape, hint)
        if w is not None:
            host[key] = np.asarray(w.T, dtype)
    for name, shape, to_ours, _ in [] if cfg.mla is None else _mla_table(cfg):
        w = r.get(name.format(L=prefix), shape)
        if w is not None:
            host.update({key: np.asarray(v, dtype) for key, v in to_ours(w).items()})
    for key, names, shape in _fc_norm_table(cfg):
        rows = [r.get(name, shape) for name in names]
        if all(w is not None for w in rows):
            host[key] = np.stack(rows).astype(dtype)
    V = cfg.vocab_size
    if "embed_tokens.weight" in r.names:
        w = r.get("embed_tokens.weight", (V, cfg.hidden_size))
        if w is not None and not all(np.isfinite(w[i : i + 4096]).all() for i in range(0, V, 4096)):  # bounded temp
            r.problems.append("embed_tokens.weight: contains non-finite values (a never-loaded placeholder?)")
        elif w is not None:
            host["embed"] = np.asarray(w, dtype)
    elif cfg.hidden_size != target_hidden:
        r.problems.append(
            f"hidden_size: drafter {cfg.hidden_size} != target {target_hidden}, and the checkpoint ships no "
            "embed_tokens.weight, so the target's embedding cannot be reused"
        )
    return host


def _read_vocab_map(r: _Reader, cfg: Eagle3Config) -> np.ndarray | None:
    """d2t (draft id -> target id offsets), checked, and t2d checked against it; None for a full vocabulary."""
    V, U = cfg.vocab_size, cfg.draft_vocab_size
    d2t = None
    if "d2t" in r.names or not cfg.full_vocab:
        d2t = r.get("d2t", (U,), "" if cfg.full_vocab else f" (draft_vocab_size {U} < vocab_size {V} needs the map)")
    if d2t is not None:
        ids = np.arange(U) + d2t.astype(np.int64)
        if not np.issubdtype(d2t.dtype, np.integer) or ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) < U:
            r.problems.append(f"d2t: draft id + d2t must be distinct target ids in [0, {V}) (dtype {d2t.dtype})")
            d2t = None
    if "t2d" in r.names:
        t2d = r.get("t2d", (V,))
        if t2d is not None and d2t is not None:
            expected = np.zeros(V, bool)
            expected[np.arange(U) + d2t] = True
            if not np.array_equal(t2d.astype(bool), expected):
                r.problems.append("t2d: disagrees with d2t (t2d must mark exactly the targets of draft ids)")
    return d2t


# ----------------------------------------------------------------------------------------------- writing
def save_drafter(drafter: Drafter, path: str | Path, *, format: Format, verifier: str | None = None) -> None:
    """Write `drafter` as an HF-layout directory in the SGLang/SpecForge or speculators/vLLM format.

    Layer ids are written in the format's own convention (SGLang: outputs of k; speculators: inputs of k + 1). The
    embedding is written only when the drafter has its own (every engine takes it from the target otherwise); the
    lm_head always is (speculators requires it), even when it is the target's.
    `verifier` is the target's name or path, recorded in the speculators config (its loader reads the target).
    """
    if format not in LAYER_PREFIX:
        raise ValueError(f"format: expected one of {sorted(LAYER_PREFIX)}, got {format!r}")
    cfg, path = drafter.config, Path(path)
    if (cfg.mla is not None) != (format == "mla"):
        raise ValueError(
            f"format: {format!r} cannot hold this drafter (an MLA drafter is written as 'mla', "
            "Eagle3DeepseekV2ForCausalLM; a Llama drafter as 'sglang' or 'speculators')"
        )

    def host(key: str) -> np.ndarray:
        return np.asarray(jax.device_get(get_path(drafter.params, key.split(".")).get_value()))

    prefix = LAYER_PREFIX[format]
    tensors = {
        name.format(L=prefix): np.ascontiguousarray(host(key).reshape(shape[::-1]).T)
        for key, name, shape in _table(cfg)
    }
    for name, _, _, to_hf in [] if cfg.mla is None else _mla_table(cfg):
        tensors[name.format(L=prefix)] = np.ascontiguousarray(to_hf(host))
    for key, names, _ in _fc_norm_table(cfg):
        tensors.update(zip(names, np.ascontiguousarray(host(key).reshape(len(names), -1)), strict=True))
    if "embed" not in drafter.shared:
        tensors["embed_tokens.weight"] = host("embed")
    if drafter.d2t is not None:
        d2t = drafter.d2t.astype(np.int64)
        tensors["d2t"] = d2t
        tensors["t2d"] = np.zeros(cfg.vocab_size, bool)
        tensors["t2d"][np.arange(cfg.draft_vocab_size) + d2t] = True
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg, format, drafter.dtype, verifier), indent=2) + "\n")
