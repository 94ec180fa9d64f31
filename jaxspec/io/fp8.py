"""FP8 block-quantised checkpoints (DeepSeek-V3, Kimi-K2-Instruct) read as FP8 with their scales, or dequantised;
one-read safetensors reads.

FP8 layout: every quantised linear weight `X.weight` is float8 e4m3 [out, in] with `X.weight_scale_inv` float32
[ceil(out/br), ceil(in/bc)] (br x bc = `quantization_config.weight_block_size`, 128x128 in the published models).
Its value is `float32(w) * scale_inv` of its block, rounded once to the compute dtype: DeepSeek's own
`weight_dequant` (an fp32 product stored in the default dtype).

By default the model keeps these weights FP8 (`KimiConfig.fp8`, `jaxspec.models.quant.Fp8Array`):
`Fp8Dir.fp8_parts` hands the stored bytes and scales over unchanged, and `jaxspec.io.hf.block_scales` re-indexes the
scales for our layout (a weight split per head keeps the checkpoint's blocks, finer where a head straddles one).
Where the model is unquantised (`load_target(..., dequantize_fp8=True)`), `Fp8Dir.get` dequantises one tensor at a
time, one block row at a time: the transient beyond the tensor in `dtype` is one block row in float32.

`RawSafetensorsDir` reads each tensor with one positioned read into its array (every dtype, including float8:
numpy's safetensors backend cannot read F8_E4M3), or many at once into caller's arrays with O_DIRECT (`read_many`,
the converter's path for routed experts). `open_checkpoint` picks the reader for a checkpoint directory
from its config.json; `load_target` and `jaxspec-convert` both use it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import queue
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec.config import read_fp8
from jaxspec.io.direct import ALIGN, open_direct, refused
from jaxspec.io.hf import DTYPES, SCALE_SUFFIX, CheckpointError, SafetensorsDir


def fp8_block(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 block size from a parsed config.json's quantization_config; None for a non-FP8 checkpoint."""
    fp8 = read_fp8(raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"))
    return None if fp8 is None else fp8.block


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
    """The reader for an HF checkpoint directory: FP8 block weights as stored (`Fp8Dir.fp8_parts`) or dequantised to
    `dtype` (`get`), other tensors as stored.

    Raises ConfigError for an FP8 quantization_config this reader does not support.
    """
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    block = fp8_block(raw)
    return RawSafetensorsDir(path) if block is None else Fp8Dir(path, block, dtype)


class RawSafetensorsDir(SafetensorsDir):
    """Reads each tensor with one positioned read straight into its array (the one copy a read needs; every dtype).

    The headers are parsed once per file; `release()` closes the files.
    """

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._files: dict[Path, tuple[int, int, dict[str, Any]]] = {}  # path -> (fd, data start, header)
        self._staging: list[mmap.mmap] = []  # read_many's page-aligned O_DIRECT windows, one per stream

    def _open_raw(self, name: str) -> tuple[int, int, dict[str, Any]]:
        f = self.files[name]
        if f not in self._files:
            fd = os.open(f, os.O_RDONLY)
            try:
                (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, n, 8))
            except (struct.error, ValueError, UnicodeDecodeError) as e:
                os.close(fd)
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
            self._files[f] = (fd, 8 + n, header)
        return self._files[f]

    def _info(self, name: str) -> dict[str, Any]:
        header = self._open_raw(name)[2]
        if name not in header:
            raise CheckpointError(f"{self.files[name]}: tensor {name} is listed in the index but not in this file")
        return header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F8_E4M3", ...)."""
        return self._info(name)["dtype"]

    def location(self, name: str) -> tuple[str, int]:
        """(file, byte offset) of a tensor's data: reading in this order reads each file front to back."""
        return str(self.files[name]), self._open_raw(name)[1] + self._info(name)["data_offsets"][0]

    def _span(self, name: str, out: np.ndarray | None) -> tuple[int, int, np.ndarray]:
        """(file offset, end, destination array) of a tensor, every header field and `out` checked."""
        _, start, _ = self._open_raw(name)
        info = self._info(name)
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{name}: dtype {info['dtype']} is not supported (expected one of {list(DTYPES)})")
        dtype, (lo, hi) = np.dtype(DTYPES[info["dtype"]]), info["data_offsets"]
        if hi - lo != math.prod(info["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{self.files[name]}: tensor {name} has bad data offsets [{lo}, {hi}]")
        if out is None:
            out = np.empty(info["shape"], dtype)
        elif out.shape != tuple(info["shape"]) or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"{name}: out must be a C-contiguous {dtype} array of shape {info['shape']}, got {out.dtype} "
                f"{list(out.shape)}"
            )
        return start + lo, start + hi, out

    def read_many(self, items: list[tuple[str, np.ndarray]]) -> None:
        """Read each (tensor, out) pair into `out` (as `get` does): each file's tensors in file order, split into
        READ_STREAMS runs read concurrently with O_DIRECT through page-aligned 16 MiB windows where the file system
        allows it (no page-cache copy, which cost the converter more CPU than any other step); elsewhere one
        positioned read per tensor."""
        by_file: dict[Path, list[tuple[int, int, np.ndarray, str]]] = {}
        for name, out in items:
            by_file.setdefault(self.files[name], []).append((*self._span(name, out), name))
        parts = []  # each file's spans in READ_STREAMS runs of about equal bytes, read concurrently (queue depth)
        for f, spans in by_file.items():
            spans.sort(key=lambda s: s[0])
            total, run, acc = sum(hi - lo for lo, hi, _, _ in spans), [], 0
            for span in spans:
                run.append(span)
                acc += span[1] - span[0]
                if acc >= total / READ_STREAMS:
                    parts.append((f, run))
                    run, acc = [], 0
            parts += [(f, run)] if run else []
        if not self._staging:  # kept for the reader's lifetime: fresh pages cost a fault and zeroing on every use
            self._staging = [mmap.mmap(-1, STAGING_BYTES, flags=mmap.MAP_PRIVATE) for _ in range(READ_STREAMS)]
        free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for stage in self._staging:
            free.put(stage)

        def read(part: tuple[Path, list]) -> bool:
            stage = free.get()
            try:
                return _read_direct(*part, stage)
            finally:
                free.put(stage)

        with ThreadPoolExecutor(READ_STREAMS, thread_name_prefix="jaxspec-read") as pool:
            direct = list(pool.map(read, parts))
        for (_, spans), done in zip(parts, direct, strict=True):
            for lo, hi, out, name in [] if done else spans:
                self._read(name, lo, hi, out)

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as stored; read into `out` (and returned) if given: a C-contiguous array of its shape and
        stored dtype, so a caller can reuse its buffers and read straight into place."""
        lo, hi, out = self._span(name, out)
        self._read(name, lo, hi, out)
        return out

    def _read(self, name: str, lo: int, hi: int, out: np.ndarray) -> None:
        fd = self._open_raw(name)[0]
        view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        while done < hi - lo:  # a single read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[done:]], lo + done)
            if n == 0:
                raise CheckpointError(f"{self.files[name]}: file ends inside tensor {name}")
            done += n

    def release(self) -> None:
        """Close the files (and safetensors handles) opened so far."""
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        self._handles.clear()

    def __del__(self) -> None:
        try:
            self.release()
        except (AttributeError, TypeError):  # __init__ failed, or the interpreter is already tearing `os` down
            pass


class Fp8Dir(RawSafetensorsDir):
    """Presents each FP8 weight as stored with its scale (`fp8_parts`) or dequantised to `dtype` (`get`); hides the
    scale tensors from `names()`."""

    def __init__(self, path: str | Path, block: tuple[int, int], dtype=np.float32):
        super().__init__(path)
        self.block, self.out_dtype = block, np.dtype(dtype)
        self.scales = {n for n in self.files if n.endswith(SCALE_SUFFIX)}
        orphans = sorted(n for n in self.scales if n.removesuffix(SCALE_SUFFIX) not in self.files)
        if orphans:
            raise CheckpointError(f"{self.path}: scale tensors without their weight: {orphans}")

    def names(self) -> list[str]:
        return [n for n in self.files if n not in self.scales]

    def fp8_parts(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(float8_e4m3fn values [out, in], float32 scale_inv [ceil(out/br), ceil(in/bc)]) of an FP8 weight, as
        stored; None for a tensor without a scale."""
        if name + SCALE_SUFFIX not in self.files:
            return None
        w, scale = super().get(name), super().get(name + SCALE_SUFFIX)
        if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            raise CheckpointError(f"{name}: a weight with a {SCALE_SUFFIX} must be F8_E4M3, got {self.dtype(name)}")
        if w.ndim != 2:
            raise CheckpointError(f"{name}: an FP8 block-quantised weight must be 2-D, got shape {list(w.shape)}")
        (r, c), (br, bc) = w.shape, self.block
        if scale.shape != (math.ceil(r / br), math.ceil(c / bc)):
            raise CheckpointError(
                f"{name}{SCALE_SUFFIX}: expected shape [{math.ceil(r / br)}, {math.ceil(c / bc)}] for weight "
                f"{list(w.shape)} in {br}x{bc} blocks, got {list(scale.shape)}"
            )
        return w, scale.astype(np.float32, copy=False)

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor, dequantised if it has a scale (`out`: see `RawSafetensorsDir.get`; a stored-dtype buffer, so
        not for a dequantised weight)."""
        if out is not None and name + SCALE_SUFFIX in self.files:
            raise ValueError(f"{name}: an FP8 weight is dequantised into a new array, not read into `out`")
        parts = self.fp8_parts(name)
        if parts is not None:
            return weight_dequant(*parts, self.block, self.out_dtype)
        w = super().get(name, out)
        if w.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
            raise CheckpointError(f"{name}: a float8 weight without its {name}{SCALE_SUFFIX} tensor")
        return w


STAGING_BYTES = 16 << 20
READ_STREAMS = 4  # concurrent reads per batch: one synchronous O_DIRECT stream left the disk idle between windows


def _read_direct(path: Path, spans: list[tuple[int, int, np.ndarray, str]], stage: mmap.mmap) -> bool:
    """Fill each (lo, hi, out, name) span of `path` (sorted by lo) from O_DIRECT reads of aligned windows the size of
    `stage` (page-aligned); False, having read nothing, where the file system refuses O_DIRECT (tmpfs)."""
    fd = open_direct(path, os.O_RDONLY)
    if fd is None:
        return False
    stage_u8 = np.frombuffer(stage, np.uint8)
    try:
        i, done = 0, 0  # the span being filled, and its bytes filled so far
        while i < len(spans):
            lo, hi, out, name = spans[i]
            pos = (lo + done) // ALIGN * ALIGN
            try:
                n = os.preadv(fd, [stage], pos)
            except OSError as e:  # opened with O_DIRECT but wants another alignment: nothing copied yet, fall back
                if not refused(e) or (i, done) != (0, 0):
                    raise
                return False
            end = pos + n
            if end <= lo + done:
                raise CheckpointError(f"{path}: file ends inside tensor {name}")
            while i < len(spans) and spans[i][0] + done < end:  # copy every span this window covers
                lo, hi, out, name = spans[i]
                take = min(hi, end) - (lo + done)
                out_u8 = out.reshape(-1).view(np.uint8)
                out_u8[done : done + take] = stage_u8[lo + done - pos : lo + done - pos + take]
                done += take
                if lo + done < hi:
                    break  # continues in the next window
                i, done = i + 1, 0
    finally:
        os.close(fd)
    return True
