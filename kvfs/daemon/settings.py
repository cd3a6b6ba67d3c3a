"""The mount settings, each defined once: name, type, default, help, TOML key and check.

Everything else is derived from `SETTINGS`: the options of `kvfs mount` (`add_arguments`), the
keys of its TOML config file (`load`), the command line the background daemon is started with
(`daemon_argv`), the options of the fstab helper (kvfs.cli.fstab), the defaults of
`kvfs.daemon.mount.MountOptions` and of the daemon's own records (`DEFAULTS`), and the configuration
table of docs/operations.md (`markdown_table`; `python -m kvfs.daemon.settings` prints it).

A setting's TOML key is its name; its option is the name with dashes (`--high-watermark`), or
`--no-NAME` for a switch that is on by default. A bad value is refused with the key (and the
file) or the option named; the value itself never reaches the daemon.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..format.config import ConfigError, parse_size, read_toml
from ..models.policy import DEFAULT_POLICY, POLICIES
from . import wakeup

#: A setting's value kinds: how its text (command line) and its TOML value are read.
KINDS = ("str", "int", "float", "bool", "size")
_TOML_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "bool": bool, "size": (int, str)}
_KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number",
               "bool": "true or false", "size": 'a size (e.g. "500G") or a number of bytes'}


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    default: Any
    #: One line for `kvfs mount --help` and the docs' table (backquotes are for the docs).
    help: str
    #: Why a value is refused ("must be positive"), or None when it is good.
    check: Callable[[Any], str | None] | None = None
    choices: tuple[str, ...] | None = None
    #: The default as the docs say it, where the value alone does not say it.
    shown: str | None = None
    #: Given on the command line as a positional argument (the backing directory, the mount
    #: point), not as an option.
    positional: bool = False
    #: A field of MountOptions (False: the command line's alone, e.g. the log file).
    daemon: bool = True
    #: An option that may be given more than once (a string: the values joined by spaces;
    #: in TOML a string or a list of strings).
    repeat: bool = False

    @property
    def key(self) -> str:
        """The TOML key."""
        return self.name

    @property
    def flag(self) -> str:
        """The command-line option."""
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.kind == "bool" and self.default else f"--{dashed}"

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return "none"
        if self.kind == "bool":
            return "true" if self.default else "false"
        if self.kind == "str":
            return f"`{self.default}`"
        return f"{self.default:g}" if self.kind == "float" else str(self.default)

    def from_text(self, text: str) -> Any:
        """A command-line value; ValueError with the reason when it is bad."""
        try:
            if self.kind == "int":
                value: Any = int(text)
            elif self.kind == "float":
                value = float(text)
            elif self.kind == "size":
                value = parse_size(text)
            else:
                value = text
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        except ValueError:
            raise ValueError(f"not {'an integer' if self.kind == 'int' else 'a number'}: "
                             f"{text!r}") from None
        self.validate(value)
        return value

    def from_toml(self, value: Any) -> Any:
        """A config file's value; ValueError with the reason when it is bad."""
        if self.repeat and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = " ".join(value)
        if self.kind == "bool" or isinstance(value, bool):
            ok = isinstance(value, bool) and self.kind == "bool"
        else:
            ok = isinstance(value, _TOML_TYPES[self.kind])
        if not ok:
            raise ValueError(f"must be {_KIND_NAMES[self.kind]}")
        if self.kind == "float":
            value = float(value)
        elif self.kind == "size":
            try:
                value = parse_size(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        self.validate(value)
        return value

    def validate(self, value: Any) -> None:
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)} (got {value!r})")
        reason = self.check(value) if self.check is not None else None
        if reason:
            raise ValueError(f"must be {reason} (got {value!r})")

    def to_text(self, value: Any) -> str:
        """The command-line text of a value: from_text(to_text(v)) == v."""
        return repr(value) if self.kind == "float" else str(value)


def _at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"at least {n}"


def _positive(v: float) -> str | None:
    return None if v > 0 else "positive"


def _not_negative(v: float) -> str | None:
    return None if v >= 0 else "0 or more"


def _fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "a fraction in (0, 1]"


SETTINGS: tuple[Setting, ...] = (
    Setting("backing", "str", None, "hot tier directory on local NVMe; holds the index in "
            "`.kvfs/`", shown="(required)", positional=True),
    Setting("mountpoint", "str", None, "where the filesystem appears", shown="(required)",
            positional=True),
    Setting("capacity", "size", None, "hot-tier byte budget: `500G`, `1.5TiB`, bytes",
            shown="none (the backing filesystem)"),
    Setting("high_watermark", "float", 0.95, "above this fraction of capacity, background "
            "eviction starts", check=_fraction),
    Setting("low_watermark", "float", 0.90, "background eviction frees down to this fraction "
            "of capacity", check=_fraction),
    Setting("policy", "str", DEFAULT_POLICY, "eviction order (`kvfs mount --help` lists the "
            "policies)", choices=tuple(POLICIES)),
    Setting("scan_interval", "float", 60.0, "seconds between retention scans", check=_positive),
    Setting("policy_entries", "int", 131072, "files whose eviction state is kept in memory "
            "(all tenants); older ones wait in the index and are evicted first, oldest access "
            "first", check=_at_least(1)),
    Setting("cold", "str", None, "a directory tier below hot: `dir:///hdd/kvfs` (HDD, or "
            "NFS/CephFS/Lustre)"),
    Setting("shared", "str", None, "the tier other hosts read: "
            "`s3://bucket/prefix?endpoint=URL&region=R` (or a `dir://` on a shared filesystem); "
            "named ones, which tenants' placements name, as `NAME=URL` (given more than once, "
            "or separated by spaces: `eu=s3://kv-eu us=s3://kv-us`)", repeat=True),
    Setting("write_through", "bool", True, "publish each new block to the shared tier at once "
            "(asynchronously), not only on eviction"),
    Setting("fetch_timeout", "float", None, "seconds a lower-tier fetch may take before it is "
            "a miss", check=_positive, shown="from block size"),
    Setting("tier_codec", "str", "planes", "how blocks are stored in the cold and shared "
            "tiers: `planes` (lossless: byte planes, zstd where it pays; docs/format.md, "
            "\"Encodings\") or `none` (as saved)", choices=("planes", "none")),
    Setting("hot_codec", "str", "none", "how clients store the blocks they save in the hot "
            "tier: `none` (as saved: the fastest loads) or `planes` (lossless, about 1.4x more "
            "16-bit KV in the same bytes; loads decode it)", choices=("planes", "none")),
    Setting("encrypt", "bool", True, "seal every block that leaves the hot tier (cold and "
            "shared) with AES-256-GCM under its tenant's key (docs/architecture.md, \"Keys and "
            "placement\")"),
    Setting("hot_encrypt", "bool", False, "seal the hot tier's blocks too: clients encrypt the "
            "blocks they save under their tenant's key and loads open them (the backing disk "
            "then holds no plaintext KV; loads of such blocks take the slower Python path)"),
    Setting("key_file", "str", "/etc/kvfs/kek", "the key-encryption key the tenants' data "
            "keys are wrapped under (made 0600 where absent; every host that shares a tier "
            "needs the same one)"),
    Setting("key_command", "str", None, "a key provider instead of the key file: "
            "`CMD wrap|unwrap TENANT ID` (key on stdin, result on stdout), `CMD forget "
            "TENANT`"),
    Setting("key_ttl", "float", 60.0, "seconds a host keeps an unwrapped key, and between its "
            "rereads of the tiers' keys: the bound on a rotation's, retirement's or "
            "forgetting's reaching every host", check=_positive),
    Setting("tier_cooldown", "float", 10.0, "seconds a failing tier is left alone (circuit "
            "open)", check=_not_negative),
    Setting("metrics", "str", None, "`HOST:PORT` of the Prometheus endpoint"),
    Setting("audit", "str", None, "JSON-lines audit log file"),
    Setting("log", "str", None, "the daemon's log",
            shown="`BACKING/.kvfs/daemon.log` (stderr with `--foreground`)", daemon=False),
    Setting("io_threads", "int", 32, "worker threads for blocking I/O", check=_at_least(1)),
    Setting("writeback_cache", "bool", False, "FUSE's write-back cache (turns passthrough "
            "off): files just written "
            "are read again from the page cache; a refused write-back reaches the writer at "
            "close (`ENOSPC`) or fsync, and writers in a tenant with a quota write through "
            "(docs/architecture.md, \"The mount door\")"),
    Setting("passthrough", "bool", True, "FUSE passthrough: the kernel reads and writes an "
            "open hot file's backing file itself, none of its bytes through the daemon; "
            "quota and capacity are settled at close (`--no-passthrough`: the daemon serves "
            "every byte; docs/architecture.md, \"The mount door\")"),
    Setting("thread_creates", "bool", True, "with passthrough, the request thread creates "
            "new files in model directories and answers their flushes, releases and renames "
            "into place, within byte grants the daemon reserves against quotas and the "
            "capacity; journaled (`--no-thread-creates`: the daemon answers every create, "
            "flush, release and rename; docs/architecture.md, \"The mount door\")"),
    Setting("wake_here", "str", "on", "which CPU the kernel wakes the daemon on for a FUSE "
            "request, where the host's `fuse` module has a `wake_here` parameter: `on` (the "
            "caller's: round trips several times shorter on a VM; host-wide, kept after "
            "unmount), `off`, or `keep` (as the host has it; docs/operations.md)",
            choices=wakeup.CHOICES),
    Setting("keep_cache", "bool", True, "files the daemon serves (passthrough off or "
            "refused): readers keep the kernel's page cache of a file nobody has open for "
            "writing (`--no-keep-cache`: dropped at each open)"),
    Setting("debug", "bool", False, "verbose log and FUSE debug"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
#: Every setting's default, by name: what MountOptions and the daemon's records start from.
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


def load(path: str) -> dict[str, Any]:
    """A TOML config file's settings, each read and checked; a bad one is a ConfigError
    naming the file and the key."""
    data = read_toml(path)
    values = {}
    for key, value in data.items():
        setting = BY_NAME.get(key)
        if setting is None:
            raise ConfigError(f"config {path}: unknown key {key!r}")
        try:
            values[key] = setting.from_toml(value)
        except ValueError as exc:
            raise ConfigError(f"config {path}: {key} {exc}") from None
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options (and the two positional arguments) of `kvfs mount`. An option not given is
    None, so that `resolve` can tell it from a value the config file gives."""
    for s in SETTINGS:
        text = s.help.replace("`", "")
        if s.positional:
            parser.add_argument(s.name, nargs="?", help=text)
        elif s.kind == "bool":
            parser.add_argument(s.flag, dest=s.name, default=None,
                                action="store_false" if s.default else "store_true",
                                help=f"{text} (default: on; this option turns it off)"
                                if s.default else text)
        elif s.repeat:
            parser.add_argument(s.flag, dest=s.name, type=_option_type(s), action="append",
                                metavar=s.name.upper(),
                                help=f"{text} (default: {s.shown_default().replace('`', '')})")
        else:
            parser.add_argument(s.flag, dest=s.name, type=_option_type(s), choices=s.choices,
                                metavar=None if s.choices else s.name.upper(),
                                help=f"{text} (default: {s.shown_default().replace('`', '')})")


def _option_type(s: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return s.from_text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = s.name
    return convert


def resolve(args: argparse.Namespace, conf: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting's value: the command line's, else the config file's, else the default."""
    values = {}
    for s in SETTINGS:
        given = getattr(args, s.name, None)
        if s.repeat and isinstance(given, list):
            given = " ".join(given)
        values[s.name] = given if given is not None else conf.get(s.name, s.default)
    return values


def daemon_argv(values: Mapping[str, Any]) -> list[str]:
    """The `kvfs mount` arguments that give the daemon exactly these values (every setting
    but the defaults of switches), so that it needs no config file."""
    argv = [str(values[s.name]) for s in SETTINGS if s.positional]
    for s in SETTINGS:
        value = values.get(s.name)
        if s.positional or value is None:
            continue
        if s.kind == "bool":
            if value != s.default:
                argv.append(s.flag)
        else:
            argv += [s.flag, s.to_text(value)]
    return argv


def markdown_table() -> str:
    """The configuration table of docs/operations.md."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.key}` | {s.shown_default()} | {s.help} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


def fstab_options() -> tuple[set[str], set[str]]:
    """The fstab helper's options: those that take a value, and the bare switches (names
    with underscores, as `kvfs mount`'s options without their dashes)."""
    valued = {s.name for s in SETTINGS if not s.positional and s.kind != "bool"} | {"config"}
    switches = {s.flag[2:].replace("-", "_") for s in SETTINGS if s.kind == "bool"}
    return valued, switches


def default_log(backing: str) -> str:
    """Where a background daemon logs unless told otherwise."""
    return os.path.join(backing, ".kvfs", "daemon.log")


if __name__ == "__main__":
    print(markdown_table(), end="")
