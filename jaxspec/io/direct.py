"""O_DIRECT file access (past the page cache) with the fallback every caller needs: the platform may lack O_DIRECT,
a file system may refuse it at open (tmpfs, some network file systems), or accept it and then refuse the first read
or write for its alignment. Each refusal is EINVAL; the caller then does buffered I/O instead."""

from __future__ import annotations

import errno
import os
from pathlib import Path

ALIGN = 4096  # O_DIRECT: buffer, file offset and length aligned to the logical block size (4 KiB covers all)


def open_direct(path: str | Path, flags: int) -> int | None:
    """`os.open(path, flags | O_DIRECT)`, or None where O_DIRECT is missing or the file system refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as e:
        if not refused(e):
            raise
        return None


def refused(e: OSError) -> bool:
    """The error an O_DIRECT open, read or write raises where the file system will not do it (fall back)."""
    return e.errno == errno.EINVAL
