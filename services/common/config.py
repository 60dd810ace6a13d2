"""Frozen dataclass configs that also give CLI flags and SEER_* environment variables.

Precedence (lowest to highest): dataclass defaults < JSON config file (--config) < environment
(SEER_<SECTION>_<FIELD>) < command-line flags (--field-name). Unknown keys are errors everywhere:
a typo in a Helm value or a compose file must fail at start, not be silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A configuration value is unknown or malformed; the message names the key."""


def _base_type(tp: Any) -> Any:
    """Strip Optional[...] / X | None to X."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _parse_value(key: str, tp: Any, raw: Any) -> Any:
    optional = type(None) in typing.get_args(tp)
    base = _base_type(tp)
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required")
    try:
        if base is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if base is int:
            if isinstance(raw, bool):
                raise ValueError("not an integer")
            if isinstance(raw, float):
                # A JSON 900.5 was truncated to 900 by int(); a whole float (1e3) is an integer.
                if not raw.is_integer():
                    raise ValueError(f"not an integer: {raw!r}")
                return int(raw)
            if not isinstance(raw, int | str):
                raise ValueError(f"not an integer: {raw!r}")
            return int(raw)
        if base is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError(f"not a number: {raw!r}")
            f = float(raw)
            # nan passes every range check (nan <= 0 is False): a heartbeat of nan seconds loads.
            if not math.isfinite(f):
                raise ValueError(f"not a finite number: {raw!r}")
            return f
        if base is str:
            if not isinstance(raw, str | int | float) or isinstance(raw, bool):
                # A JSON list or object became its Python repr ("['a:1', 'b:2']").
                raise ValueError(f"not a string: {raw!r}")
            return str(raw)
        origin = typing.get_origin(base)
        if origin is tuple:
            (item_tp, *_rest) = typing.get_args(base)
            items = raw if isinstance(raw, list | tuple) else [p for p in str(raw).split(",") if p.strip()]
            return tuple(_parse_value(key, item_tp, x.strip() if isinstance(x, str) else x) for x in items)
    except ConfigError:
        raise  # a tuple item's error names the key already (it was named twice: "k: k: ...")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from e
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


def _fields(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def env_name(section: str, field: str) -> str:
    return f"SEER_{section.upper()}_{field.upper()}"


def _parse_mapping(cls: type, values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Parses every value of a mapping by its field's type, rejecting unknown keys (naming them
    and the source). No cross-field validation: a layer alone need not be a valid config."""
    fields = _fields(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return {k: _parse_value(f"{source}:{k}", fields[k], v) for k, v in values.items()}


def from_mapping(cls: type[T], values: Mapping[str, Any], *, source: str = "config") -> T:
    """Builds cls from a mapping, rejecting unknown keys (naming them and the source)."""
    parsed = _parse_mapping(cls, values, source)
    obj = cls(**parsed)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    """One --kebab-case flag per field; defaults are left to the dataclass (None = not given)."""
    for name in _fields(cls):
        flag = "--" + name.replace("_", "-")
        doc = _field_doc(cls, name)
        parser.add_argument(flag, dest=name, default=None, help=doc, metavar=name.upper())


def _field_doc(cls: type, name: str) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("help", ""))
    return ""


def load(
    cls: type[T],
    section: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Resolves a config of type cls for service `section` from defaults, file, env and argv."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=prog or f"seer-{section}")
    parser.add_argument("--config", default=None, help="JSON file with config keys")
    add_arguments(cls, parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    fields = _fields(cls)
    values: dict[str, Any] = {}
    config_file = args.config or env.get(f"SEER_{section.upper()}_CONFIG")
    if config_file:
        with open(config_file, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: expected a JSON object")
        # Keys and types checked here, naming the file; cross-field rules only on the merged
        # values below (a file's max_streams 100 is valid with a flag's max_workers 200).
        _parse_mapping(cls, data, config_file)
        values.update(data)
    prefix = f"SEER_{section.upper()}_"
    for key, raw in env.items():
        if not key.startswith(prefix) or key == f"{prefix}CONFIG":
            continue
        name = key[len(prefix) :].lower()
        if name not in fields:
            raise ConfigError(f"environment: unknown variable {key}; known: "
                              + ", ".join(env_name(section, f) for f in sorted(fields)))
        values[name] = raw
    for name in fields:
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    return from_mapping(cls, values, source=section)


def load_field(
    cls: type,
    section: str,
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
) -> Any:
    """One field of cls for service `section`, resolved with `load`'s precedence (default < file <
    environment < flag) without parsing or validating the others: for a launcher that must know a
    value before starting the service (`seer up`: the host its gRPC port is checked on). The
    service's other flags are left alone; the service's own `load` still refuses what is wrong."""
    fields = _fields(cls)
    if name not in fields:
        raise ConfigError(f"{name}: not a field of {cls.__name__}")
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, exit_on_error=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
    try:
        args, _ = parser.parse_known_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as e:
        # A flag without its value (`--host` last): a ConfigError, not argparse's exit with the
        # usage of this two-flag parser (SystemExit: some errors exit even with exit_on_error off).
        raise ConfigError(f"{section}: {e}") from None
    raw: Any = getattr(args, name)
    if raw is None:
        raw = env.get(env_name(section, name))
    if raw is None:
        config_file = args.config or env.get(f"SEER_{section.upper()}_CONFIG")
        if config_file:
            with open(config_file, encoding="utf-8") as fh:
                data = json.load(fh)
            if isinstance(data, dict):
                raw = data.get(name)
    if raw is None:
        default = next(f for f in dataclasses.fields(cls) if f.name == name).default
        return None if default is dataclasses.MISSING else default
    return _parse_value(f"{section}:{name}", fields[name], raw)


def to_env(cfg: Any, section: str) -> dict[str, str]:
    """The SEER_* environment that reproduces cfg (used by `seer up`, compose and Helm tests)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            continue
        if isinstance(v, tuple):
            v = ",".join(str(x) for x in v)
        elif isinstance(v, bool):
            v = "true" if v else "false"
        out[env_name(section, f.name)] = str(v)
    return out


def load_or_exit(
    cls: type[T],
    section: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """`load` for a service's __main__: a bad key or value ends the process with one clear line on
    stderr and exit code 2 (no traceback), so a wrong compose/Helm value fails at start."""
    import sys

    try:
        return load(cls, section, argv, env, prog)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"seer-{section}: configuration error: {e}\n")
        raise SystemExit(2) from None


# In this module, not server.py: a service config is imported by its pure core (e.g. the buffer
# core reads defaults from it), and server.py imports grpc.
@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service has; service configs subclass this."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port (0 = pick a free one)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port (0 = off)"})
    grace_seconds: float = field(default=10.0, metadata={"help": "drain time on SIGTERM"})
    max_workers: int = field(default=64, metadata={"help": "gRPC handler threads"})

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds: must be >= 0")
        if self.max_workers < 1:
            raise ValueError("max_workers: must be >= 1")

    def replace(self, **changes: object) -> ServiceConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
