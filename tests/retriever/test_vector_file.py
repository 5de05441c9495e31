"""Passage vector files (retriever.vector_file): exact quantization bounds, the file format, builds from a
file instead of the encoder, and the shipped vectors of the bundled corpus."""

from __future__ import annotations

import gzip
import json

import faiss
import numpy as np
import pytest

from emapg.paths import BUNDLED_CORPUS, BUNDLED_VECTORS
from provision.indexes import SHIPPED_DTYPE, bundled_index, ensure_bundled_index, shipped_vectors_usable
from retriever.corpus import DocStore, file_checksum
from retriever.encoder import Encoder, make_spec
from retriever.index_builder import BuildConfig, build_index
from retriever.index_files import INDEX_FILE, read_meta
from retriever.vector_file import (FORMAT, dequantize_uint8, encoder_weights_sha256, quantize_uint8, read_vector_file,
                                   read_vector_meta, write_vector_file)


def _unit_rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_quantization_error_is_within_half_a_step_per_component():
    x = _unit_rows(500, 24)
    x[:, 5] = 0.25  # a constant dimension decodes exactly
    codes, vmin, vdiff = quantize_uint8(x)
    assert codes.dtype == np.uint8 and codes.min() == 0 and codes.max() == 255
    raw = dequantize_uint8(codes, vmin, vdiff, normalize=False)
    err = np.abs(raw - x)
    assert np.all(err <= vdiff / 510 + 1e-6)  # round-to-nearest on a grid of vdiff / 255
    assert np.all(raw[:, 5] == np.float32(0.25))
    # the extremes of every dimension are grid points: decoded (almost) exactly
    np.testing.assert_allclose(raw.min(axis=0), x.min(axis=0), atol=1e-6)
    np.testing.assert_allclose(raw.max(axis=0), x.max(axis=0), atol=1e-6)
    unit = dequantize_uint8(codes, vmin, vdiff, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)


def _meta(rows: int = 0) -> dict:
    return {"corpus": {"checksum": "sha256:abc", "rows": rows}, "encoder": {"name": "minilm"},
            "encoder_weights_sha256": "sha256:w", "normalized": True, "source_dtype": "float32"}


def test_file_round_trip_and_checks(tmp_path):
    x = _unit_rows(40, 8)
    path = write_vector_file(tmp_path / "v.npz", x, _meta(40))
    vf = read_vector_file(path)
    assert (vf.rows, vf.dim) == (40, 8) and vf.meta["format"] == FORMAT and read_vector_meta(path) == vf.meta
    np.testing.assert_allclose(vf.vectors(10, 20), dequantize_uint8(*quantize_uint8(x), normalize=True)[10:20])
    assert vf.mismatches(corpus_checksum="sha256:abc", rows=40, encoder={"name": "minilm"}, weights_sha256="sha256:w") == []
    assert vf.mismatches(corpus_checksum="sha256:zzz", rows=41, encoder={"name": "e5"}, weights_sha256="sha256:v") == [
        "corpus checksum", "rows (41 passages, the file has 40)", "encoder settings", "encoder weights"]
    with pytest.raises(ValueError, match="needs 'source_dtype'"):
        write_vector_file(tmp_path / "w.npz", x, {k: v for k, v in _meta().items() if k != "source_dtype"})
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable vector file"):
        read_vector_file(tmp_path / "junk.npz")
    # an object array needs pickle to load: refused, never unpickled
    np.savez(tmp_path / "obj.npz", codes=np.array([{"a": 1}], dtype=object), meta=np.frombuffer(b"{}", dtype=np.uint8))
    with pytest.raises(ValueError, match="not a readable vector file"):
        read_vector_file(tmp_path / "obj.npz")


def _small_corpus(tmp_path, n: int = 48):
    rows = []
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_build_from_a_vector_file_skips_the_encoder_and_serves_the_same_neighbours(tmp_path):
    corpus = _small_corpus(tmp_path)
    ref = build_index(BuildConfig(corpus=str(corpus), out=str(tmp_path / "fp32"), progress=False, chunk_size=16), log=lambda m: None)
    ref_index = faiss.read_index(str(ref.out / INDEX_FILE))
    x = ref_index.reconstruct_n(0, ref_index.ntotal)
    spec = make_spec("minilm")
    from emapg.models import resolve_model

    meta = {"corpus": {"checksum": file_checksum(corpus), "rows": len(x)}, "encoder": spec.to_dict(),
            "encoder_weights_sha256": encoder_weights_sha256(resolve_model("minilm")), "normalized": True,
            "source_dtype": "float32"}
    vfile = write_vector_file(tmp_path / "v.npz", x, meta)
    logs: list[str] = []
    res = build_index(BuildConfig(corpus=str(corpus), out=str(tmp_path / "q8"), vectors=str(vfile), progress=False,
                                  chunk_size=16), log=logs.append)
    assert any(m.startswith("decoding 48 passage vectors") for m in logs) and res.encode_seconds < 5
    got = read_meta(res.out)
    assert got["build"]["dtype"] == "uint8 vectors from float32" and got["vectors"]["checksum"] == file_checksum(vfile)
    index = faiss.read_index(str(res.out / INDEX_FILE))
    np.testing.assert_allclose(index.reconstruct_n(0, index.ntotal), read_vector_file(vfile).vectors(0, 48))
    # each passage's own text, encoded by the real query encoder, finds that passage in both indexes
    enc = Encoder(spec, device="cpu")
    q = enc.encode_queries(DocStore(res.out).contents(np.arange(0, 48, 6)), batch_size=8)
    enc.close()
    _, i_ref = ref_index.search(q, 3)
    _, i_q8 = index.search(q, 3)
    assert list(i_q8[:, 0]) == list(range(0, 48, 6)) == list(i_ref[:, 0])
    assert np.mean([len(set(a) & set(b)) for a, b in zip(i_ref, i_q8)]) >= 2.5

    # a file made for another corpus is refused, naming what differs; nothing is built
    other = tmp_path / "other.jsonl"
    other.write_text(corpus.read_text().replace("the", "a", 1))
    with pytest.raises(ValueError, match=r"--vectors .* not made for this corpus and encoder \(corpus checksum differ"):
        build_index(BuildConfig(corpus=str(other), out=str(tmp_path / "bad"), vectors=str(vfile), progress=False), log=lambda m: None)
    assert not (tmp_path / "bad").exists()
    # more passages than rows in the file
    (tmp_path / "x").mkdir()
    bigger = _small_corpus(tmp_path / "x", n=60)
    write_vector_file(tmp_path / "v40.npz", x[:40], {**meta, "corpus": {"checksum": file_checksum(bigger), "rows": 40}})
    with pytest.raises(ValueError, match="holds 40 rows, the corpus has 60 passages"):
        build_index(BuildConfig(corpus=str(bigger), out=str(tmp_path / "big"), vectors=str(tmp_path / "v40.npz"), progress=False),
                    log=lambda m: None)


def test_the_shipped_vectors_fit_the_bundled_corpus_and_build_its_index(tmp_path, monkeypatch):
    meta = read_vector_meta(BUNDLED_VECTORS)
    assert meta["corpus"]["checksum"] == file_checksum(BUNDLED_CORPUS) and meta["rows"] == 43159 and meta["dim"] == 384
    assert meta["agreement_vs_float32"]["same_top1"] >= 0.98 and meta["agreement_vs_float32"]["top3_overlap"] >= 0.98
    assert shipped_vectors_usable() and shipped_vectors_usable(64)
    assert bundled_index(64).dtype == SHIPPED_DTYPE and bundled_index(64, dtype="float32").dtype == "float32"
    monkeypatch.setenv("EMAPG_CACHE", str(tmp_path))
    logs: list[str] = []
    path = ensure_bundled_index(64, log=logs.append)
    assert any("from the shipped vectors wiki_mini.minilm-uint8.npz" in m for m in logs)
    assert read_meta(path)["build"]["dtype"] == SHIPPED_DTYPE and read_meta(path)["rows"] == 64
    logs.clear()
    assert ensure_bundled_index(64, log=logs.append) == path and logs[0].startswith("reusing")
    # the shipped vectors answer real queries: a passage's own text finds it
    index = faiss.read_index(str(path / INDEX_FILE))
    enc = Encoder(make_spec("minilm"), device="cpu")
    q = enc.encode_queries(DocStore(path).contents(np.arange(0, 64, 8)), batch_size=8)
    enc.close()
    assert list(index.search(q, 1)[1][:, 0]) == list(range(0, 64, 8))
