"""Model files: GGUF -> safetensors preparation (prepare.py), config and weight loading (config.py, loader.py)."""
