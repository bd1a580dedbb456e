"""The typed parsers behind each YAML key: sizes with units, bounded integers, choices, devices.

Each parser takes (value, key path) and returns the value as Offload uses it inside, or raises
ConfigError naming the key and what is allowed; every message shows the offending value
bounded in length, however big or deep it is; and `read_yaml`, the file's mapping read safely.
Knows no section and no model.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from offload.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
#: Bounds on what a config may ask for: far above any real machine, low enough that no number in a
#: config can make Offload allocate or loop absurdly before a planner refuses it.
MAX_INT = 2**31 - 1
MAX_SIZE = 2**60  # 1 EiB
MAX_STR = 4096  # a path longer than this is refused by the OS anyway
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlong = 40
_repr.maxlevel = 2


def _short(value: Any) -> str:
    """A value for an error message, bounded in length however big or deep (or self-similar) it is."""
    return _repr.repr(value)


def _key_name(key: Any) -> str:
    """A mapping key as the user wrote it (bounded; non-string keys shown as values)."""
    return key if isinstance(key, str) and len(key) <= 80 else _short(key)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """`512MiB`, `20GiB`, `1.5GB`, `4096` -> bytes. KB/MB/GB are decimal, KiB/MiB/GiB binary."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like 512MiB or 20GiB, got {_short(value)}")
    if isinstance(value, int):
        number, unit = float(value), ""
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ConfigError(
            f"{key}: {_short(value)} is not a size; write bytes as an integer or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB"
        )
    if not math.isfinite(number) or number < 0 or number * _UNITS[unit] > MAX_SIZE:
        raise ConfigError(f"{key}: a size must be a number of bytes from 0 to 1 EiB, got {_short(value)}")
    return int(number * _UNITS[unit])


def format_size(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# ----------------------------------------------------------------------------- parsers
def _int(lo: int = 0, hi: int = MAX_INT) -> Callable[[Any, str], int]:
    def parse(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{key}: expected an integer from {lo} to {hi}, got {_short(value)}")
        return value
    return parse


def _int_or_auto(lo: int = 0, hi: int = MAX_INT) -> Callable[[Any, str], int | None]:
    inner = _int(lo, hi)

    def parse(value: Any, key: str) -> int | None:
        if value is None or value == "auto":
            return None
        try:
            return inner(value, key)
        except ConfigError:
            raise ConfigError(f"{key}: expected 'auto' or an integer from {lo} to {hi}, got {_short(value)}") from None
    return parse


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_short(value)}")
    return value


def _size_or_auto(value: Any, key: str) -> int | None:
    return None if value is None or value == "auto" else parse_size(value, key)


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        if value not in allowed:
            hint = difflib.get_close_matches(_short(value), allowed, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{key}: {_short(value)} is not supported{did}; use one of: {', '.join(allowed)}")
        return value
    return parse


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_STR or "\0" in value:
        raise ConfigError(f"{key}: expected a non-empty string (a path) without NUL characters, at most {MAX_STR} "
                          f"characters, got {_short(value)}")
    return value


def _device(value: Any, key: str) -> str:
    if value is None or value == "auto":
        return "auto"
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ConfigError(f"{key}: {_short(value)} is not a device; use cpu, cuda, cuda:N or auto")
    return value


def _names(*allowed: str) -> Callable[[Any, str], tuple[str, ...]]:
    one = _choice(*allowed)

    def parse(value: Any, key: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list such as [lm_head], got {value!r}")
        return tuple(one(v, key) for v in value)
    return parse


def _opt(meta_parse: Callable[[Any, str], Any], doc: str, default: Any = None) -> Any:
    return field(default=default, metadata={"parse": meta_parse, "doc": doc})




def _number(lo: float = 0.0) -> Callable[[Any, str], float]:
    def parse(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= 1e12:
            raise ConfigError(f"{key}: expected a number from {lo} to 1e12, got {_short(value)}")
        return float(value)
    return parse


def _bool_or_auto(value: Any, key: str) -> bool | None:
    if value is None or value == "auto":
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true, false or auto, got {_short(value)}")
    return value


#: A YAML file is read whole: configs are a few hundred bytes; anything past this is refused unread.
MAX_YAML_BYTES = 1 << 20
#: Aliases (`*name`) a config may use; an alias bomb needs thousands.
MAX_YAML_ALIASES = 100


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses documents using more than MAX_YAML_ALIASES aliases (alias bombs)."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_YAML_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_YAML_ALIASES} aliases (*name); write the values out")
        return super().compose_node(parent, index)


def read_yaml(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a YAML config file, read with a safe loader and bounded in size and aliases;
    ConfigError says what is wrong with the file (its syntax, a value no parser can hold, not a mapping)."""
    if path.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes is too large for a config file (at most "
                          f"{MAX_YAML_BYTES}); pass the YAML run configuration")
    try:
        data = yaml.load(path.read_bytes(), Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({getattr(e, 'problem', None) or e}); "
                          "fix the syntax") from None
    except (ValueError, RecursionError, OverflowError) as e:  # 10^5-digit integers, 10^4-deep nesting
        raise ConfigError(f"{path}: a value cannot be read ({type(e).__name__}: {_short(str(e))}); "
                          "write plain numbers and shallow mappings") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of keys (model:, device:, ...) at the top level")
    return data
