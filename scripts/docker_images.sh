#!/usr/bin/env bash
# Build the images of docker-compose.yml on a machine with no image registry (docs/deploy-docker.md):
#   1. a Python base image from Debian's packages: mmdebstrap ... | docker import  ($SPARSE_RL_BASE_IMAGE)
#   2. a Redis image from Debian's redis-server, docker/redis/Dockerfile        ($SPARSE_RL_REDIS_IMAGE)
#   3. the project image from the Dockerfile, torch from the host's wheel       ($SPARSE_RL_IMAGE)
# The images are named by the variables docker-compose.yml reads; export the same values before
# `docker compose up`. Base images that exist already are kept (--rebuild makes them again).
#
# Usage: scripts/docker_images.sh [--host-ca] [--suite SUITE] [--mirror MIRROR] [--rebuild] [-- DOCKER BUILD ARGS]
#   --host-ca    add the host's extra CA certificates (/usr/local/share/ca-certificates) to the Python base
#                image: for a host behind a TLS-inspecting proxy, where pip in the image must trust its CA.
#                Off by default; never publish an image built with it.
#   --suite      Debian suite of the base images (default bookworm: Python 3.11)
#   --mirror     apt mirror URL, or an apt sources file (default: this host's /etc/apt/sources.list.d/debian.sources
#                or /etc/apt/sources.list when it has one, else http://deb.debian.org/debian)
#   --rebuild    make the base images again even when they exist
#   after --     more arguments for the project image's `docker build` (e.g. --build-arg PRELOAD_MODELS=tiny-llama)
# Needs root, docker (a running engine), mmdebstrap (apt-get install docker.io mmdebstrap) and python3 -m pip.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${SPARSE_RL_BASE_IMAGE:-local/debian-python:bookworm}
REDIS_IMAGE=${SPARSE_RL_REDIS_IMAGE:-local/sparse-rl-redis:bookworm}
IMAGE=${SPARSE_RL_IMAGE:-sparse-rl:cpu}
TORCH_VERSION=2.13.0
HOST_CA=0
SUITE=bookworm
MIRROR=""
REBUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --host-ca) HOST_CA=1 ;;
    --suite) SUITE=$2; shift ;;
    --mirror) MIRROR=$2; shift ;;
    --rebuild) REBUILD=1 ;;
    --) shift; break ;;
    *) echo "scripts/docker_images.sh: unknown argument $1 (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$MIRROR" ]; then
  MIRROR=http://deb.debian.org/debian
  for sources in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$sources" ] && grep -q '^[^#]' "$sources"; then MIRROR=$sources; break; fi
  done
fi
for tool in docker mmdebstrap python3; do
  command -v "$tool" >/dev/null || { echo "scripts/docker_images.sh: $tool not found (apt-get install docker.io mmdebstrap)" >&2; exit 2; }
done
# The classic builder: a docker client without the buildx plugin cannot use BuildKit.
export DOCKER_BUILDKIT=0

has_image() { [ "$REBUILD" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

# A root filesystem from Debian's packages, imported as an image ($1: image, $2: packages, then hook options).
debian_image() {
  local image=$1 packages=$2
  shift 2
  echo "== $image: mmdebstrap $SUITE ($packages) from $MIRROR"
  mmdebstrap --quiet --variant=minbase --include="$packages" "$@" "$SUITE" - "$MIRROR" \
    | docker import --change 'CMD ["/bin/bash"]' - "$image"
}

if ! has_image "$BASE_IMAGE"; then
  hooks=()
  if [ "$HOST_CA" = 1 ]; then
    certificates=(/usr/local/share/ca-certificates/*.crt)
    [ -e "${certificates[0]}" ] || { echo "scripts/docker_images.sh: --host-ca: no /usr/local/share/ca-certificates/*.crt on this host" >&2; exit 2; }
    # shellcheck disable=SC2016  # "$1" is the chroot, expanded by mmdebstrap's hook shell
    hooks=(--customize-hook="copy-in ${certificates[*]} /usr/local/share/ca-certificates/"
           --customize-hook='chroot "$1" update-ca-certificates')
  fi
  debian_image "$BASE_IMAGE" python3,python3-pip,ca-certificates,wget "${hooks[@]}"
fi
docker run --rm --network none "$BASE_IMAGE" python3 -c \
  'import sys; assert sys.version_info[:2] == (3, 11), f"the base image has Python {sys.version.split()[0]}, not 3.11"'

if ! has_image "$REDIS_IMAGE-base"; then
  debian_image "$REDIS_IMAGE-base" redis-server
fi
echo "== $REDIS_IMAGE"
docker build --network host --build-arg REDIS_BASE_IMAGE="$REDIS_IMAGE-base" -t "$REDIS_IMAGE" docker/redis

# torch: the host's wheel (its pip resolves torch==2.13.0 to the CPU build from its configured sources).
if ! ls docker/wheels/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
  echo "== torch==$TORCH_VERSION wheels into docker/wheels"
  python3 -m pip download --quiet --only-binary=:all: --python-version 3.11 --dest docker/wheels "torch==$TORCH_VERSION"
fi
echo "== $IMAGE"
docker build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" "$@" .
echo "images: SPARSE_RL_BASE_IMAGE=$BASE_IMAGE SPARSE_RL_REDIS_IMAGE=$REDIS_IMAGE SPARSE_RL_IMAGE=$IMAGE"
