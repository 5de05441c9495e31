"""Make ``data/corpus/wiki_mini.minilm-uint8.npz``: the bundled corpus's MiniLM passage vectors, 8-bit.

1. the fp32 MiniLM Flat index of the whole bundled corpus: ``--from-index DIR`` (a finished fp32 index
   of this corpus and encoder, checked), else built here (``emapg index build``, ~7.6 min on 2 cores);
2. its vectors quantized per dimension to uint8 (:mod:`retriever.vector_file`) and written with a record
   of the corpus, the encoder and its weights' hash;
3. how much retrieval changes: the top-3 passages of ``--questions`` held-out questions per QA set
   (seeded sample of each test split), fp32 index vs the decoded vectors -- same top-1, top-3 overlap --
   printed and stored in the file's record.

    python scripts/build_bundled_vectors.py                       # build the fp32 index, then the file
    python scripts/build_bundled_vectors.py --from-index ~/.cache/emapg/indexes/wiki_mini-minilm-flat-float32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from-index", default=None, help="a finished fp32 MiniLM Flat index of the bundled corpus (else built)")
    p.add_argument("--questions", type=int, default=100, help="held-out questions per QA set for the agreement check")
    p.add_argument("--out", default=None, help="output file (default: emapg.paths.BUNDLED_VECTORS)")
    args = p.parse_args(argv)

    import faiss
    import numpy as np

    from emapg.models import resolve_model
    from emapg.paths import BUNDLED_CORPUS, BUNDLED_VECTORS
    from provision.indexes import ENCODER, bundled_index
    from retriever.corpus import file_checksum
    from retriever.encoder import Encoder, make_spec
    from retriever.index_builder import build_index
    from retriever.index_files import INDEX_FILE, read_meta
    from retriever.vector_file import encoder_weights_sha256, read_vector_file, write_vector_file
    from tasks.datasets import QA_DATASETS, load_dataset

    spec = make_spec(ENCODER)
    checksum = file_checksum(BUNDLED_CORPUS)
    if args.from_index:
        index_dir = Path(args.from_index)
    else:
        index_dir = Path(tempfile.mkdtemp(prefix="bundled-fp32-")) / "index"
        cfg = bundled_index(None, dtype="float32").build_config()
        cfg.out = str(index_dir)
        build_index(cfg)
    meta = read_meta(index_dir)
    want = {"checksum": checksum, "limit": None, "encoder": spec.to_dict(), "index_type": "Flat", "dtype": "float32"}
    found = {"checksum": meta["corpus"]["checksum"], "limit": meta["corpus"].get("limit"), "encoder": meta["encoder"],
             "index_type": meta["index_type"], "dtype": meta["build"].get("dtype")}
    if want != found:
        p.error(f"{index_dir} is not an fp32 MiniLM Flat index of the whole bundled corpus: "
                f"{', '.join(k for k in want if want[k] != found[k])} differ")
    index = faiss.read_index(str(index_dir / INDEX_FILE))
    vectors = index.reconstruct_n(0, index.ntotal)

    # how much the 8-bit vectors change what is retrieved, on held-out questions of every QA set
    questions = [ex.question for ds in QA_DATASETS for ex in load_dataset(ds, limit=args.questions, seed=0)]
    encoder = Encoder(spec, device="cpu", bf16=False)  # the reference retrieval is fp32's, as the vectors
    q = encoder.encode_queries(questions, batch_size=64)
    encoder.close()
    _, ref = index.search(q, 3)

    out = Path(args.out) if args.out else BUNDLED_VECTORS
    record = {
        "corpus": {"file": BUNDLED_CORPUS.name, "checksum": checksum, "rows": int(index.ntotal)},
        "encoder": spec.to_dict(),
        "encoder_weights_sha256": encoder_weights_sha256(resolve_model(ENCODER)),
        "normalized": bool(spec.normalize),
        "source_dtype": "float32",
        "made_by": "scripts/build_bundled_vectors.py",
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_vector_file(out, vectors, record)
    decoded = read_vector_file(out)
    flat = faiss.IndexFlatIP(decoded.dim)
    flat.add(decoded.vectors(0, decoded.rows))
    _, got = flat.search(q, 3)
    agreement = {
        "questions": len(questions), "per_dataset": args.questions, "data_seed": 0,
        "same_top1": float(np.mean(got[:, 0] == ref[:, 0])),
        "top3_overlap": float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(got, ref)])),
        "max_abs_component_error": float(np.abs(decoded.vectors(0, decoded.rows) - vectors).max()),
    }
    write_vector_file(out, vectors, {**record, "agreement_vs_float32": agreement})
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {index.ntotal} x {decoded.dim}); vs fp32 on "
          f"{len(questions)} held-out questions: same top-1 {agreement['same_top1']:.1%}, top-3 overlap "
          f"{agreement['top3_overlap']:.1%}, max |component error| {agreement['max_abs_component_error']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
