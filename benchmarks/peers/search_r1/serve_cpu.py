"""Run Search-R1's own retrieval server (``retrieval_server.py`` beside this file, unmodified) on a CPU.

``retrieval_server.py`` is Search-R1's ``search_r1/search/retrieval_server.py`` at commit
a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06 (Apache-2.0, ``LICENSE`` beside it), copied byte for byte.
Its ``__main__`` block hard-codes port 8000 on 0.0.0.0 and calls ``.cuda()`` unconditionally, so this
runner does what that block does, with three differences, all stated in the benchmark's JSON:

- ``.cuda()`` on modules and tensors returns them unchanged and ``torch.cuda.empty_cache`` does
  nothing (there is no GPU here); no other line of the peer's code is touched;
- the server binds 127.0.0.1 on the port given;
- ``--fp16`` chooses the encoder's precision: Search-R1's ``__main__`` sets ``retrieval_use_fp16=True``;
  CPUs have no fast fp16 matmul, so the benchmark measures both and compares against the faster.

Everything else is the peer's: its FastAPI app and ``/retrieve`` handler, its ``datasets``-backed
corpus lookup, its per-request ``batch_search`` (with its tqdm bar) and its encoder.

    python serve_cpu.py --index DIR/index.faiss --corpus corpus.jsonl.gz --model MINILM_DIR --port 8123
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cpu_shim() -> None:
    """``.cuda()`` is the identity, and the CUDA cache calls are no-ops (CPU only)."""
    import torch

    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", required=True, help="FAISS index file (rows = corpus lines)")
    p.add_argument("--corpus", required=True, help="corpus JSONL (optionally .gz) with `id` and `contents`")
    p.add_argument("--model", required=True, help="local folder of the query encoder (the index's own encoder)")
    p.add_argument("--retriever-name", default="minilm", help="Search-R1's `retriever_name` (e5/bge add their prefixes; ours adds none)")
    p.add_argument("--pooling", default="mean", help="Search-R1's pooling method (the index's encoder uses mean pooling)")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fp16", action="store_true", help="the encoder in fp16, as Search-R1's __main__ sets it")
    args = p.parse_args()

    cpu_shim()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import retrieval_server as peer  # the unmodified peer module
    import uvicorn

    # What the peer's __main__ does, with the port, host, precision and faiss_gpu=False (see the docstring).
    peer.config = peer.Config(
        retrieval_method=args.retriever_name,
        index_path=args.index,
        corpus_path=args.corpus,
        retrieval_topk=args.topk,
        faiss_gpu=False,
        retrieval_model_path=args.model,
        retrieval_pooling_method=args.pooling,
        retrieval_query_max_length=256,
        retrieval_use_fp16=args.fp16,
        retrieval_batch_size=512,
    )
    peer.retriever = peer.get_retriever(peer.config)
    uvicorn.run(peer.app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
