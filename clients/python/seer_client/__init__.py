"""Python client of Seer's RolloutService (see README.md next to this file)."""

from __future__ import annotations

from seer_client.client import SeerClient
from seer_client.grouping import by_batch, by_group, group_advantages, score
from seer_client.types import (
    BatchCancelled,
    BatchStatus,
    CancelOutcome,
    PromptGroup,
    RequestStatus,
    RolloutResult,
    Sampling,
    SeerError,
    SeerTimeout,
    SubmitResult,
    WeightsUpdate,
)

__all__ = [
    "BatchCancelled",
    "BatchStatus",
    "CancelOutcome",
    "PromptGroup",
    "RequestStatus",
    "RolloutResult",
    "Sampling",
    "SeerClient",
    "SeerError",
    "SeerTimeout",
    "SubmitResult",
    "WeightsUpdate",
    "by_batch",
    "by_group",
    "group_advantages",
    "score",
]
