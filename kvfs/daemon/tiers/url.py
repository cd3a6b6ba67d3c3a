"""Tier URLs: ``dir:///path`` and ``s3://bucket/prefix?options``, parsed and checked into the
tier they name (the mount's ``--cold`` and ``--shared``)."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...format.config import ConfigError
from .base import Tier
from .dir import DirTier
from .s3 import S3Tier

_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_FLOATS = ("connect_timeout", "read_timeout")


def parse_tier_url(url: str, name: str) -> Tier:
    """Build a tier from its URL:

    - ``dir:///srv/kvfs-cold`` (an absolute path; percent-escapes allowed)
    - ``s3://bucket[/prefix][?endpoint=URL&region=R&connect_timeout=S&read_timeout=S
      &max_attempts=N]``

    A bad URL raises ConfigError (a ValueError) that names the URL and what is wrong.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{name} tier {url!r}: {why}")

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.fragment:
        raise bad("a tier URL has no #fragment")
    if parts.scheme == "dir":
        if parts.netloc or not parts.path.startswith("/"):
            raise bad("a dir:// URL takes an absolute path, e.g. dir:///srv/kvfs-cold")
        if parts.query:
            raise bad("a dir:// URL takes no ?options")
        path = unquote(parts.path)
        if os.path.normpath(path) == "/":
            raise bad("refusing / as a tier directory")
        return DirTier(path, name)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET_RE.match(bucket):
            raise bad(f"bad bucket name {bucket!r} (3-63 of a-z, 0-9, '.', '-')")
        prefix = unquote(parts.path).strip("/")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise bad(f"bad prefix {prefix!r}")
        kw: dict[str, Any] = {}
        try:
            pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise bad(f"cannot parse the options {parts.query!r}") from None
        for key, value in pairs:
            if key in kw:
                raise bad(f"option {key} given twice")
            if key == "endpoint":
                ep = urlsplit(value)
                if ep.scheme not in ("http", "https") or not ep.netloc:
                    raise bad(f"endpoint must be an http:// or https:// URL, not {value!r}")
                kw[key] = value
            elif key == "region":
                if not re.match(r"^[a-z0-9-]+$", value):
                    raise bad(f"bad region {value!r}")
                kw[key] = value
            elif key in _S3_FLOATS:
                try:
                    kw[key] = float(value)
                except ValueError:
                    kw[key] = -1.0
                if not 0 < kw[key] < 3600:
                    raise bad(f"{key} must be a number of seconds in (0, 3600), not {value!r}")
            elif key == "max_attempts":
                if not value.isdigit() or not 1 <= int(value) <= 10:
                    raise bad(f"max_attempts must be an integer in 1..10, not {value!r}")
                kw[key] = int(value)
            else:
                raise bad(f"unknown option {key!r} (known: endpoint, region, "
                          f"{', '.join(_S3_FLOATS)}, max_attempts)")
        return S3Tier(bucket, prefix, name=name, **kw)
    raise bad("unsupported scheme (use dir:///path or s3://bucket/prefix)")




def _shared_urls(text: str) -> list[tuple[str, str]]:
    """``--shared``'s tiers as (name, URL): each ``URL`` (the tier named ``shared``) or
    ``NAME=URL``, separated by spaces. Raises ConfigError."""
    named: list[tuple[str, str]] = []
    for item in text.split():
        name, url = "shared", item
        head = item.split("://", 1)[0]
        if "=" in head:
            name, url = item.split("=", 1)
            if not _NAME_RE.match(name) or name in ("hot", "cold", "all"):
                raise ConfigError(f"shared tier name {name!r}: 1-32 of a-z, 0-9, '_', '-' "
                                  "starting with a letter, not hot, cold or all")
        if any(n == name for n, _ in named):
            raise ConfigError(f"two shared tiers named {name!r} (name them: NAME=URL)")
        named.append((name, url))
    return named


def parse_shared(text: str) -> list[Tier]:
    """The mount's shared tiers from ``--shared`` (given once or more; in a config file a
    string or a list): each ``URL`` (the tier named ``shared``) or ``NAME=URL`` (named
    tiers, e.g. ``eu=s3://kv-eu/cache us=s3://kv-us/cache``, which tenants' placements
    name), separated by spaces. Raises ConfigError."""
    tiers: list[Tier] = []
    for name, url in _shared_urls(text):
        tier = parse_tier_url(url, name)
        tier.shared = True
        tiers.append(tier)
    return tiers


def tier_dirs(cold: str | None, shared: str | None) -> list[tuple[str, str]]:
    """The directories the ``dir://`` tiers of ``--cold`` and ``--shared`` name, as (tier
    name, path), before any tier is made (which creates them): for checks of where they
    are. Raises ConfigError."""
    named = ([("cold", cold)] if cold else []) + (_shared_urls(shared) if shared else [])
    out = []
    for name, url in named:
        try:
            parts = urlsplit(url)
        except ValueError:
            continue  # said by parse_tier_url
        if parts.scheme == "dir":
            out.append((name, unquote(parts.path)))
    return out
