"""Bounded-memory on-disk builds: a build killed mid-way resumes to the same bytes; memory-mapped
indexes are shared between processes (RSS vs PSS of the mapping, read from /proc)."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

BUILD = """
import sys
from retriever.ondisk import DiskVectors, build_ondisk
v = DiskVectors(sys.argv[1], 4096, int(sys.argv[2]))
build_ondisk(v, sys.argv[3], index_type=sys.argv[4], metric="ip", train_sample=4096, seed=0, max_build_ram_mb=int(sys.argv[5]),
             log=lambda m: None, progress=False)
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _write_emb(d: Path, rows: int, dim: int) -> Path:
    emb = d / "emb"
    emb.mkdir(parents=True)
    x = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for i in range(0, rows, 4096):
        np.save(emb / f"chunk_{i // 4096:05d}.npy", x[i : i + 4096].astype(np.float16))
    return emb


def _build(emb: Path, rows: int, out: Path, index_type: str, ram_mb: int = 1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD, str(emb), str(rows), str(out), index_type, str(ram_mb)], env=_env())


@pytest.mark.parametrize("index_type", ["IVF32,PQ8", "SQ8"])
def test_build_killed_midway_resumes_to_identical_bytes(tmp_path, index_type):
    rows = 60_000  # 1365-row blocks (max_build_ram_mb=1, 32-d): 44 blocks
    emb = _write_emb(tmp_path, rows, 32)
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    assert _build(emb, rows, ref, index_type).wait(120) == 0

    proc = _build(emb, rows, killed, index_type)
    deadline = time.monotonic() + 120
    while len(list((killed / "blocks").glob("block_*.faiss"))) < 3:
        assert proc.poll() is None, "the build finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list((killed / "blocks").glob("block_*.faiss")))
    assert not (killed / "index.faiss").exists() and 3 <= done_before < 44

    assert _build(emb, rows, killed, index_type).wait(120) == 0
    stats = json.loads((killed / "blocks" / "done.json").read_text())
    assert stats["blocks_reused"] >= done_before and stats["blocks_total"] == 44
    for name in ("index.faiss", "index.ivfdata"):
        if (ref / name).exists() or (killed / name).exists():
            assert filecmp.cmp(ref / name, killed / name, shallow=False), name
    assert (ref / "index.ivfdata").exists() == index_type.startswith("IVF")


SEARCH_AND_REPORT = """
import sys, time, numpy as np
from pathlib import Path
from retriever.ondisk import read_index
import faiss
index = read_index(sys.argv[1], mmap=True)
ivf = faiss.try_extract_index_ivf(index)
if ivf is not None:
    ivf.nprobe = ivf.nlist  # touch every list
index.search(np.random.default_rng(0).standard_normal((4, index.d)).astype("float32"), 5)
print("ready", flush=True)
sys.stdin.readline()  # hold the mapping until the parent has read /proc
"""


def _mapping(pid: int, name: str) -> dict[str, int]:
    """Rss and Pss (bytes) of the process's mappings of files named ``name``."""
    totals, current = {"Rss": 0, "Pss": 0}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:  # a mapping header
                current = len(parts) >= 6 and parts[-1].endswith("/" + name)
            elif current and parts[0].rstrip(":") in totals:
                totals[parts[0].rstrip(":")] += int(parts[1]) * 1024
    return totals


@pytest.mark.parametrize("index_type,mapped", [("SQ8", "index.faiss"), ("IVF32,SQ8", "index.ivfdata")])
def test_two_processes_share_one_copy_of_a_mapped_index(tmp_path, index_type, mapped):
    rows = 40_000
    emb = _write_emb(tmp_path, rows, 64)
    assert _build(emb, rows, tmp_path / "idx", index_type, ram_mb=64).wait(120) == 0
    size = (tmp_path / "idx" / mapped).stat().st_size
    procs = [subprocess.Popen([sys.executable, "-c", SEARCH_AND_REPORT, str(tmp_path / "idx")], env=_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    try:
        for p in procs:
            while (line := p.stdout.readline()) and line.strip() != "ready":  # FAISS prints to stdout too
                pass
            assert line.strip() == "ready"
        seen = [_mapping(p.pid, mapped) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    for s in seen:
        # each process has (nearly) the whole file resident, but is charged only half of it: one shared copy
        assert s["Rss"] >= 0.9 * size, (s, size)
        assert s["Pss"] <= 0.6 * s["Rss"], (s, size)
    print(f"\n{index_type}: {mapped} {size} B; per process Rss {seen[0]['Rss']} B, Pss {seen[0]['Pss']} B")


def test_ondisk_ivfpq_with_rerank_from_disk_finds_what_flat_finds(retriever_index):
    """`emapg index build --ondisk --rerank-depth` end to end: float16 embeddings on disk, inverted lists
    in index.ivfdata, exact re-rank from the embeddings; searched as the server does (Searcher)."""
    from tests.fixtures.retriever import build_small_index
    from retriever.searcher import Searcher

    small = build_small_index(index_type="IVF8,PQ24", ondisk=True, rerank_depth=40, emb_dtype="float16", train_sample=399)
    meta = json.loads((small.index_dir / "meta.json").read_text())
    assert meta["ondisk"]["peak_rss_bytes"] > 0 and (small.index_dir / "index.ivfdata").is_file()
    assert np.load(small.index_dir / "emb" / "chunk_00000.npy", mmap_mode="r").dtype == np.float16
    questions = [q["question"] for q in retriever_index.questions[:64]]
    flat = Searcher(retriever_index.index_dir, device="cpu")
    ondisk = Searcher(small.index_dir, device="cpu", mmap=True)
    ids_flat, scores_flat = flat.search(questions, 3)
    ids_disk, scores_disk = ondisk.search(questions, 3)
    # the first stage sees every list (nprobe 16 >= 8 lists), the re-rank is exact on fp16 vectors: Flat's top-3
    assert (ids_disk == ids_flat).mean() >= 0.95
    np.testing.assert_allclose(scores_disk, scores_flat, atol=2e-3)
    assert ondisk.fingerprint["rerank_depth"] == 40 and ondisk.fingerprint["id"] != flat.fingerprint["id"]
