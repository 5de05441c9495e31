"""GPU paths (fp16 encoder on every visible GPU, FAISS cloned to GPU); skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_fp16_gpu_encoder_matches_fp32_cpu():
    from retriever.encoder import Encoder, make_spec

    texts = [f"passage number {i} about the history of science and physics" for i in range(200)]
    cpu = Encoder(make_spec("minilm"), device="cpu").encode(texts)
    gpu_encoder = Encoder(make_spec("minilm"), device="cuda")
    assert gpu_encoder.fp16 and all(d.startswith("cuda") for d in gpu_encoder.devices)
    gpu = gpu_encoder.encode(texts, batch_size=16)  # several batches: spread over all GPUs
    assert np.min(np.sum(cpu * gpu, axis=1)) > 0.999  # cosine between fp16-GPU and fp32-CPU vectors


def test_gpu_search_agrees_with_cpu(retriever_index):
    import faiss

    from retriever.searcher import Searcher

    questions = [q["question"] for q in retriever_index.questions[:100]]
    cpu = Searcher(retriever_index.index_dir, device="cpu").retrieve(questions, 3)
    searcher = Searcher(retriever_index.index_dir, device="cuda")
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        assert searcher.index_device != "cpu"
    gpu = searcher.retrieve(questions, 3)
    top1 = np.mean([a[0]["id"] == b[0]["id"] for a, b in zip(cpu, gpu)])
    assert top1 >= 0.95  # fp16 may swap near-ties, nothing more
