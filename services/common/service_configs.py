"""Each service's configuration class, by its section name (SEER_<SECTION>_*): what a launcher
(`seer up`'s pre-start check) and the containers' healthcheck (docker/healthcheck.py) resolve a
service's configuration with, so that its own defaults apply (the draft server's port is 50053).
Imported by name: a config module imports no grpc server, engine or torch, and this module imports
no service package until asked for one."""

from __future__ import annotations

import importlib

from services.common.config import ServiceConfig

# section -> (module, class)
CONFIG_CLASSES: dict[str, tuple[str, str]] = {
    "buffer": ("services.buffer.config", "BufferConfig"),
    "scheduler": ("services.scheduler.config", "SchedulerConfig"),
    "draft": ("services.draft.config", "DraftConfig"),
    "kvstore": ("services.kvstore.config", "KvStoreConfig"),
    "worker": ("services.worker.config", "WorkerConfig"),
}


def config_class(section: str) -> type[ServiceConfig]:
    """The configuration dataclass of service `section`; ValueError naming the known ones for any
    other name."""
    if section not in CONFIG_CLASSES:
        raise ValueError(f"unknown service {section!r} (one of {', '.join(CONFIG_CLASSES)})")
    module, name = CONFIG_CLASSES[section]
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, ServiceConfig)):
        raise TypeError(f"{module}.{name} is not a ServiceConfig")
    return cls


__all__ = ["CONFIG_CLASSES", "config_class"]
