"""The index fingerprint changes with every setting a ranking depends on, and with nothing else."""

from __future__ import annotations

import copy
import json

import httpx

from retriever.fingerprint import model_files_sha256, fingerprint_of, index_fingerprint

META = {
    "format_version": 1,
    "encoder": {"name": "minilm", "pooling": "mean", "query_prefix": "", "passage_prefix": "", "max_length": 128, "normalize": True},
    "dim": 384, "metric": "ip", "index_type": "Flat", "nprobe": 16, "rows": 20,
    "corpus": {"path": "/a/corpus.jsonl", "checksum": "sha256:aa", "rows": 20, "limit": None, "empty_skipped": 0},
    "bm25": False, "chunk_size": 8192, "train": None,
    "build": {"finished_at": "2026-01-01T00:00:00Z", "encode_seconds": 1.0, "passages_per_s": 20.0, "total_seconds": 2.0, "dtype": "float32"},
}

# (path into meta, new value): each is a setting the vectors or the ranking depend on
CHANGES = [
    (("corpus", "checksum"), "sha256:bb"), (("corpus", "limit"), 10), (("rows",), 10),
    (("encoder", "name"), "e5-small"), (("encoder", "pooling"), "cls"), (("encoder", "query_prefix"), "query: "),
    (("encoder", "passage_prefix"), "passage: "), (("encoder", "max_length"), 256), (("encoder", "normalize"), False),
    (("build", "dtype"), "bfloat16"), (("dim",), 768), (("index_type",), "HNSW32"), (("metric",), "l2"),
    (("nprobe",), 32), (("train",), {"sample": 1000, "seed": 0}),
]
# what does not change a vector or a ranking
NON_CHANGES = [
    (("corpus", "path"), "/elsewhere/corpus.jsonl"), (("chunk_size",), 256), (("build", "finished_at"), "2027-01-01T00:00:00Z"),
    (("build", "encode_seconds"), 9.0), (("build", "passages_per_s"), 1.0), (("build", "total_seconds"), 9.0),
    (("corpus", "empty_skipped"), 3),
]


def _set(meta: dict, path: tuple[str, ...], value) -> dict:
    out = copy.deepcopy(meta)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def test_every_setting_changes_the_fingerprint_and_nothing_else_does():
    base = index_fingerprint(META, encoder_sha256="sha256:w")
    ids = {base["id"]}
    for path, value in CHANGES:
        fp = index_fingerprint(_set(META, path, value), encoder_sha256="sha256:w")
        assert fp["id"] not in ids, path
        ids.add(fp["id"])
    for path, value in NON_CHANGES:
        assert index_fingerprint(_set(META, path, value), encoder_sha256="sha256:w") == base, path
    assert index_fingerprint(META, encoder_sha256="sha256:other")["id"] != base["id"]
    assert index_fingerprint(META, encoder_sha256="sha256:w", nprobe=64)["id"] != base["id"]
    assert index_fingerprint(META, encoder_sha256="sha256:w", hybrid_bm25=True)["id"] != base["id"]
    assert index_fingerprint(META, encoder_sha256="sha256:w", nprobe=16) == base  # the stored nprobe
    # the query encoder's precision: float32 is the reference (ids from before are kept), bf16/fp16 queries rank otherwise
    assert index_fingerprint(META, encoder_sha256="sha256:w", query_dtype="float32") == base
    reduced = {index_fingerprint(META, encoder_sha256="sha256:w", query_dtype=d)["id"] for d in ("bfloat16", "float16")}
    assert len(reduced) == 2 and base["id"] not in reduced


def test_encoder_hash_follows_weight_and_tokenizer_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "README.md").write_text("docs")
    first = model_files_sha256(tmp_path)
    (tmp_path / "README.md").write_text("other docs")
    assert model_files_sha256(tmp_path) == first
    (tmp_path / "tokenizer.json").write_text('{"a": 1}')
    second = model_files_sha256(tmp_path)
    assert second != first
    (tmp_path / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 63)  # same size, one byte differs
    assert model_files_sha256(tmp_path) not in (first, second)


def _build(tmp_path, name: str, **options):
    from retriever.index_builder import BuildConfig, build_index
    from retriever.index_files import read_meta

    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"id": f"d{i}", "contents": f'"Doc {i}"\npassage number {i} about topic {i % 3}'}) + "\n"
                                  for i in range(12)))
    cfg = BuildConfig(corpus=str(corpus), out=str(tmp_path / name), encoder="minilm", max_length=32, device="cpu",
                      progress=False, **options)
    build_index(cfg, log=lambda m: None)
    return read_meta(tmp_path / name)


def test_real_builds_fingerprint_settings_not_resume_granularity(tmp_path):
    a = _build(tmp_path, "a", chunk_size=4, batch_size=2)
    b = _build(tmp_path, "b", chunk_size=8, batch_size=8)
    c = _build(tmp_path, "c", chunk_size=4, batch_size=2, limit=10)
    assert a["fingerprint"] == b["fingerprint"]
    assert c["fingerprint"]["id"] != a["fingerprint"]["id"] and c["fingerprint"]["rows"] == 10
    # an index from before fingerprints: computed from its meta.json alone, the same value
    old = {k: v for k, v in a.items() if k != "fingerprint"}
    (tmp_path / "a" / "meta.json").write_text(json.dumps(old))
    assert fingerprint_of(tmp_path / "a") == a["fingerprint"]
    assert fingerprint_of(tmp_path / "a", query_dtype="float32") == a["fingerprint"]
    served_bf16 = fingerprint_of(tmp_path / "a", query_dtype="bfloat16")
    assert served_bf16["query_dtype"] == "bfloat16" and served_bf16["id"] != a["fingerprint"]["id"]


def test_health_serves_the_fingerprint(retriever_index, retriever_server):
    body = httpx.get(retriever_server.url + "/health", timeout=10).json()
    assert body["fingerprint"] == fingerprint_of(retriever_index.index_dir, query_dtype=body["index"]["dtype"])
    assert body["fingerprint"]["rows"] == retriever_index.rows and len(body["fingerprint"]["id"]) == 16

