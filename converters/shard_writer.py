"""Orbax's numpy handler with the array data written by one `write` per array, past the page cache where it can.

Profiled on the project's VM, most of a conversion's CPU time went to the kernel copying each byte into the page
cache (`copy_folio_from_iter_atomic`, a quarter of all samples) and to TensorStore encoding each array into a new
buffer first; a write with O_DIRECT moves the same bytes by DMA (0.04 CPU s/GiB against 0.4-1.9 buffered).
Measured again for this handler (2 x 256 MiB float32 saved to ext4 on the 2-core VM, `getrusage` CPU time):
Orbax's `NumpyHandler` 0.34 CPU s/GiB and 0.49 s/GiB wall, this writer 0.05 and 0.31.

Orbax stores a numpy array as a zarr3 array of one `sharding_indexed` shard: the raw little-endian bytes of its one
inner chunk, then the shard index (offset and length, two little-endian uint64) and the index's CRC32C. When the
spec Orbax builds is exactly that, `DirectNumpyHandler` (a `TypeHandler` of its own, registered through Orbax's
public registry; it overrides nothing of Orbax's) lets TensorStore create the array (its zarr.json) and writes the
shard file itself; any other spec (compression, chunked arrays, casts, OCDBT) goes to Orbax's `NumpyHandler`.
Restore is Orbax's own: the files are the ones TensorStore writes (a test compares them byte for byte).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxspec.io.direct import ALIGN, open_direct, refused

MAX_WRITE = 1 << 30  # Linux writes at most ~2 GiB per call


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as zarr3's `crc32c` codec computes it (only ever over a 16-byte shard index here)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array on its own page-aligned anonymous mapping (what O_DIRECT can write)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)  # private: huge pages allowed
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults the first time the buffer is filled
    return np.frombuffer(buf, dtype, count).reshape(shape)


def single_shard_path(value: np.ndarray, tspec: dict[str, Any]) -> Path | None:
    """The shard file of `tspec` if it stores `value` as one uncompressed shard this module can write, else None."""
    meta, kv = json.loads(json.dumps(tspec.get("metadata", {}))), tspec.get("kvstore")  # tuples -> lists
    shape = list(value.shape)
    raw = [{"name": "bytes", "configuration": {"endian": "little"}}]
    shard = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": shape,
            "codecs": raw,
            "index_codecs": [*raw, {"name": "crc32c"}],
            "index_location": "end",
        },
    }
    if not (
        tspec.get("driver") == "zarr3"
        and isinstance(kv, dict)
        and kv.get("driver") == "file"
        and set(kv) == {"driver", "path"}
        and meta.get("shape") == shape
        and meta.get("chunk_grid") == {"name": "regular", "configuration": {"chunk_shape": shape}}
        and meta.get("codecs") == [shard]
        and set(meta) == {"shape", "chunk_grid", "codecs"}  # default chunk key encoding ("c/0/0"), dtype from value
        and value.ndim >= 1
        and value.size > 0
        and value.flags.c_contiguous
        and value.dtype.byteorder in "=|"
        and sys.byteorder == "little"
    ):
        return None
    return Path(kv["path"]) / "c" / "/".join("0" * value.ndim)


def write_shard(path: Path, value: np.ndarray) -> None:
    """Write `value` as a one-chunk zarr3 shard: data, then index and its CRC32C. O_DIRECT where the buffer is
    page-aligned and the file system supports it (the tail block is padded, then truncated), else a plain write."""
    data = memoryview(value.reshape(-1).view(np.uint8))
    index = struct.pack("<QQ", 0, data.nbytes)
    footer = index + struct.pack("<I", crc32c(index))
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = open_direct(path, flags) if np.asarray(value).ctypes.data % ALIGN == 0 else None
    if fd is not None:
        try:
            _write_direct(fd, data, footer)
            return
        except OSError as e:  # a file system that opens with O_DIRECT but wants other alignment
            if not refused(e):
                raise
        finally:
            os.close(fd)
    fd = os.open(path, flags)  # (truncates what a refused O_DIRECT write may have left)
    try:
        _write_all(fd, data)
        _write_all(fd, memoryview(footer))
    finally:
        os.close(fd)


def _write_direct(fd: int, data: memoryview, footer: bytes) -> None:
    body = data.nbytes // ALIGN * ALIGN
    _write_all(fd, data[:body])
    tail = data.nbytes - body + len(footer)
    last = mmap.mmap(-1, -(-tail // ALIGN) * ALIGN)  # page-aligned and zero-filled
    last[: data.nbytes - body] = data[body:]
    last[data.nbytes - body : tail] = footer
    _write_all(fd, memoryview(last))
    os.ftruncate(fd, data.nbytes + len(footer))


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done : done + MAX_WRITE])


class DirectNumpyHandler(ocp.type_handlers.TypeHandler):
    """A numpy `TypeHandler` (Orbax's public extension point) that writes one-shard arrays with `write_shard` and
    hands every other array, and all reading, to Orbax's own `NumpyHandler`.

    The tensorstore spec of each array is Orbax's (`type_handlers.get_json_tspec_write`), so the files and their
    metadata are the ones `NumpyHandler` would write; TensorStore still creates each zarr.json. No defensive copy:
    the caller keeps each array unchanged until its save has finished."""

    def __init__(self) -> None:
        self.numpy = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)

    def typestr(self) -> str:
        return self.numpy.typestr()

    async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]) -> Sequence[Any]:
        return await self.numpy.metadata(infos)

    async def deserialize(
        self, infos: Sequence[ocp.type_handlers.ParamInfo], args: Sequence[Any] | None = None
    ) -> Sequence[np.ndarray]:
        return await self.numpy.deserialize(infos, args)

    async def serialize(
        self,
        values: Sequence[np.ndarray],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.SaveArgs] | None = None,
    ) -> Sequence[ocp.future.Future]:
        args = list(args or [ocp.SaveArgs()] * len(values))
        ocp.type_handlers.check_input_arguments(values, infos, args)
        direct, rest = [], []
        for value, info, arg in zip(values, infos, args, strict=True):
            spec = None if info.is_ocdbt_checkpoint else _write_spec(value, info, arg)
            if spec is not None and single_shard_path(value, spec) is not None:
                direct.append((value, info, spec))
            else:
                rest.append((value, info, arg))
        futures = list(await self.numpy.serialize(*map(list, zip(*rest, strict=True)))) if rest else []
        if direct and ocp.multihost.process_index() == 0:  # as NumpyHandler: process 0 writes host arrays
            futures.append(ocp.future.CommitFutureAwaitingContractedSignals(_write_direct_all(direct), name="shard"))
        return futures


def _write_spec(value: np.ndarray, info: ocp.type_handlers.ParamInfo, arg: ocp.SaveArgs) -> dict[str, Any]:
    shape = value.shape
    return ocp.type_handlers.get_json_tspec_write(
        info, use_ocdbt=False, global_shape=shape, local_shape=shape, dtype=value.dtype, arg=arg
    )


async def _write_direct_all(items: list[tuple[np.ndarray, ocp.type_handlers.ParamInfo, dict[str, Any]]]) -> None:
    async def one(value: np.ndarray, info: ocp.type_handlers.ParamInfo, tspec: dict[str, Any]) -> None:
        await info.await_path_creation()
        await ts.open(ts.Spec(tspec), create=True, open=True, context=info.ts_context)  # writes zarr.json
        await asyncio.to_thread(write_shard, single_shard_path(value, tspec), value)

    await asyncio.gather(*(one(*item) for item in items))
