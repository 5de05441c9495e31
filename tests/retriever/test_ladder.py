"""The ladder's metrics against hand-computed cases, and its rung specs, recommendation and extrapolation."""

from __future__ import annotations

import numpy as np
import pytest

from retriever.ladder import (Rung, answer_recall, build_rung, coarse_key, default_rungs, exact_topk, extrapolate, parse_rung, recall_at_k,
                             recommend)
from retriever.ondisk import DiskVectors, RerankIndex


def test_recall_at_k_hand_computed():
    truth = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    found = np.array([[1, 0, 9, 3], [7, 8, -1, 4]])
    # query 0: top-1 {1} vs {0} -> 0; top-3 {1,0,9} vs {0,1,2} -> 2/3; top-4 {1,0,9,3} vs {0,1,2,3} -> 3/4
    # query 1: top-1 {7} vs {4} -> 0; top-3 {7,8} vs {4,5,6} -> 0;     top-4 {7,8,4} vs {4,5,6,7} -> 2/4
    assert recall_at_k(found, truth, 1) == 0.0
    assert recall_at_k(found, truth, 3) == pytest.approx((2 / 3 + 0) / 2)
    assert recall_at_k(found, truth, 4) == pytest.approx((3 / 4 + 2 / 4) / 2)
    assert recall_at_k(truth, truth, 4) == 1.0


def test_answer_recall_hand_computed():
    passages = [['"Hamlet"\nHamlet is a tragedy by William Shakespeare.', '"Paris"\nParis is the capital.'],
                ['"Moon"\nThe Moon orbits Earth.', '"Mars"\nMars is red.'],
                ['"X"\nShakespeare-like prose.']]  # fmt: skip
    answers = [["william shakespeare"], ["Mars", "the red planet"], ["Shakespeare's"]]
    # q0: answer in passage 1 -> found at k=1; q1: "mars" only in passage 2 -> k=2; q2: "shakespeare s" absent (word boundaries)
    assert answer_recall(passages, answers, 1) == pytest.approx(1 / 3)
    assert answer_recall(passages, answers, 2) == pytest.approx(2 / 3)


def test_rung_specs_round_trip_and_reject_typos():
    r = parse_rung("IVF512,PQ48;nprobe=16;rerank=100")
    assert r == Rung("IVF512,PQ48", nprobe=16, rerank=100) and parse_rung(r.name) == r
    with pytest.raises(ValueError, match="nprobe=N"):
        parse_rung("IVF512,PQ48;nprob=16")
    names = [r.name for r in default_rungs(43_159, 384)]
    assert names[0] == "Flat" and "IVF512,PQ48;nprobe=64;rerank=100" in names and "HNSW32,SQ8;ef=64" in names


def test_recommend_picks_the_cheapest_rung_over_the_floor():
    rows = [{"name": "Flat", "recall_at_3": 1.0, "bytes_per_passage": 1536},
            {"name": "SQ8", "recall_at_3": 0.99, "bytes_per_passage": 384},
            {"name": "PQ", "recall_at_3": 0.80, "bytes_per_passage": 48},
            {"name": "PQ+rerank", "recall_at_3": 0.96, "bytes_per_passage": 56}]  # fmt: skip
    assert recommend(rows, 0.95) == "PQ+rerank"
    assert recommend(rows, 0.97) == "SQ8"
    assert recommend(rows, 1.01) is None


def test_extrapolation_scales_codes_with_dim_and_keeps_row_overhead():
    # IVF-PQ 48 bytes/vector + 8-byte ids at 384-d, 1024 lists; measured file = codes + ids + centroids + PQ tables
    layout = {"code_size": 48, "nlist": 1024, "ids": 8, "opq": False, "pq": True}
    rows, dim = 100_000, 384
    measured = rows * (48 + 8) + 1024 * dim * 4 + 256 * dim * 4
    t = extrapolate(layout, measured, rows, dim, 21_000_000, 768, rerank=True)
    nlist_t = 1 << round(np.log2(1024 * np.sqrt(210)))
    expect = 21_000_000 * (96 + 8) + nlist_t * 768 * 4 + 256 * 768 * 4
    assert t["ram_bytes"] == pytest.approx(expect, rel=1e-6)
    assert t["disk_vectors_gib"] == pytest.approx(21_000_000 * 768 * 2 / 2**30, abs=0.01)


def _disk_vectors(tmp_path, x: np.ndarray, chunk: int) -> DiskVectors:
    emb = tmp_path / "emb"
    emb.mkdir()
    for i in range(0, len(x), chunk):
        np.save(emb / f"chunk_{i // chunk:05d}.npy", x[i : i + chunk])
    return DiskVectors(emb, chunk, len(x))


def test_exact_topk_and_rerank_match_brute_force(tmp_path):
    import faiss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    q = rng.standard_normal((20, 32)).astype(np.float32)
    vectors = _disk_vectors(tmp_path, x, 700)  # blocks and chunks that do not align
    d, i = exact_topk(vectors, q, 10, "ip", block_rows=512)
    brute = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :10]
    assert (i == brute).all()
    np.testing.assert_allclose(d, np.take_along_axis(q @ x.T, brute, 1), rtol=1e-5)
    # a re-rank over every row is exact whatever the first stage
    coarse = faiss.index_factory(32, "IVF4,PQ4", faiss.METRIC_INNER_PRODUCT)
    coarse.train(x)
    coarse.add(x)
    faiss.extract_index_ivf(coarse).nprobe = 4
    d2, i2 = RerankIndex(coarse, vectors, 3000, "ip").search(q, 10)
    assert (i2 == brute).all()
    np.testing.assert_allclose(d2, d, rtol=1e-5)


def test_rungs_share_a_build_of_the_same_factory_and_the_coarse_centroids_of_the_same_lists(tmp_path):
    import faiss

    from retriever.ondisk import read_index

    assert [coarse_key(f) for f in ("IVF64,PQ8", "IVF64,Flat", "OPQ8,IVF64,PQ8", "HNSW32,SQ8", "IVF64")] == ["IVF64", "IVF64", None, None, None]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4000, 32)) + 3 * rng.standard_normal((40, 32))[rng.integers(0, 40, 4000)]).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)  # unit vectors: each row is its own best inner product
    vectors = _disk_vectors(tmp_path, x, 1500)
    built: dict = {}
    kw = dict(train_sample=4000, seed=0, max_build_ram_mb=64, threads=1, built=built)
    first = build_rung(Rung("IVF16,Flat", nprobe=4), tmp_path / "a", vectors, "ip", **kw)
    second = build_rung(Rung("IVF16,SQ8", nprobe=4), tmp_path / "b", vectors, "ip", **kw)
    again = build_rung(Rung("IVF16,SQ8", nprobe=16, rerank=50), tmp_path / "c", vectors, "ip", **kw)
    assert first["coarse_quantizer_from"] is None and second["coarse_quantizer_from"] == str(tmp_path / "a")
    assert first["peak_build_anon_bytes"] > 0
    indexes = [read_index(tmp_path / d) for d in "ab"]  # kept: the quantizers belong to them
    centroids = [faiss.extract_index_ivf(index).quantizer.reconstruct_n(0, 16) for index in indexes]
    np.testing.assert_array_equal(centroids[0], centroids[1])
    assert again == second and (tmp_path / "c" / "index.faiss").stat().st_ino == (tmp_path / "b" / "index.faiss").stat().st_ino
    # the shared-quantizer rung is a working index: every row found by its own vector at full nprobe
    index = indexes[1]
    faiss.extract_index_ivf(index).nprobe = 16
    _, found = index.search(x[:50], 1)
    assert (found[:, 0] == np.arange(50)).mean() > 0.9


def test_index_help_lists_the_ladder_and_shard_commands(capsys):
    from app.cli import main

    with pytest.raises(SystemExit):
        main(["index", "--help"])
    out = capsys.readouterr().out
    assert "ladder" in out and "shard" in out
    with pytest.raises(SystemExit):
        main(["index", "ladder", "--help"])
    out = capsys.readouterr().out
    assert "--target-rows" in out and "--dim" in out and "--recall-floor" in out


def test_ladder_refuses_a_bad_rung_naming_the_option(tmp_path):
    from app.cli import main

    assert main(["index", "ladder", "--index", str(tmp_path), "--out", str(tmp_path / "l"), "--rungs", "IVF8,PQ4;nprob=2"]) == 2
