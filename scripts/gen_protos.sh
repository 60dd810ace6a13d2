#!/usr/bin/env bash
# Regenerates the committed Python code of protos/seer/v1/*.proto. tests/test_protos.py fails when
# the committed files differ from what this produces.
set -euo pipefail
cd "$(dirname "$0")/../protos"
out="${1:-.}"
python -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" seer/v1/*.proto
