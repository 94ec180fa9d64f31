"""FP8 block-quantised checkpoints (DeepSeek-V3, Kimi-K2-Instruct): dequantised on read.

Every quantised linear weight `X.weight` is float8 e4m3 [out, in] with `X.weight_scale_inv` float32
[ceil(out/128), ceil(in/128)]; its value is `float32(w) * scale_inv` of its 128x128 block (DeepSeek's
`weight_dequant`). The converter stores the result in its --dtype (bf16 by default: one rounding, as the reference
kernel does); kept-as-fp8 storage is not implemented. numpy's safetensors backend cannot read F8_E4M3, so those
tensors are read from the file directly (header offsets; `ml_dtypes.float8_e4m3fn`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec.config import ConfigError
from jaxspec.hf import CheckpointError, SafetensorsDir

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}


def fp8_block(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 block size from a parsed config.json's quantization_config; None for a non-FP8 checkpoint."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q or q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt: {q.get('fmt')!r} is not supported (expected 'e4m3')")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
    return block[0], block[1]


def dequantized_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json of the dequantised model: the FP8 quantization_config removed (top level and text_config)."""
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


class Fp8DequantizedDir(SafetensorsDir):
    """A SafetensorsDir that presents each FP8 weight dequantised (float32) and hides its scale tensor."""

    def __init__(self, path: str | Path, block: tuple[int, int]):
        super().__init__(path)
        self.block = block
        self.scales = {n for n in self.files if n.endswith(SCALE_SUFFIX)}
        orphans = sorted(n for n in self.scales if n.removesuffix(SCALE_SUFFIX) not in self.files)
        if orphans:
            raise CheckpointError(f"{self.path}: scale tensors without their weight: {orphans}")
        self._headers: dict[Path, tuple[int, dict]] = {}

    def names(self) -> list[str]:
        return [n for n in self.files if n not in self.scales]

    def get(self, name: str) -> np.ndarray:
        if name + SCALE_SUFFIX not in self.files:
            return super().get(name)
        w = self._raw(name).astype(np.float32)
        scale = np.asarray(super().get(name + SCALE_SUFFIX), np.float32)
        if w.ndim != 2:
            raise CheckpointError(f"{name}: an FP8 block-quantised weight must be 2-D, got shape {list(w.shape)}")
        (r, c), (br, bc) = w.shape, self.block
        if scale.shape != (math.ceil(r / br), math.ceil(c / bc)):
            raise CheckpointError(
                f"{name}{SCALE_SUFFIX}: expected shape [{math.ceil(r / br)}, {math.ceil(c / bc)}] for weight "
                f"{list(w.shape)} in {br}x{bc} blocks, got {list(scale.shape)}"
            )
        return w * np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:r, :c]

    def _raw(self, name: str) -> np.ndarray:
        """Read one tensor from its file by the header's offsets (for dtypes numpy's backend lacks)."""
        f = self.files[name]
        if f not in self._headers:
            with open(f, "rb") as h:
                (n,) = struct.unpack("<Q", h.read(8))
                self._headers[f] = (8 + n, json.loads(h.read(n)))
        start, header = self._headers[f]
        info = header[name]
        if info["dtype"] not in RAW_DTYPES:
            return super().get(name)
        lo, hi = info["data_offsets"]
        with open(f, "rb") as h:
            h.seek(start + lo)
            data = h.read(hi - lo)
        return np.frombuffer(data, RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
