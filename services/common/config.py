"""Frozen dataclass configs that also give CLI flags and SEER_* environment variables.

Precedence (lowest to highest): dataclass defaults < JSON config file (--config) < environment
(SEER_<SECTION>_<FIELD>) < command-line flags (--field-name). Unknown keys are errors everywhere:
a typo in a Helm value or a compose file must fail at start, not be silently ignored.

`resolve` also says where each value came from (`Source`): a service logs the fields that differ
from their defaults, with their sources, once at start (`load_or_exit`), and a launcher (`seer up`)
names the flag or variable behind a refused value.
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
from typing import Any, Generic, NoReturn, TypeVar, get_type_hints

from services.common.errors import field_of
from services.common.log import get_logger, kv

T = TypeVar("T")

log = get_logger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Source:
    """Where one configuration value came from. kind: "flag" (name: --field-name), "env" (name:
    SEER_<SECTION>_<FIELD>) or "file" (name: the JSON file's path)."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


class ConfigError(ValueError):
    """A configuration value is unknown or malformed, or the merged configuration is refused by its
    validation; the message names the key. field / source: the field the message names and where
    its value came from (None: not known, or the field is at its default)."""

    def __init__(self, message: str, *, field: str | None = None, source: Source | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.source = source


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


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A loaded configuration and where its values came from; a field at its default has no entry
    in sources."""

    config: T
    sources: Mapping[str, Source]

    def changed(self) -> dict[str, dict[str, Any]]:
        """The fields whose value differs from the dataclass default, each {"value", "source"}: what
        a service logs at start, so that what is in force (and which layer set it) can be seen."""
        out: dict[str, dict[str, Any]] = {}
        for f in dataclasses.fields(self.config):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default: Any = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            value = getattr(self.config, f.name)
            if value != default:
                source = self.sources.get(f.name)
                out[f.name] = {"value": value, "source": str(source) if source else "default"}
        return out


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are ConfigErrors (a launcher checking a service's
    arguments must not exit, nor print this parser's usage); --help still exits."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


def _gather(
    cls: type, section: str, args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Source]]:
    """The raw values of the file, environment and flag layers (later layers win) and the source
    of each; keys and types checked, nothing validated across fields."""
    fields = _fields(cls)
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
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
        sources.update({k: Source("file", str(config_file)) for k in data})
    prefix = f"SEER_{section.upper()}_"
    for key, raw in env.items():
        if not key.startswith(prefix) or key == f"{prefix}CONFIG":
            continue
        name = key[len(prefix) :].lower()
        if name not in fields:
            raise ConfigError(f"environment: unknown variable {key}; known: "
                              + ", ".join(env_name(section, f) for f in sorted(fields)), source=Source("env", key))
        values[name] = raw
        sources[name] = Source("env", key)
    for name in fields:
        v = getattr(args, name)
        if v is not None:
            values[name] = v
            sources[name] = Source("flag", "--" + name.replace("_", "-"))
    return values, sources


def _named_field(message: str, section: str, fields: Mapping[str, Any]) -> str | None:
    """The field an error message names first ("policy: ..." from a validate(), "scheduler:policy:
    ..." from a value's parse), None when it names none."""
    if message.startswith(f"{section}:"):
        message = message[len(section) + 1 :]
    name = field_of(message)
    return name if name in fields else None


def resolve(
    cls: type[T],
    section: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
    *,
    exit_on_error: bool = True,
) -> Resolved[T]:
    """`load`, with where each value came from. A refused value is a ConfigError naming its field
    and source. exit_on_error=False: a malformed command line is a ConfigError too, not argparse's
    usage message and exit (a launcher checking the arguments it will pass)."""
    env = os.environ if env is None else env
    parser_cls = argparse.ArgumentParser if exit_on_error else _Parser
    parser = parser_cls(allow_abbrev=False, prog=prog or f"seer-{section}")
    parser.add_argument("--config", default=None, help="JSON file with config keys")
    add_arguments(cls, parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    fields = _fields(cls)
    values, sources = _gather(cls, section, args, env)
    try:
        cfg = from_mapping(cls, values, source=section)
    except ValueError as e:
        if isinstance(e, ConfigError) and e.field is not None:
            raise
        name = getattr(e, "field", None) or _named_field(str(e), section, fields)
        raise ConfigError(str(e), field=name, source=sources.get(name) if name else None) from e
    return Resolved(cfg, sources)


def load(
    cls: type[T],
    section: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Resolves a config of type cls for service `section` from defaults, file, env and argv."""
    return resolve(cls, section, argv, env, prog).config


def configured(cls: type, section: str, argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Source]:
    """The fields of cls that `argv` (flags of cls), `env` (SEER_<SECTION>_*) or a config file set,
    with the source that wins for each; nothing validated, unknown flags left alone. For a launcher
    that passes a field only when nothing else sets it (`seer up`: a suite default must not hide a
    SEER_* variable). A file that cannot be read sets nothing here (the service's own load, or
    `resolve`, refuses it by name)."""
    parser = _Parser(allow_abbrev=False, add_help=False, prog=f"seer-{section}")
    parser.add_argument("--config", default=None)
    add_arguments(cls, parser)
    try:
        args, _ = parser.parse_known_args(list(argv))
        return _gather(cls, section, args, env)[1]
    except (ValueError, OSError):
        return {}


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
    stderr and exit code 2 (no traceback), so a wrong compose/Helm value fails at start. The
    configuration in force is logged once (one line: the fields that differ from the defaults, each
    with its source), so that a value from a forgotten variable or file can be seen."""
    import sys

    try:
        resolved = resolve(cls, section, argv, env, prog)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"seer-{section}: configuration error: {e}\n")
        raise SystemExit(2) from None
    log.info("configuration", extra=kv(config=resolved.changed()))
    return resolved.config


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
