#!/usr/bin/env bash
# Builds the local base image without any image registry: debootstrap a minimal Debian bookworm
# (whose python3 is 3.11, like python:3.11-slim) and `docker import` it (about 45 s).
#   BASE_IMAGE=name   tag to create (default seer-base:bookworm)
#   FORCE=1           rebuild even when the tag exists
#   DEBIAN_MIRROR=url mirror for debootstrap (default deb.debian.org)
set -euo pipefail
TAG=${BASE_IMAGE:-seer-base:bookworm}
if [[ -z "${FORCE:-}" ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists (FORCE=1 rebuilds)"
  exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
fi
start=$(date +%s)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/tmp/seer-debootstrap.log 2>&1 \
  || { tail -20 /tmp/seer-debootstrap.log; exit 1; }
# Package caches and lists are dead weight in an image that never runs apt at build time.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  -c 'ENV LANG=C.UTF-8' \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "base image $TAG built in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | numfmt --to=iec))"
