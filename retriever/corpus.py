"""Passage corpora: streaming reader, checksum, and a memory-mapped document store.

Input format (Search-R1 / FlashRAG): one JSON object per line, ``{"id", "contents"}`` where
``contents`` is ``"\\"Title\\"\\ntext"`` (wiki-18 quotes the title) or ``"Title\\ntext"``; rows with
separate ``title``/``text`` fields are accepted too. ``.jsonl`` or ``.jsonl.gz``, any size.

The document store keeps every passage's ``contents`` in one binary file plus an int64 offset
array, both memory-mapped, so looking up the k*B hits of a batch is a gather over offsets instead
of Search-R1's per-document lookups into an HF ``datasets`` object.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.atomic import save_npy_atomic

CONTENTS_FILE = "docs.bin"
OFFSETS_FILE = "docs.offsets.npy"
IDS_FILE = "ids.bin"
ID_OFFSETS_FILE = "ids.offsets.npy"


class CorpusError(ValueError):
    """A corpus file that cannot be read, with the line that is wrong."""


def open_text(path: str | Path):
    """Open ``.gz`` or plain text files for reading as UTF-8."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def split_contents(contents: str) -> tuple[str, str]:
    """``'"Title"\\ntext'`` or ``'Title\\ntext'`` -> ``("Title", "text")``."""
    title, sep, text = contents.partition("\n")
    if not sep:
        return "", contents
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text


def join_contents(title: str, text: str) -> str:
    """The Search-R1 (wiki-18) form with a quoted title, which Search-R1 prompts expect."""
    return f'"{title}"\n{text}'


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str  # normalised to the quoted-title form

    @property
    def title(self) -> str:
        return split_contents(self.contents)[0]

    @property
    def text(self) -> str:
        return split_contents(self.contents)[1]


def _row_to_passage(row: object, where: str, row_index: int) -> Passage:
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str):
            raise CorpusError(f"{where}: 'contents' must be a string")
        title, text = split_contents(contents)
    elif "text" in row:
        title, text = str(row.get("title", "")), row["text"]
        if not isinstance(text, str):
            raise CorpusError(f"{where}: 'text' must be a string")
    else:
        raise CorpusError(f"{where}: a passage needs 'contents' (Search-R1 format) or 'title' + 'text'")
    pid = row.get("id", row_index)
    return Passage(id=str(pid), contents=join_contents(title, text))


def iter_corpus(path: str | Path, limit: int | None = None) -> Iterator[Passage]:
    """Stream passages from a jsonl(.gz) corpus; constant memory whatever its size."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    n = 0
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: not valid JSON ({e.msg})") from None
            yield _row_to_passage(row, where, n)
            n += 1


def file_checksum(path: str | Path, algo: str = "sha256") -> str:
    """Checksum of the corpus file's bytes (compressed bytes for .gz): ``"sha256:<hex>"``."""
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return f"{algo}:{h.hexdigest()}"


def write_docstore(passages: Iterator[Passage], out_dir: str | Path) -> int:
    """Write ``docs.bin`` + offsets (and the ids likewise) into ``out_dir``; return the row count.

    Offsets are collected in compact int64 arrays (21M rows: 170 MB, not a list of Python ints),
    and the offset files are written last and atomically, so a present offsets file means a
    complete store.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    offsets, id_offsets = array("q", [0]), array("q", [0])
    with open(out / CONTENTS_FILE, "wb") as fc, open(out / IDS_FILE, "wb") as fi:
        for p in passages:
            b = p.contents.encode("utf-8")
            fc.write(b)
            offsets.append(offsets[-1] + len(b))
            bi = p.id.encode("utf-8")
            fi.write(bi)
            id_offsets.append(id_offsets[-1] + len(bi))
    save_npy_atomic(out / ID_OFFSETS_FILE, np.frombuffer(id_offsets, dtype=np.int64))
    save_npy_atomic(out / OFFSETS_FILE, np.frombuffer(offsets, dtype=np.int64))
    return len(offsets) - 1


def docstore_complete(store_dir: str | Path) -> bool:
    d = Path(store_dir)
    return all((d / n).exists() for n in (CONTENTS_FILE, OFFSETS_FILE, IDS_FILE, ID_OFFSETS_FILE))


class DocStore:
    """Read-only, memory-mapped passages: ``store.lookup(indices)`` for any index array shape."""

    def __init__(self, store_dir: str | Path):
        d = Path(store_dir)
        if not docstore_complete(d):
            raise CorpusError(f"{d} is not a complete document store (rebuild the index)")
        self.offsets = np.load(d / OFFSETS_FILE, mmap_mode="r")
        self.id_offsets = np.load(d / ID_OFFSETS_FILE, mmap_mode="r")
        # np.memmap refuses empty files; an empty corpus is rejected earlier by the builder.
        self.data = np.memmap(d / CONTENTS_FILE, dtype=np.uint8, mode="r")
        self.id_data = np.memmap(d / IDS_FILE, dtype=np.uint8, mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @staticmethod
    def _gather(data: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> list[str]:
        starts = offsets[idx]
        ends = offsets[idx + 1]
        mv = memoryview(data)
        # One vectorised offset gather, then a slice of the mapped buffer per hit (no parsing).
        return [bytes(mv[s:e]).decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist())]

    def contents(self, indices: np.ndarray) -> list[str]:
        idx = np.asarray(indices, dtype=np.int64).ravel()
        return self._gather(self.data, self.offsets, idx)

    def ids(self, indices: np.ndarray) -> list[str]:
        idx = np.asarray(indices, dtype=np.int64).ravel()
        return self._gather(self.id_data, self.id_offsets, idx)

    def lookup(self, indices: np.ndarray) -> list[dict]:
        """Flat list of ``{"id", "contents"}`` for every index (row-major over ``indices``)."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"document index out of range [0, {len(self)})")
        return [{"id": i, "contents": c} for i, c in zip(self.ids(idx), self.contents(idx))]
