"""Typed configuration: dataclasses loaded from YAML (or dicts) and validated at load time.

One loader for every section of every layer. A section is a dataclass; ``from_dict`` builds it
recursively from a mapping, with one unknown-field check and type checks whose errors name the
dotted field (``grpo.lr``), the value, and what would be valid. A section that needs its own
parsing (a string shorthand, aliases) defines ``from_config(data, where)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class Refusal(Exception):
    """A refusal the project raises on purpose: the message names the problem and the fix, and the
    command line prints it as one line (``what``: its kind) instead of a traceback. A crash in the
    project's own code is anything else, and keeps its traceback."""

    what = "refused"


class ConfigError(Refusal, ValueError):
    """A configuration value is wrong; the message names the field and the fix."""

    what = "config error"


def check_fields(cls, data: dict, where: str = "", kind: str = "") -> None:
    """Refuse keys of ``data`` that are not fields of dataclass ``cls`` (``kind`` names the section
    in the message when ``where`` does not)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown {kind + ' ' if kind else ''}field(s) {[prefix + u for u in unknown]}; "
            f"valid fields: {', '.join(sorted(fields))}"
        )


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and hasattr(tp, "from_config"):
        return tp.from_config(value, where)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, where)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(value) != len(typing.get_args(tp)):
            raise ConfigError(f"{where}: expected a list of {len(typing.get_args(tp))} values, got {list(value)!r}")
        return tuple(_convert(a, v, where) for a, v in zip(typing.get_args(tp), value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads "2e-5" (no dot) as a string
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, recursively, with errors that name the field."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    check_fields(cls, data, where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        try:
            kwargs[name] = _convert(hints[name], value, path)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # JSON is YAML


def load_document(source: str | Path | dict, overrides: dict | None = None) -> dict:
    """A config document: a YAML (or JSON) file path, YAML text or a dict, with dotted overrides
    (``{"grpo.lr": 1e-5}``) applied. A one-line string without ``:`` is a path."""
    if isinstance(source, dict):
        data = source
    elif isinstance(source, Path) or ("\n" not in source and ":" not in source):
        path = Path(source)
        if path.suffix not in CONFIG_SUFFIXES:
            raise ConfigError(f"config file {path}: not a YAML file (expected one of {', '.join(CONFIG_SUFFIXES)})")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        data = _parse(path.read_text(), str(path)) or {}
    else:
        data = _parse(source, "config text") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping of sections at the top level, got {type(data).__name__}")
    data = _deep_copy(data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {p} is not a section")
        node[leaf] = value
    return data


def _parse(text: str, where: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}:{at}: YAML syntax error: {problem}") from None


def parse_overrides(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as a dict, values parsed as YAML."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key] = _parse(value, f"--set {key}")
    return out


def _deep_copy(d):
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
