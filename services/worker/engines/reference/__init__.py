"""The reference PyTorch engine (see README.md for the layering)."""

from services.worker.engines.reference.engine import ReferenceEngine

__all__ = ["ReferenceEngine"]
