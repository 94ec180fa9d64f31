"""The independent EAGLE-3 reference: the `speculators` package's `Eagle3DraftModel` (PyTorch, CPU, eager attention).

Only builds a tiny model with random weights and runs the package's own forward; nothing here re-implements the
drafter. speculators 0.9.0 implements EAGLE 3.1 (`fc_norm`, `norm_before_fc`, `norm_output`) in that same forward.
The package's forward returns argmax tokens, so the per-step logits are read with a hook on its lm_head.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig


def make_model(
    embed: np.ndarray,
    layer_ids: Sequence[int],
    *,
    draft_vocab: int | None = None,
    norm_before_residual: bool = False,
    eagle31: dict[str, bool] | None = None,
    rope: dict | None = None,
    hidden: int = 64,
    intermediate: int = 96,
    heads: int = 8,
    kv_heads: int = 4,
    seed: int = 0,
) -> Eagle3DraftModel:
    """A 1-layer Llama EAGLE-3 drafter; `layer_ids` in speculators' own (input-of-layer) convention. `eagle31`: the
    package's own EAGLE 3.1 flags (`fc_norm`, `norm_before_fc`, `norm_output`), as its config takes them."""
    V = embed.shape[0]
    layer = LlamaConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab or V,
        norm_before_residual=norm_before_residual,
        **(eagle31 or {}),
        eagle_aux_hidden_state_layer_ids=list(layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["DeepseekV3ForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            if p.ndim == 1:  # norms: perturbed so a swapped or skipped norm shows
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name != "embed_tokens.weight":  # unit-scale activations so the logits are not all ~0
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        model.embed_tokens.weight.copy_(torch.from_numpy(np.array(embed)))
    if draft_vocab and draft_vocab < V:
        used = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[used] = True
        model.load_vocab_mappings(t2d, used - torch.arange(draft_vocab))
    return model


def draft_logits(model: Eagle3DraftModel, aux: np.ndarray, ids: np.ndarray, steps: int) -> list[np.ndarray]:
    """Per training-time-test step, the draft logits [T, U] of the package's forward (batch 1, positions 0..T-1).

    Step k at row t drafts from prefix 0..t: its token is ids[t + k] (0 past the end), its hidden input is step
    k-1's output at row t, its position t + k, and it attends to step-0 keys <= t plus its own row in steps 1..k.
    """
    logits: list[np.ndarray] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: logits.append(out[0].detach().numpy()))
    T = ids.shape[-1]
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.from_numpy(np.array(aux)).reshape(1, T, -1),
                input_ids=torch.from_numpy(np.array(ids)).reshape(1, T).long(),
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=torch.arange(T)[None],
                ttt_steps=steps,
            )
    finally:
        hook.remove()
    return logits
