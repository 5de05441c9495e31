"""File digests: the one way the project hashes a file's bytes (in blocks, so any size fits in bounded memory).

* :func:`file_digest`: the hex digest of one file (``sha256`` by default; any :func:`hashlib.new` name).
* :func:`update_with_file`: feed a file's bytes into a running hash, for digests over several files
  (the digest of their concatenation, or of names and contents interleaved).

Digests recorded on disk (index metadata, vector files, cached model builds) are computed here, so a
change of block size or reader cannot change them: the bytes hashed are the file's, in order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["BLOCK_BYTES", "file_digest", "update_with_file"]

#: Bytes read per block (4 MiB: large enough that the hash, which releases the GIL, dominates).
BLOCK_BYTES = 1 << 22


def update_with_file(h: Any, path: str | Path) -> None:
    """Feed the bytes of ``path`` into the hash object ``h`` (``hashlib`` or anything with ``update``)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            h.update(block)


def file_digest(path: str | Path, algo: str = "sha256") -> str:
    """The hex digest of the bytes of ``path`` under ``algo`` (a :func:`hashlib.new` name)."""
    h = hashlib.new(algo)
    update_with_file(h, path)
    return h.hexdigest()
