"""jaxspec: EAGLE-3 speculative decoding for Kimi-K2.5 / DeepSeek-V3 INT4 MoE targets in JAX.

Public API (re-exports only; nothing runs at import time):

    load_target(dir, mesh=..., dtype=...) -> Target      HF-layout checkpoint or `jaxspec-convert target` output
    load_drafter(dir, target) -> Drafter                 EAGLE-3 drafter, SGLang/SpecForge or speculators layout
    generate(target, drafter, prompts, num_steps=k, ...) -> GenerateResult (.tokens, .text, .stats)
                                                         on_progress= gets a Progress after every stream_cycles cycles
    Target.random / Target.abstract, KimiConfig.preset / from_pretrained, Eagle3Config, Sampling
    ConfigError, CheckpointError                         raised with every problem named at once

Also: `jaxspec.bundled.load_pair()` (the bundled trained pair), `jaxspec.tokenizer.load_tokenizer`,
`jaxspec.training` (drafter training), `jaxspec.profiling.tune` (the draft-depth tuner), `sharding.mesh.make_mesh`.
"""

from jaxspec.config import ConfigError, KimiConfig
from jaxspec.decoding.generate import GenerateResult, Progress, generate
from jaxspec.decoding.sampling import Sampling
from jaxspec.io import CheckpointError, load_drafter, load_target
from jaxspec.models.eagle3 import Eagle3Config
from jaxspec.runtime import Drafter, Target

__all__ = [
    "GenerateResult",
    "Progress",
    "Sampling",
    "generate",
    "CheckpointError",
    "ConfigError",
    "Drafter",
    "Eagle3Config",
    "KimiConfig",
    "Target",
    "load_drafter",
    "load_target",
]
