"""`seer model prepare [--model-dir D] [--force]` and `seer model info [--model-dir D]`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="seer model", description="prepare or inspect the embedded model", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="convert the embedded GGUF to a safetensors directory (cached)")
    prep.add_argument("--model-dir", type=Path, default=None, help="target directory (default: the cache)")
    prep.add_argument("--force", action="store_true", help="convert again even when the directory exists")
    prep.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    info = sub.add_parser("info", help="print the model directory and its configuration")
    info.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args(list(argv))

    from services.worker.model.prepare import ensure_model, prepare

    if args.cmd == "prepare":
        path = prepare(args.model_dir, force=args.force, dtype=args.dtype)
        sys.stdout.write(f"{path}\n")
        return 0
    from services.worker.model.config import ModelConfig

    path = ensure_model(args.model_dir)
    cfg = ModelConfig.from_dir(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out = {"model_dir": str(path), "weights_bytes": size, **cfg.__dict__}
    sys.stdout.write(json.dumps(out, indent=2, default=list) + "\n")
    return 0
