#!/bin/sh
# The Redis image's entrypoint (docker/redis/Dockerfile), with the behaviour of the official image's
# docker-entrypoint.sh that docker-compose.yml relies on: started as root, it gives /data to the redis user
# and runs redis-server as that user; any other command runs as given.
set -e
if [ "$(id -u)" = "0" ] && { [ "$1" = "redis-server" ] || [ "${1#-}" != "$1" ]; }; then
  [ "$1" = "redis-server" ] || set -- redis-server "$@"
  find /data \! -user redis -exec chown redis:redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
