#!/usr/bin/env bash
# Builds every CPU image (seer-{buffer,scheduler,draft,kvstore,worker}:$TAG) with no image registry:
#   1. the base image: BASE_IMAGE if given (e.g. python:3.11-slim where a registry is reachable),
#      else the local debootstrap base seer-base:bookworm (docker/build_base_image.sh);
#   2. the wheelhouse on the host (docker/build_wheelhouse.sh) unless SKIP_WHEELHOUSE=1;
#   3. the converted embedded model (services.worker.model.prepare.ensure_model) and the engine's C
#      kernels, prebuilt on the host (the worker image has no compiler);
#   4. one `docker build --target <service>` per image over a staging context in docker/.build/.
#   SERVICES="buffer worker"  build a subset; TAG=dev image tag.
# Measured here (2 shared cores, warm pip cache): see docker/README.md.
set -euo pipefail
# The classic builder: no buildx plugin is needed and Compose 1.29 builds the same way.
export DOCKER_BUILDKIT=0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
# Absolute (relative to the repository root), without resolving a venv's symlinked interpreter.
[[ "$PY" != */* || "$PY" == /* ]] || PY="$(cd "$ROOT/$(dirname "$PY")" && pwd)/$(basename "$PY")"
TAG=${TAG:-dev}
SERVICES=${SERVICES:-buffer scheduler draft kvstore worker}
WH=${WHEELHOUSE:-$ROOT/wheelhouse}
CTX=$ROOT/docker/.build/context
t0=$(date +%s)

if [[ -z "${BASE_IMAGE:-}" ]]; then
  BASE_IMAGE=seer-base:bookworm
  BASE_IMAGE=$BASE_IMAGE bash "$ROOT/docker/build_base_image.sh"
fi
t1=$(date +%s)
[[ -n "${SKIP_WHEELHOUSE:-}" && -d "$WH" ]] || WHEELHOUSE=$WH PYTHON=$PY bash "$ROOT/docker/build_wheelhouse.sh"
t2=$(date +%s)

# The worker carries the converted model; the buffer its tokenizer (both need the model prepared).
model_dir=$(cd "$ROOT" && "$PY" -c 'from services.worker.model.prepare import ensure_model; print(ensure_model())' | tail -1)
[[ -f "$model_dir/config.json" ]] || { echo "model: no converted model at '$model_dir' (run: seer model prepare)" >&2; exit 1; }

# Staging context: hard links (same filesystem) or copies, so nothing outside it is sent to dockerd
# and the repository's .venv/caches never are.
rm -rf "$CTX"
mkdir -p "$CTX/model" "$CTX/tokenizer" "$CTX/wheelhouse" "$CTX/app"
for f in "$WH"/*; do
  case "$(basename "$f")" in
    seer_rollout-*.whl) dest="$CTX/app/" ;;
    *) dest="$CTX/wheelhouse/" ;;
  esac
  cp -al "$f" "$dest" 2>/dev/null || cp -a "$f" "$dest"
done
cp -a "$ROOT/docker/requirements" "$ROOT/docker/healthcheck.py" "$CTX/"
cp -al "$model_dir"/. "$CTX/model/" 2>/dev/null || cp -a "$model_dir"/. "$CTX/model/"
for f in "$model_dir"/*; do
  [[ "$f" == *.safetensors ]] || cp -a "$f" "$CTX/tokenizer/"
done
# The engine's C kernels, built here: the worker image has no compiler (SEER_KERNEL_PREBUILT).
# Without them (no compiler / no AVX2 on this host) the worker falls back to PyTorch.
mkdir -p "$CTX/kernels"
(cd "$ROOT" && "$PY" -c 'import sys; from pathlib import Path
from services.worker.engines.reference.kernels.build import prebuild; prebuild(Path(sys.argv[1]))' "$CTX/kernels") \
  || echo "kernels: not prebuilt; the worker image will use PyTorch's GEMM and attention" >&2

for svc in $SERVICES; do
  s=$(date +%s)
  docker build -q --build-arg "BASE_IMAGE=$BASE_IMAGE" --target "$svc" -t "seer-$svc:$TAG" \
    -f "$ROOT/docker/Dockerfile" "$CTX" 2> >(grep -v -E 'DEPRECATED|BuildKit|environment-variable|^\s*$' >&2) >/dev/null
  echo "image seer-$svc:$TAG $(docker image inspect -f '{{.Size}}' "seer-$svc:$TAG" | numfmt --to=iec) in $(( $(date +%s) - s ))s"
done
rm -rf "$CTX"
t3=$(date +%s)
echo "images: base $((t1 - t0))s, wheelhouse $((t2 - t1))s, builds $((t3 - t2))s, total $((t3 - t0))s"
