"""Build the bundled ``data/`` folder from the collected source files in ``shared/data``.

Usage (from the repository root)::

    python scripts/bundle_data.py --shared ../shared/data            # everything
    python scripts/bundle_data.py --shared ../shared/data --only corpus

Deterministic: the same inputs give byte-identical outputs (gzip level 9, mtime 0, no
file name in the gzip header, keys in a fixed order, ``ensure_ascii=False``).
Provenance, licences and row counts of every output are documented in ``data/README.md``.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_jsonl_gz(path: Path, rows: Iterable[dict]) -> int:
    """Write ``rows`` as gzip-compressed JSON lines, byte-reproducibly; return the row count."""
    buf = io.BytesIO()
    n = 0
    # filename="" and mtime=0 keep the gzip header free of paths and timestamps.
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        for row in rows:
            gz.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
            n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return n


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- corpus


def build_corpus(shared: Path, out: Path) -> dict[str, int]:
    """wiki_mini corpus → Search-R1 format: ``{"id", "contents": "\\"Title\\"\\ntext", "source"}``.

    The shared corpus stores ``title\\ntext`` with a bare title; wiki-18 (and therefore the
    Search-R1 retrieval server and its prompts) wraps the title in double quotes without
    escaping inner quotes, so we do exactly that.
    """
    rows = []
    for rec in read_jsonl(shared / "wiki_mini_corpus" / "corpus.jsonl"):
        title, sep, text = rec["contents"].partition("\n")
        if not sep or not text.strip():
            raise ValueError(f"corpus row {rec['id']!r} has no 'title\\ntext' contents")
        rows.append({"id": str(rec["id"]), "contents": f'"{title}"\n{text}', "source": rec["source"]})
    return {"corpus/wiki_mini.jsonl.gz": write_jsonl_gz(out / "corpus" / "wiki_mini.jsonl.gz", rows)}


BUILDERS: dict[str, Callable[[Path, Path], dict[str, int]]] = {
    "corpus": build_corpus,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=REPO_ROOT.parent / "shared" / "data",
                        help="folder holding the collected source files (shared/data)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data", help="output data folder")
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append",
                        help="build only these parts (repeatable); default: all")
    args = parser.parse_args(argv)
    if not args.shared.is_dir():
        print(f"error: source folder {args.shared} does not exist (pass --shared)", file=sys.stderr)
        return 2
    for name in args.only or list(BUILDERS):
        for rel, n in BUILDERS[name](args.shared, args.out).items():
            size = (args.out / rel).stat().st_size
            print(f"{rel:45s} {n:7d} rows {size / 1e6:7.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
