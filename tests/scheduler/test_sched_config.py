"""The scheduler service's config exposes every policy setting of the core, and refuses the
simulator-only oracle policy."""

from __future__ import annotations

import dataclasses

import pytest

from services.common import config
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.config import SchedulerPolicyConfig


def test_every_policy_setting_is_a_service_setting() -> None:
    service = {f.name for f in dataclasses.fields(SchedulerConfig)}
    missing = [f.name for f in dataclasses.fields(SchedulerPolicyConfig) if f.name not in service]
    assert not missing, f"SchedulerConfig lacks {missing}"
    # ... and each reaches the core: a non-default value comes through policy_config().
    cfg = SchedulerConfig(admission_lookahead=3, use_worker_free_pages=False, history_probes=True,
                          quarantine_clear_reports=7)
    pc = cfg.policy_config()
    assert (pc.admission_lookahead, pc.use_worker_free_pages, pc.history_probes, pc.quarantine_clear_reports) == (
        3, False, True, 7)


def test_env_var_sets_a_policy_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEER_SCHEDULER_ADMISSION_LOOKAHEAD", "5")
    assert config.load(SchedulerConfig, "scheduler", []).admission_lookahead == 5


def test_oracle_is_refused_by_the_service() -> None:
    with pytest.raises(ValueError, match="policy: 'oracle'"):
        SchedulerConfig(policy="oracle").validate()
    SchedulerConfig(policy="seer_history").validate()
