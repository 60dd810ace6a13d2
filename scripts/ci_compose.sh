#!/usr/bin/env bash
# CI's docker part (called by .ci/run after the test suite): installs Docker and Compose from Debian
# when absent, starts dockerd when it is not running, builds every CPU image with no registry
# (make images) and runs the compose smoke test (make compose-smoke). Prints the time of each step.
# Cold machine (no docker, no images), measured here: see docker/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "ci_compose: $* ($(( $(date +%s) - t0 ))s)"; }

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ((${#need[@]})); then
  step "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q "${need[@]}" >/dev/null
fi

started_dockerd=""
# Stop a dockerd started here however the script ends (set -e exits included).
stop_dockerd() {
  if [[ -n "$started_dockerd" && -z "${KEEP_DOCKERD:-}" ]]; then
    kill "$started_dockerd" 2>/dev/null || true
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  step "starting dockerd"
  # Without our descriptors beyond stdio: a long-lived dockerd holding, say, a caller's flock(1)
  # descriptor would keep that lock held after this script ends.
  (for fd in /proc/self/fd/*; do n=${fd##*/}; { [[ $n -gt 2 ]] && eval "exec $n>&-"; } || true; done; exec dockerd) \
    >/tmp/dockerd.log 2>&1 &
  started_dockerd=$!
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { tail -30 /tmp/dockerd.log; echo "dockerd did not start" >&2; exit 1; }
fi

# The scripts behind `make images` / `make compose-smoke`, called directly: .ci/run has already set
# up the virtualenv and the model (make test), and make would re-check those prerequisites.
step "building images"
PYTHON=.venv/bin/python bash docker/build_images.sh
step "compose smoke"
rc=0
.venv/bin/python scripts/compose_smoke.py || rc=$?
step "done (rc=$rc)"
exit $rc
