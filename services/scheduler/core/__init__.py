"""The scheduler's pure core: policies, group length estimates, probes, anti-starvation, admission
control, cache-aware placement and worker state (no grpc; the service and bench/sim drive it)."""

from __future__ import annotations

from .chunkcheck import chunk_stats_problem
from .config import POLICIES, SchedulerPolicyConfig
from .groups import GroupState, history_prior
from .scheduler import SchedulerCore
from .types import Dispatch, RequestInfo, Unschedulable, WorkerSpec
from .workers import pages_for, telemetry_problem

__all__ = [
    "POLICIES",
    "Dispatch",
    "GroupState",
    "RequestInfo",
    "SchedulerCore",
    "SchedulerPolicyConfig",
    "Unschedulable",
    "WorkerSpec",
    "chunk_stats_problem",
    "history_prior",
    "pages_for",
    "telemetry_problem",
]
