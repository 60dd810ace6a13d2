"""Loads the weights of a local Hugging Face model directory (one or many *.safetensors files)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_state_dict(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.to(dtype)
    return out
