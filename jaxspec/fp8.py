"""FP8 block-quantised checkpoints (DeepSeek-V3, Kimi-K2-Instruct) read dequantised, and zero-copy safetensors reads.

FP8 layout: every quantised linear weight `X.weight` is float8 e4m3 [out, in] with `X.weight_scale_inv` float32
[ceil(out/br), ceil(in/bc)] (br x bc = `quantization_config.weight_block_size`, 128x128 in the published models).
Its value is `float32(w) * scale_inv` of its block, rounded once to the compute dtype: DeepSeek's own
`weight_dequant` (an fp32 product stored in the default dtype). Kept-as-float8 weights are not implemented; the
model holds the dequantised weights, so it costs what the same model in `dtype` costs (bf16: twice the FP8 bytes).
Reading dequantises one tensor at a time: the transient is that tensor in float32 plus its output.

`MappedSafetensorsDir` reads tensors as views into a read-only memory map of their file (no copy, every dtype
including float8: numpy's safetensors backend cannot read F8_E4M3). `open_checkpoint` picks the reader for a
checkpoint directory from its config.json; `load_target` and `jaxspec-convert` both use it.
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
DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def fp8_block(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 block size from a parsed config.json's quantization_config; None for a non-FP8 checkpoint."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q or q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt: {q.get('fmt')!r} is not supported (expected 'e4m3')")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
    return block[0], block[1]


def dequantized_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json of the dequantised model: the FP8 quantization_config removed (top level and text_config)."""
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


def weight_dequant(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype=np.float32) -> np.ndarray:
    """`float32(w) * scale_inv[block]` rounded once to `dtype` (DeepSeek's `weight_dequant`), one block row at a time
    so the float32 transient is one block row, not the whole matrix."""
    (r, c), (br, bc) = w.shape, block
    out = np.empty((r, c), dtype)
    for i in range(scale_inv.shape[0]):
        rows = slice(i * br, min((i + 1) * br, r))
        out[rows] = w[rows].astype(np.float32) * np.repeat(scale_inv[i].astype(np.float32), bc)[:c]
    return out


def open_checkpoint(path: str | Path, dtype=np.float32) -> SafetensorsDir:
    """The reader for an HF checkpoint directory: FP8 block weights dequantised to `dtype`, other tensors as stored.

    Raises ConfigError for an FP8 quantization_config this reader does not support.
    """
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    block = fp8_block(raw)
    return MappedSafetensorsDir(path) if block is None else Fp8DequantizedDir(path, block, dtype)


class MappedSafetensorsDir(SafetensorsDir):
    """Tensors as read-only views into a memory map of their file: no copy until the caller makes one.

    `release()` drops the maps (their resident pages would otherwise accumulate over a long read).
    """

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._maps: dict[Path, tuple[np.memmap, int, dict[str, Any]]] = {}

    def _map(self, name: str) -> tuple[np.memmap, int, dict[str, Any]]:
        f = self.files[name]
        if f not in self._maps:
            try:
                with open(f, "rb") as h:
                    (n,) = struct.unpack("<Q", h.read(8))
                    header = json.loads(h.read(n))
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
            self._maps[f] = (np.memmap(f, np.uint8, mode="r"), 8 + n, header)
        return self._maps[f]

    def _info(self, name: str) -> dict[str, Any]:
        _, _, header = self._map(name)
        if name not in header:
            raise CheckpointError(f"{self.files[name]}: tensor {name} is listed in the index but not in this file")
        return header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def get(self, name: str) -> np.ndarray:
        mm, start, _ = self._map(name)
        info = self._info(name)
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{name}: dtype {info['dtype']} is not supported (expected one of {list(DTYPES)})")
        dtype, (lo, hi) = np.dtype(DTYPES[info["dtype"]]), info["data_offsets"]
        if hi - lo != math.prod(info["shape"]) * dtype.itemsize or start + hi > mm.shape[0]:
            raise CheckpointError(f"{self.files[name]}: tensor {name} has bad data offsets [{lo}, {hi}]")
        return mm[start + lo : start + hi].view(dtype).reshape(info["shape"])

    def release(self) -> None:
        self._maps.clear()
        self._handles.clear()


class Fp8DequantizedDir(MappedSafetensorsDir):
    """Presents each FP8 weight dequantised to `dtype` and hides its scale tensor."""

    def __init__(self, path: str | Path, block: tuple[int, int], dtype=np.float32):
        super().__init__(path)
        self.block, self.dtype = block, np.dtype(dtype)
        self.scales = {n for n in self.files if n.endswith(SCALE_SUFFIX)}
        orphans = sorted(n for n in self.scales if n.removesuffix(SCALE_SUFFIX) not in self.files)
        if orphans:
            raise CheckpointError(f"{self.path}: scale tensors without their weight: {orphans}")

    def names(self) -> list[str]:
        return [n for n in self.files if n not in self.scales]

    def get(self, name: str) -> np.ndarray:
        w = super().get(name)
        if name + SCALE_SUFFIX not in self.files:
            if w.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                raise CheckpointError(f"{name}: a float8 weight without its {name}{SCALE_SUFFIX} tensor")
            return w
        scale = super().get(name + SCALE_SUFFIX)
        if w.ndim != 2:
            raise CheckpointError(f"{name}: an FP8 block-quantised weight must be 2-D, got shape {list(w.shape)}")
        (r, c), (br, bc) = w.shape, self.block
        if scale.shape != (math.ceil(r / br), math.ceil(c / bc)):
            raise CheckpointError(
                f"{name}{SCALE_SUFFIX}: expected shape [{math.ceil(r / br)}, {math.ceil(c / bc)}] for weight "
                f"{list(w.shape)} in {br}x{bc} blocks, got {list(scale.shape)}"
            )
        return weight_dequant(w, scale, self.block, self.dtype)
