"""The independent MLA EAGLE-3 reference: HF transformers' DeepseekV3 decoder-layer and attention classes (PyTorch,
eager) wired with the published EAGLE-3 input fusion (vLLM `deepseek_eagle3.py`, SpecForge `llama3_eagle.py`).

The attention is HF's `DeepseekV3Attention` built for a 2H-wide input (as vLLM builds `DeepseekV2MLAAttention` with
`input_size=2 * hidden_size`) with its o_proj writing H; the rest of the layer is HF's `DeepseekV3DecoderLayer`
(dense MLP, norms). Module names follow the published checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`), so the
state dict IS a checkpoint in the published layout. Nothing here is derived from jaxspec's code.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)


class Eagle3MLADrafter(nn.Module):
    """One MLA decoder layer with the EAGLE-3 fusion (`Eagle3DeepseekV2ForCausalLM`'s forward)."""

    def __init__(
        self, cfg: DeepseekV3Config, target_hidden: int, num_aux: int, embed: np.ndarray, eagle31: bool = False
    ):
        super().__init__()
        H = cfg.hidden_size
        cfg = copy.deepcopy(cfg)
        cfg._attn_implementation = "eager"
        wide = copy.deepcopy(cfg)
        wide.hidden_size = 2 * H  # q_a_proj / kv_a_proj_with_mqa read [embedding | hidden]
        self.fc = nn.Linear(num_aux * target_hidden, H, bias=False)
        # EAGLE 3.1 as vLLM's Eagle3DeepseekV2ForCausalLM serves it (PRs #42764, #43482): `fc_norm`, one RMSNorm per
        # captured state before fc, and `norm_output`, the final norm's output fed to the next step.
        self.eagle31 = eagle31
        if eagle31:
            self.fc_norm = nn.ModuleList(DeepseekV3RMSNorm(target_hidden, cfg.rms_norm_eps) for _ in range(num_aux))
        self.midlayer = DeepseekV3DecoderLayer(cfg, layer_idx=0)  # dense MLP (0 < first_k_dense_replace)
        self.midlayer.self_attn = DeepseekV3Attention(wide, layer_idx=0)
        self.midlayer.self_attn.o_proj = nn.Linear(cfg.num_attention_heads * cfg.v_head_dim, H, bias=False)
        self.midlayer.hidden_norm = DeepseekV3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.norm = DeepseekV3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)
        self.embed = torch.from_numpy(np.array(embed, np.float32))  # the target's (not a drafter weight)

    def forward(self, ids, hidden, positions, cache=None):
        """ids [B,T], hidden [B,T,X*Ht] (fc applied) or a previous step's h2 [B,T,H] (pass `fc=False` by shape),
        positions [B,T]. Returns (logits [B,T,V], h2 [B,T,H]). `cache`: an HF DynamicCache for cached steps."""
        L = self.midlayer
        h = self.fuse(hidden) if hidden.shape[-1] != self.norm.weight.shape[0] else hidden
        x = torch.cat([L.input_layernorm(self.embed[ids]), L.hidden_norm(h)], dim=-1)
        T, S = ids.shape[1], positions[0, -1].item() + 1
        mask = None
        if T > 1:  # causal over this call's queries; everything cached before them is visible
            mask = torch.full((T, S), float("-inf")).triu(S - T + 1)[None, None]
        attn, _ = L.self_attn(
            x, position_embeddings=self.rotary(x, positions), attention_mask=mask, past_key_values=cache
        )
        h1 = h + attn
        h2 = h1 + L.mlp(L.post_attention_layernorm(h1))
        return self.lm_head(self.norm(h2)), self.norm(h2) if self.eagle31 else h2

    def fuse(self, aux):
        """fc over the captured states (with EAGLE 3.1, each normalised by its own fc_norm first)."""
        if self.eagle31:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1), strict=True)], -1)
        return self.fc(aux)


def make_drafter(
    cfg: DeepseekV3Config, target_hidden: int, num_aux: int, embed: np.ndarray, seed: int = 0, eagle31: bool = False
) -> Eagle3MLADrafter:
    """Random weights at unit activation scale, norms perturbed so a swapped or skipped norm shows."""
    model = Eagle3MLADrafter(cfg, target_hidden, num_aux, embed, eagle31).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def checkpoint_tensors(model: Eagle3MLADrafter) -> dict[str, np.ndarray]:
    """The published tensor names and values (rotary buffers left out)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if "rotary" not in k}


def ttt_mask(T: int, steps: int) -> torch.Tensor:
    """Additive attention mask [1, 1, steps*T, steps*T] over `steps` copies of a T-token sequence laid end to end
    (copy i holds TTT step i's rows): query (i, t) sees step 0's keys up to t (causal) and its own row t's keys of
    steps 1..i (EAGLE-3 paper, Sec. 3.3 "training-time test"; SpecForge's unrolled attention)."""
    step, pos = torch.arange(steps).repeat_interleave(T), torch.arange(T).repeat(steps)
    q_step, q_pos, k_step, k_pos = step[:, None], pos[:, None], step[None], pos[None]
    visible = ((k_step == 0) & (k_pos <= q_pos)) | ((k_step >= 1) & (k_step <= q_step) & (k_pos == q_pos))
    return torch.where(visible, 0.0, float("-inf"))[None, None]


def ttt_logits(model: Eagle3MLADrafter, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> torch.Tensor:
    """The training-time-test unroll [steps, B, T, V], from the EAGLE-3 recipe: row t of step 0 pairs target state t
    with token t+1 at position t; step j feeds step j-1's h2 with token t+1+j (0 past the end) at position t+j.
    Attention of step j runs HF's DeepseekV3Attention (eager: a dense masked softmax) over the attention inputs of
    steps 0..j concatenated along the sequence, under `ttt_mask`."""
    L = model.midlayer
    B, T = ids.shape
    h, xs, positions, out = model.fuse(aux), [], [], []
    for j in range(steps):
        tokens = torch.zeros_like(ids)
        tokens[:, : T - 1 - j] = ids[:, 1 + j :]
        xs.append(torch.cat([L.input_layernorm(model.embed[tokens]), L.hidden_norm(h)], dim=-1))
        positions.append(torch.arange(T) + j)
        x, pos = torch.cat(xs, dim=1), torch.cat(positions)[None].expand(B, -1)
        attn, _ = L.self_attn(x, position_embeddings=model.rotary(x, pos), attention_mask=ttt_mask(T, j + 1))
        h1 = h + attn[:, -T:]  # the rows of step j
        h2 = h1 + L.mlp(L.post_attention_layernorm(h1))
        out.append(model.lm_head(model.norm(h2)))
        h = model.norm(h2) if model.eagle31 else h2
    return torch.stack(out)
