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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Lazy re-exports (PEP 562): `import jaxspec.serving.scheduler` must not import jax, so the public names are imported
# on first use (`from jaxspec import generate` works as before).
_EXPORTS = {
    "ConfigError": "jaxspec.config",
    "KimiConfig": "jaxspec.config",
    "GenerateResult": "jaxspec.decoding.generate",
    "Progress": "jaxspec.decoding.generate",
    "generate": "jaxspec.decoding.generate",
    "Sampling": "jaxspec.decoding.sampling_params",
    "CheckpointError": "jaxspec.io",
    "load_drafter": "jaxspec.io",
    "load_target": "jaxspec.io",
    "Eagle3Config": "jaxspec.models.eagle3",
    "Drafter": "jaxspec.runtime",
    "Target": "jaxspec.runtime",
}

if TYPE_CHECKING:
    from jaxspec.config import ConfigError, KimiConfig
    from jaxspec.decoding.generate import GenerateResult, Progress, generate
    from jaxspec.decoding.sampling_params import Sampling
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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
