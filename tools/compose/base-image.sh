#!/usr/bin/env bash
# The Python base image when none can be pulled: Debian bookworm (python3 is 3.11) bootstrapped into a folder
# with debootstrap and imported with `docker import`, cached as a tarball in $FLYWHEEL_COMPOSE_CACHE so a fresh
# clone reuses it. Prints the image name. DOCKER_HOST must name the engine to import into.
set -euo pipefail
CACHE=${FLYWHEEL_COMPOSE_CACHE:-/var/cache/flywheel-compose}
IMAGE=${BASE_IMAGE:-flywheel-base/debian-python:bookworm}
TAR=$CACHE/debian-bookworm-python3.tar
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$CACHE"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then echo "$IMAGE"; exit 0; fi
if [ ! -s "$TAR" ]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
  root=$CACHE/rootfs-bookworm.partial
  rm -rf "$root"
  echo "base-image: debootstrap bookworm into $root (first run only)" >&2
  # python-is-python3: `python` as in the python:3.11-slim image; python3-venv: the Dockerfiles' `python -m venv`.
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" >&2
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/tmp/* "$root"/usr/share/doc/*
  tar --numeric-owner -C "$root" -cf "$TAR.partial" . && mv "$TAR.partial" "$TAR"
  rm -rf "$root"
fi
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$TAR" "$IMAGE" >&2
echo "$IMAGE"
