"""Corpus reading, the document store, and index builds (including a build killed mid-way and resumed)."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from app.cli import main as emapg_main
from emapg.paths import REPO_ROOT
from retriever.corpus import CorpusError, DocStore, iter_corpus, split_contents, write_docstore
from retriever.launch import emapg_command
from retriever.index_builder import BuildConfig, build_index
from retriever.index_files import EMB_DIR, INDEX_FILE, META_FILE, PROGRESS_FILE, read_meta

BUNDLED = REPO_ROOT / "data" / "corpus" / "wiki_mini.jsonl.gz"


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_reader_handles_quoted_unquoted_title_text_and_gzip(tmp_path):
    rows = [
        {"id": "a", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "b", "contents": "Berlin\nBerlin is the capital of Germany.", "source": "x"},
        {"id": 3, "title": "Rome", "text": "Rome is the capital of Italy."},
    ]
    plain = tmp_path / "c.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(plain.read_text())
    for path in (plain, gz):
        ps = list(iter_corpus(path))
        assert [p.id for p in ps] == ["a", "b", "3"]
        assert [p.contents for p in ps] == ['"Paris"\nParis is the capital of France.', '"Berlin"\nBerlin is the capital of Germany.', '"Rome"\nRome is the capital of Italy.']
        assert [p.title for p in ps] == ["Paris", "Berlin", "Rome"]
    assert split_contents('"A "quoted" title"\nbody\nmore') == ('A "quoted" title', "body\nmore")


def test_reader_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "T\\nx"}\n{oops\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_corpus(bad))
    bad.write_text('{"id": "a", "body": "x"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: a passage needs 'contents'"):
        list(iter_corpus(bad))
    with pytest.raises(CorpusError, match="not found"):
        list(iter_corpus(tmp_path / "missing.jsonl"))


def test_docstore_vectorised_lookup_matches_the_corpus(tmp_path):
    passages = list(iter_corpus(BUNDLED, limit=500))
    assert write_docstore(iter(passages), tmp_path) == 500
    store = DocStore(tmp_path)
    idx = np.array([[499, 0, 7], [7, 123, 1]])
    docs = store.lookup(idx)
    assert [d["id"] for d in docs] == [passages[i].id for i in idx.ravel()]
    assert [d["contents"] for d in docs] == [passages[i].contents for i in idx.ravel()]
    assert any("\u00f6" in p.contents or ord(max(p.contents)) > 127 for p in passages)  # non-ASCII round-trips
    with pytest.raises(IndexError):
        store.lookup(np.array([500]))


def test_bundled_corpus_is_read_in_search_r1_format():
    first = next(iter_corpus(BUNDLED))
    assert first.id == "vital-0" and first.contents.startswith('"0"\n0 is a number')


def _small_corpus(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for p in iter_corpus(BUNDLED, limit=n):
            f.write(json.dumps({"id": p.id, "contents": p.contents}) + "\n")
    return path


N_CHUNKS = 20
BUILD_ARGS = ["--max-length", "32", "--chunk-size", "10", "--batch-size", "10", "--device", "cpu", "--no-progress"]


def test_killed_build_resumes_from_the_last_chunk_and_equals_a_clean_build(tmp_path):
    import faiss

    corpus = _small_corpus(tmp_path / "corpus.jsonl", 10 * N_CHUNKS)
    out = tmp_path / "resumed"
    proc = subprocess.Popen(
        [*emapg_command(), "index", "build", "--corpus", str(corpus), "--out", str(out), *BUILD_ARGS],
        env=_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    progress = out / EMB_DIR / PROGRESS_FILE
    deadline = time.monotonic() + 120
    done: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.is_file():
            try:
                done = json.loads(progress.read_text())["done"]
            except (json.JSONDecodeError, KeyError):  # pragma: no cover - the file is replaced atomically
                done = []
            if len(done) >= 3:
                break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / META_FILE).exists(), "the build finished before it could be killed"
    done = json.loads(progress.read_text())["done"]
    assert 3 <= len(done) < N_CHUNKS
    before = {i: (out / EMB_DIR / f"chunk_{i:05d}.npy").stat().st_mtime_ns for i in done}
    with pytest.raises(FileNotFoundError, match="unfinished build"):
        read_meta(out)

    logs: list[str] = []
    cfg = dict(corpus=str(corpus), max_length=32, chunk_size=10, batch_size=10, device="cpu", progress=False)
    res = build_index(BuildConfig(out=str(out), **cfg), log=logs.append)  # the same command, rerun
    assert (res.chunks_reused, res.chunks_encoded) == (len(done), N_CHUNKS - len(done))
    assert f"resuming: {len(done)}/{N_CHUNKS} chunks already encoded, {N_CHUNKS - len(done)} to go" in logs
    after = {i: (out / EMB_DIR / f"chunk_{i:05d}.npy").stat().st_mtime_ns for i in done}
    assert after == before, "finished chunks were re-encoded"

    clean = tmp_path / "clean"
    res = build_index(BuildConfig(out=str(clean), **cfg), log=lambda m: None)
    assert res.chunks_encoded == N_CHUNKS and res.rows == 10 * N_CHUNKS
    a, b = faiss.read_index(str(out / INDEX_FILE)), faiss.read_index(str(clean / INDEX_FILE))
    assert a.ntotal == b.ntotal == res.rows
    np.testing.assert_allclose(a.reconstruct_n(0, res.rows), b.reconstruct_n(0, res.rows), rtol=0, atol=1e-6)
    for name in ("docs.bin", "ids.bin"):
        assert (out / name).read_bytes() == (clean / name).read_bytes()
    m1, m2 = read_meta(out), read_meta(clean)
    assert m1["corpus"]["checksum"] == m2["corpus"]["checksum"] and m1["encoder"] == m2["encoder"]


def test_resume_with_other_settings_is_refused_and_finished_index_is_kept(tmp_path):
    corpus = _small_corpus(tmp_path / "corpus.jsonl", 20)
    out = tmp_path / "idx"
    cfg = dict(corpus=str(corpus), out=str(out), chunk_size=10, batch_size=10, device="cpu", progress=False)
    build_index(BuildConfig(max_length=32, **cfg), log=lambda m: None)
    with pytest.raises(FileExistsError, match="already holds a finished index"):
        build_index(BuildConfig(max_length=32, **cfg), log=lambda m: None)
    (out / META_FILE).unlink()  # pretend the build stopped before the end
    with pytest.raises(FileExistsError, match="different settings"):
        build_index(BuildConfig(max_length=64, **cfg), log=lambda m: None)
    res = build_index(BuildConfig(max_length=32, **cfg), log=lambda m: None)
    assert res.chunks_reused == 2 and res.chunks_encoded == 0


def test_ivf_index_bm25_and_info(tmp_path, capsys):
    corpus = _small_corpus(tmp_path / "corpus.jsonl", 120)
    out = tmp_path / "ivf"
    assert emapg_main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--index-type", "IVF4,SQ8", "--bm25", "--train-sample", "100", *BUILD_ARGS]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rows"] == 120 and report["chunks_encoded"] == 12
    assert emapg_main(["index", "info", str(out)]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["index_type"] == "IVF4,SQ8" and meta["rows"] == 120 and meta["bm25"] is True
    assert meta["encoder"] == {"name": "minilm", "pooling": "mean", "query_prefix": "", "passage_prefix": "", "max_length": 32, "normalize": True}
    assert meta["corpus"]["checksum"].startswith("sha256:") and meta["files"]["index.faiss"] > 0

    from retriever.searcher import Searcher

    s = Searcher(out, device="cpu")
    target = next(p for i, p in enumerate(iter_corpus(corpus)) if i == 57)
    hits = s.retrieve([target.title], topk=3)[0]
    assert target.id in [h["id"] for h in hits]
    hybrid = Searcher(out, device="cpu", hybrid_bm25=True)
    hits = hybrid.retrieve([target.title], topk=3)[0]
    assert target.id in [h["id"] for h in hits]
    nonsense = ["zzqxv qqzvw"]  # no BM25 term in common with any passage: fusion keeps the dense order
    assert [h["id"] for h in hybrid.retrieve(nonsense, 3)[0]] == [h["id"] for h in s.retrieve(nonsense, 3)[0]]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--index-type", "NotAnIndex"], "not a valid faiss index_factory string"),
        (["--index-type", "IVF4096,Flat"], "training IVF4096,Flat failed"),
        (["--corpus", "/nonexistent.jsonl"], "corpus file not found"),
    ],
)
def test_build_errors_are_one_readable_line(tmp_path, capsys, args, message):
    corpus = _small_corpus(tmp_path / "corpus.jsonl", 12)
    base = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "x"), *BUILD_ARGS]
    if args[0] == "--corpus":
        base[3] = args[1]
        args = []
    assert emapg_main([*base, *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("emapg index: error:") and message in last, last


def test_ensure_index_reuses_a_matching_index_and_refuses_a_different_one(tmp_path):
    from retriever.index_builder import ensure_index

    corpus = _small_corpus(tmp_path / "corpus.jsonl", 10)
    cfg = dict(corpus=str(corpus), out=str(tmp_path / "idx"), max_length=32, chunk_size=10, device="cpu", progress=False)
    out = ensure_index(BuildConfig(**cfg), log=lambda m: None)
    stamp = (out / INDEX_FILE).stat().st_mtime_ns
    assert ensure_index(BuildConfig(**cfg), log=lambda m: None) == out
    assert (out / INDEX_FILE).stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(FileExistsError, match=r"other settings \(encoder\)"):
        ensure_index(BuildConfig(**{**cfg, "max_length": 64}), log=lambda m: None)
    with pytest.raises(FileExistsError, match=r"other settings \(index_type\)"):
        ensure_index(BuildConfig(**{**cfg, "index_type": "HNSW32"}), log=lambda m: None)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _build_cli(corpus: Path, out: Path, capsys) -> tuple[int, str, str]:
    rc = emapg_main(["index", "build", "--corpus", str(corpus), "--out", str(out), *BUILD_ARGS])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _truncated_gz(path: Path) -> Path:
    good = _small_corpus(path.with_suffix(""), 200)
    data = gzip.compress(good.read_bytes())
    path.write_bytes(data[: len(data) // 2])
    return path


def _non_utf8(path: Path) -> Path:
    path.write_bytes(b'{"id": "a", "contents": "T\\nfine"}\n{"id": "b", "contents": "caf\xe9"}\n')
    return path


@pytest.mark.parametrize("make, message", [
    (_truncated_gz, r"corpus\.jsonl\.gz:\d+: the gzip stream is truncated or corrupt after line \d+"),
    (_non_utf8, r"corpus\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 29\)"),
    (lambda p: _jsonl(p, [{"id": "a", "contents": "T\nx"}, '{"id": "b", "contents": ']), r"corpus\.jsonl:2: not valid JSON"),
    (lambda p: _jsonl(p, [{"id": "a", "contents": "T\nx"}, '{"id": "b", "contents": "\\ud800"}']), r"corpus\.jsonl:2: contains a lone surrogate"),
    (lambda p: _jsonl(p, [{"id": ["a"], "contents": "T\nx"}]), r"corpus\.jsonl:1: 'id' must be a string or an integer"),
    (lambda p: _jsonl(p, [{"id": "a", "contents": "T\nx"}, {"id": "b", "contents": "T\ny"}, {"id": 7, "contents": "T\nz"},
                          {"id": "b", "contents": "T\nw"}, {"id": "7", "contents": "T\nv"}]),
     r"corpus\.jsonl:4: duplicate passage id 'b' \(first on line 2\) \(2 ids are duplicated\); ids must be unique"),
])
def test_corpus_errors_name_the_file_and_line(tmp_path, capsys, make, message):
    corpus = make(tmp_path / ("corpus.jsonl.gz" if make is _truncated_gz else "corpus.jsonl"))
    rc, _, err = _build_cli(corpus, tmp_path / "idx", capsys)
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"emapg index: error: {corpus}:"), last
    assert re.search(message, last), last
    assert not (tmp_path / "idx" / "docs.offsets.npy").exists()  # the document store was not marked complete


def test_a_rejected_corpus_fixed_and_rebuilt_needs_no_overwrite(tmp_path, capsys):
    rows = [{"id": f"p{i}", "contents": f"Title {i}\nPassage number {i}."} for i in range(12)]
    corpus = _jsonl(tmp_path / "corpus.jsonl", rows + [{"id": "p3", "contents": "Again\nA second p3."}])
    out = tmp_path / "idx"
    rc, _, err = _build_cli(corpus, out, capsys)
    assert rc == 2 and "corpus.jsonl:13: duplicate passage id 'p3' (first on line 4)" in err
    _jsonl(corpus, rows)
    rc, stdout, err = _build_cli(corpus, out, capsys)
    assert rc == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["rows"] == 12


def test_empty_passages_are_skipped_and_counted(tmp_path, capsys):
    rows = [{"id": f"p{i}", "contents": f"Title {i}\nPassage number {i}."} for i in range(10)]
    rows[3:3] = [{"id": "e1", "contents": ""}, {"id": "e2", "title": " ", "text": "\n  "}]
    corpus = _jsonl(tmp_path / "corpus.jsonl", rows)
    out = tmp_path / "idx"
    rc, stdout, err = _build_cli(corpus, out, capsys)
    assert rc == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rows"] == 10 and summary["empty_passages_skipped"] == 2
    assert f"skipped 2 empty passages (first: {corpus}:4, {corpus}:5)" in err
    meta = read_meta(out)
    assert meta["rows"] == 10 and meta["corpus"]["empty_skipped"] == 2
    assert DocStore(out).ids(np.arange(10)) == [f"p{i}" for i in range(10)]
    _jsonl(corpus, [{"id": "e", "contents": " "}])
    rc, _, err = _build_cli(corpus, tmp_path / "only-empty", capsys)
    assert rc == 2 and err.strip().splitlines()[-1].endswith("has no passages (1 empty ones skipped)")
