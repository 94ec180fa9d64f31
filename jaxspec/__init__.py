"""jaxspec: EAGLE-3 speculative decoding for Kimi-K2.5 / DeepSeek-V3 INT4 MoE targets in JAX.

Public API (re-exports only; nothing runs at import time).
"""

from jaxspec.config import ConfigError, KimiConfig
from jaxspec.decoding.generate import GenerateResult, generate
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafter import Drafter, load_drafter
from jaxspec.hf import CheckpointError
from jaxspec.models.eagle3 import Eagle3Config
from jaxspec.target import Target, load_target

__all__ = [
    "GenerateResult",
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
