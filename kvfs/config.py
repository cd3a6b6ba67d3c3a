"""Mount configuration: sizes, the TOML config file, and how the command line overrides it."""

from __future__ import annotations

import re
import tomllib
from typing import Any

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)

#: Keys a config file may hold, with their types. The command line uses the same names.
KEYS: dict[str, type] = {
    "backing": str,
    "mountpoint": str,
    "capacity": str,
    "log": str,
    "debug": bool,
    "io_threads": int,
    "policy": str,
    "high_watermark": float,
    "low_watermark": float,
    "scan_interval": float,
    "policy_entries": int,
    "cold": str,
    "shared": str,
    "write_through": bool,
    "fetch_timeout": float,
    "tier_cooldown": float,
    "metrics": str,
    "audit": str,
}


class ConfigError(ValueError):
    """Invalid configuration: names the key and the reason."""


def parse_size(text: str | int) -> int:
    """'500G', '1.5TiB', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 500G, 1.5TiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def load(path: str) -> dict[str, Any]:
    """Read a TOML config file; unknown keys and wrong types are refused with their name."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    for key, value in data.items():
        if key not in KEYS:
            raise ConfigError(f"config {path}: unknown key {key!r}")
        want = KEYS[key]
        if key == "capacity" and isinstance(value, int):
            continue
        if want is float and isinstance(value, int):
            continue
        if not isinstance(value, want):
            raise ConfigError(f"config {path}: {key} must be a {want.__name__}")
    if "capacity" in data:
        parse_size(data["capacity"])
    return data
