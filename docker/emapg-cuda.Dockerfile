# ema-pg, CUDA image: vLLM + faiss-gpu (the GPU profile of requirements/).
# Build from the repository root:  docker build -f docker/emapg-cuda.Dockerfile -t emapg:cuda .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    EMAPG_CACHE=/cache \
    PIP_BREAK_SYSTEM_PACKAGES=1

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev build-essential git curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements/ requirements/
RUN pip3 install -r requirements/gpu.txt

COPY pyproject.toml README.md Makefile ./
COPY app/ app/
COPY emapg/ emapg/
COPY agent/ agent/
COPY retriever/ retriever/
COPY trainer/ trainer/
COPY eval/ eval/
COPY tasks/ tasks/
COPY provision/ provision/
COPY configs/ configs/
COPY data/ data/
RUN pip3 install --no-deps -e .

VOLUME ["/cache", "/runs"]
ENTRYPOINT ["emapg"]
CMD ["--help"]
