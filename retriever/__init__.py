"""Retrieval service: a Search-R1 compatible dense (FAISS) / BM25 retriever.

Build, inspect and serve an index::

    emapg index build --corpus data/corpus/wiki_mini.jsonl.gz --out indexes/wiki_mini   # resumable
    emapg index info indexes/wiki_mini
    emapg serve --index indexes/wiki_mini --port 8000                                    # 127.0.0.1

Use it from Python::

    from retriever.client import RetrieverClient
    from retriever.launch import RetrieverServer

    with RetrieverServer("indexes/wiki_mini") as server, RetrieverClient(server.url) as client:
        hits = client.retrieve(["who wrote hamlet"], topk=3)   # [[{"id", "contents", "score"}, ...]]

Modules: ``corpus`` (reader, memory-mapped document store), ``encoder`` (pooling, prefixes,
devices), ``index_builder`` (chunked, resumable encoding; FAISS/BM25), ``searcher`` (one
index in memory, batched queries, RRF hybrid), ``server`` (FastAPI app, micro-batching),
``client`` (sync/async httpx clients), ``launch`` (server subprocess), ``cli``.
"""
