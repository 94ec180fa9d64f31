"""Checkpoint I/O: every file the target and the drafter are read from or written to.

hf.py                  HF safetensors reading and the target's name table (both directions)
direct.py              O_DIRECT reads and writes, with the buffered fallback
fp8.py                 FP8 block-quantised checkpoints, read as FP8 or dequantised; one-read safetensors access
compressed_tensors.py  the compressed-tensors INT4 "pack-quantized" codec
export.py              writing a target as an HF DeepseekV3 checkpoint (INT4 experts)
drafter_config.py      EAGLE-3 drafter config.json (SGLang, speculators, MLA): read, checked against the target, written
drafter_hf.py          EAGLE-3 drafter tensors (SGLang, speculators, MLA), read and written by one table
orbax.py               the layout of a `jaxspec-convert target` output, and restoring its parameters
load.py                load_target, load_drafter, load_drafter_or_random

`Target`, `Drafter` and `check_mesh` are re-exported: what the loaders return and check, for the converters, which
reach runtime objects only through io (an import contract in pyproject.toml).
"""

from jaxspec.io.drafter_hf import save_drafter
from jaxspec.io.export import save_target
from jaxspec.io.hf import CheckpointError
from jaxspec.io.load import load_drafter, load_drafter_or_random, load_target
from jaxspec.runtime import Drafter, Target, check_mesh

__all__ = [
    "CheckpointError",
    "Drafter",
    "Target",
    "check_mesh",
    "load_drafter",
    "load_drafter_or_random",
    "load_target",
    "save_drafter",
    "save_target",
]
