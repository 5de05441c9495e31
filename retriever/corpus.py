"""Passage corpora: streaming reader, checksum, and a memory-mapped document store.

Input format (Search-R1 / FlashRAG): one JSON object per line, ``{"id", "contents"}`` where
``contents`` is ``"\\"Title\\"\\ntext"`` (wiki-18 quotes the title) or ``"Title\\ntext"``; rows with
separate ``title``/``text`` fields are accepted too. ``.jsonl`` or ``.jsonl.gz``, any size, UTF-8.

What the reader does with bad input (every error names the file and the line):

* not UTF-8, not JSON, not an object, no text field, an id that is not a string or an integer, a
  lone surrogate escape (``"\\ud800"``), a truncated or corrupt ``.gz`` stream: :class:`CorpusError`;
* **duplicate ids**: :class:`CorpusError` naming the id and the lines of its first two occurrences,
  raised when the stream ends (ids must be unique: the retriever returns hits by id, and two passages
  under one id make a hit ambiguous). Only a 64-bit hash per row is kept while streaming (8 bytes a
  passage), and the file is re-read only to name the lines when there is a duplicate;
* **empty passages** (nothing but whitespace in title and text): skipped and counted in
  :class:`CorpusReader`'s ``empty_skipped`` (the index builder puts the count in ``meta.json`` and in
  its summary); an id of a skipped passage may be reused by another one.

The document store keeps every passage's ``contents`` in one binary file plus an int64 offset
array, both memory-mapped, so looking up the k*B hits of a batch is a gather over offsets instead
of Search-R1's per-document lookups into an HF ``datasets`` object.
"""

from __future__ import annotations

import gzip
import json
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.atomic import save_npy_atomic
from emapg.digest import file_digest

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


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


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


class _BadRow(ValueError):
    """What is wrong with one row; the reader adds the file and line."""


def _row_to_passage(row: object, row_index: int, may_have_surrogates: bool) -> tuple[Passage, bool]:
    """The passage of one row (``row_index`` is its id when it has none) and whether it is empty."""
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    if "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str):
            raise _BadRow("'contents' must be a string")
        title, text = split_contents(contents)
    elif "text" in row:
        title, text = str(row.get("title", "")), row["text"]
        if not isinstance(text, str):
            raise _BadRow("'text' must be a string")
    else:
        raise _BadRow("a passage needs 'contents' (Search-R1 format) or 'title' + 'text'")
    pid = row.get("id", row_index)
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise _BadRow(f"'id' must be a string or an integer, got {type(pid).__name__}")
    passage = Passage(id=str(pid), contents=join_contents(title, text))
    if may_have_surrogates:  # JSON may spell a lone surrogate ("\\ud800"): valid JSON, not encodable text
        try:
            passage.id.encode("utf-8"), passage.contents.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _BadRow(f"contains a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), not text") from None
    return passage, not (title.strip() or text.strip())


class CorpusReader:
    """Stream a jsonl(.gz) corpus: ``for p in CorpusReader(path): ...``; constant memory whatever its size
    (plus 8 bytes a passage for the duplicate-id check). After the loop, ``rows`` passages were
    yielded and ``empty_skipped`` empty ones were skipped (the first few listed in ``empty_examples``).
    """

    def __init__(self, path: str | Path, limit: int | None = None, *, examples: int = 3):
        self.path = Path(path)
        self.limit = limit
        self.rows = 0
        self.empty_skipped = 0
        self.empty_examples: list[str] = []
        self._max_examples = examples

    def __iter__(self) -> Iterator[Passage]:
        if not self.path.is_file():
            raise CorpusError(f"corpus file not found: {self.path}")
        self.rows, self.empty_skipped, self.empty_examples = 0, 0, []
        id_hashes = array("q")
        for lineno, passage, empty in self._passages():
            if self.limit is not None and self.rows >= self.limit:
                break
            if empty:
                self.empty_skipped += 1
                if len(self.empty_examples) < self._max_examples:
                    self.empty_examples.append(f"{self.path}:{lineno}")
                continue
            id_hashes.append(hash(passage.id))
            yield passage
            self.rows += 1
        self._check_unique(id_hashes)

    def _passages(self) -> Iterator[tuple[int, Passage, bool]]:
        """(line number, passage, is empty) of every non-blank line; a passage without an id gets its
        position among the non-empty passages."""
        lineno = kept = 0
        try:
            with _open_binary(self.path) as f:
                for lineno, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise CorpusError(f"{self.path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
                    if lineno == 1:
                        line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark
                    if not line.strip():
                        continue
                    try:
                        passage, empty = _row_to_passage(json.loads(line), kept, "\\ud" in line or "\\uD" in line)
                    except json.JSONDecodeError as e:
                        raise CorpusError(f"{self.path}:{lineno}: not valid JSON ({e.msg})") from None
                    except RecursionError:
                        raise CorpusError(f"{self.path}:{lineno}: not valid JSON (nested too deeply)") from None
                    except _BadRow as e:
                        raise CorpusError(f"{self.path}:{lineno}: {e}") from None
                    except ValueError as e:  # json's int conversion: an integer of more than sys.get_int_max_str_digits() digits
                        raise CorpusError(f"{self.path}:{lineno}: not valid JSON ({e})") from None
                    kept += not empty
                    yield lineno, passage, empty
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise CorpusError(
                f"{self.path}:{lineno + 1}: the gzip stream is truncated or corrupt after line {lineno} ({e})"
            ) from None

    def _check_unique(self, id_hashes: array) -> None:
        """Equal hashes are candidates; the file is re-read (only then) to compare the ids and name the lines."""
        if len(id_hashes) < 2:
            return
        h = np.frombuffer(id_hashes, dtype=np.int64)
        order = np.argsort(h, kind="stable")
        same = h[order[1:]] == h[order[:-1]]
        if not same.any():
            return
        candidates = set(order[1:][same].tolist()) | set(order[:-1][same].tolist())
        lines: dict[str, list[int]] = {}
        row = 0
        for lineno, passage, empty in self._passages():
            if row >= len(id_hashes):
                break
            if empty:
                continue
            if row in candidates:
                lines.setdefault(passage.id, []).append(lineno)
            row += 1
        dups = {pid: ls for pid, ls in lines.items() if len(ls) > 1}
        if not dups:  # hash collisions only
            return
        pid, ls = min(dups.items(), key=lambda kv: kv[1][1])  # the duplicate seen first while reading
        more = f" ({len(dups)} ids are duplicated)" if len(dups) > 1 else ""
        raise CorpusError(
            f"{self.path}:{ls[1]}: duplicate passage id {pid!r} (first on line {ls[0]}){more}; "
            "ids must be unique: hits are returned by id"
        )


def iter_corpus(path: str | Path, limit: int | None = None) -> Iterator[Passage]:
    """Stream passages from a jsonl(.gz) corpus (see :class:`CorpusReader` for what is skipped or rejected)."""
    return iter(CorpusReader(path, limit))


def file_checksum(path: str | Path, algo: str = "sha256") -> str:
    """Checksum of the corpus file's bytes (compressed bytes for .gz): ``"sha256:<hex>"``."""
    return f"{algo}:{file_digest(path, algo)}"


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
