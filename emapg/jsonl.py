"""JSON-lines files that survive a kill mid-write: one appender, two readers.

* :func:`append_jsonl` writes a batch of records in one flushed, fsynced write, so a batch is all or nothing
  (a kill can only leave a torn *last* line).
* :func:`read_jsonl` reads a file another process may still be appending to (metrics, guard events): every
  line that parses, a torn one skipped, the file left as it is.
* :func:`read_jsonl_repairing` reads a file this process is about to append to (eval items, recorded
  searches): the records before a torn tail, which is cut off the file so the next append starts on a
  line boundary (the batch it belonged to is redone).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["append_jsonl", "parse_lines", "read_jsonl", "read_jsonl_repairing"]


def append_jsonl(path: str | Path, records: list[dict[str, Any]], *, escape_non_ascii: bool = False,
                 durable: bool = True) -> None:
    """Append ``records`` in one write, flushed to disk (nothing is written for an empty list).

    Text is written as UTF-8; ``escape_non_ascii`` writes ``\\uXXXX`` escapes instead (``json.dumps``' default,
    the form of the trainer's ``guard.jsonl`` and ``samples.jsonl``). ``durable=False`` skips the fsync (tens of
    ms on a busy disk) for a per-step log whose last records an OS crash may take (``samples.jsonl``); a killed
    process still leaves at most a torn last line."""
    if not records:
        return
    payload = "".join(json.dumps(r, ensure_ascii=escape_non_ascii) + "\n" for r in records).encode()
    with open(path, "ab") as f:
        f.write(payload)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def parse_lines(data: bytes, **loads: Any) -> tuple[list[Any], int]:
    """The records of JSON-lines ``data`` (``json.loads(line, **loads)`` of each line) and how many non-blank lines were
    skipped. Each line is decoded on its own, so a line cut mid-character by a kill (records are written as UTF-8) is
    one skipped line, not an undecodable file; lines end at ``\n`` only (a JSON string may hold U+2028)."""
    records, skipped = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line.decode("utf-8"), **loads))
        except (UnicodeDecodeError, ValueError, RecursionError):  # torn, not JSON, an over-long integer, too deep
            skipped += 1
    return records, skipped


def read_jsonl(path: str | Path) -> list[Any]:
    """Every record of ``path`` whose line parses; a line cut by a kill mid-write (or a blank one) is skipped."""
    return parse_lines(Path(path).read_bytes())[0]


def read_jsonl_repairing(path: str | Path) -> list[Any]:
    """The records of ``path`` ([] when absent) up to a torn line, which is removed from the file with all
    after it (and not returned)."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    records, good_end, start = [], 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            break  # no newline: a write was cut short
        try:
            records.append(json.loads(data[start:end]))
        except json.JSONDecodeError:
            break
        good_end = start = end + 1
    if good_end < len(data):
        log.warning("%s: dropping a torn record at byte %d (interrupted write); it will be redone", path, good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return records
