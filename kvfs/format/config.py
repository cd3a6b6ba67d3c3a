"""Configuration primitives: the error every bad setting raises, sizes, and reading a TOML file.

The settings themselves (names, types, defaults, checks) are the table in `kvfs.daemon.settings`,
which validates a config file's keys against it (`kvfs.daemon.settings.load`).
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """Invalid configuration: names the key and the reason."""


#: The largest size kvfs takes (a file offset, SQLite's integer): 8 EiB.
MAX_SIZE = 2**63 - 1


def parse_size(text: str | int) -> int:
    """'500G', '1.5TiB', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        if text > MAX_SIZE:
            raise ConfigError(f"size {text} is beyond {MAX_SIZE} bytes (8 EiB)")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 500G, 1.5TiB, 1048576)")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not size <= MAX_SIZE:
        raise ConfigError(f"size {text[:40]!r} is beyond {MAX_SIZE} bytes (8 EiB)")
    return int(size)


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file's table; an unreadable or malformed file is a ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
