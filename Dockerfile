# Conveyor for a GPU host (default) or a CPU-only machine:
#   docker build -t conveyor:cuda .
#   docker build --build-arg VARIANT=cpu -t conveyor:cpu .
# The default model is fetched into the /data volume on first start, or baked into the image for
# hosts without internet access:
#   docker build --build-arg WITH_DEFAULT_MODEL=1 -t conveyor:cuda .
# Models named by a Hugging Face id are cached under /data/huggingface.
ARG VARIANT=cuda

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
# gcc and the Python headers build Triton's kernel launcher on first start.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc curl \
       ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# g++ builds the CPU paged-attention kernel for the host's own CPU on first start.
FROM python:3.12-slim AS base-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates g++ \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# hadolint ignore=DL3006
FROM base-${VARIANT}
ENV VIRTUAL_ENV=/opt/conveyor \
    PATH=/opt/conveyor/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CONVEYOR_CACHE=/data/cache \
    HF_HOME=/data/huggingface \
    TRITON_CACHE_DIR=/data/cache/triton
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY server /src/server
COPY bench /src/bench
RUN pip install --no-cache-dir "/src[otel,kv-events]" && rm -rf /src
RUN useradd --create-home --uid 1000 conveyor && mkdir -p /data && chown conveyor /data
USER 1000
# Before VOLUME: what is written to /data here is what a new volume starts with.
ARG WITH_DEFAULT_MODEL=0
RUN if [ "$WITH_DEFAULT_MODEL" = 1 ]; then conveyor download; fi
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]
