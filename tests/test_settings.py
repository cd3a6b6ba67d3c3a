"""The mount settings table: the options, the config file's keys, the daemon's command line and
the defaults are all derived from it, and agree."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvfs.cli import build_parser, main
from kvfs.daemon import settings
from kvfs.daemon.settings import BY_NAME, DEFAULTS, SETTINGS
from kvfs.format.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A value for every setting, none of them its default.
OTHER = {
    "backing": "/srv/b", "mountpoint": "/srv/m", "capacity": 3 << 30, "high_watermark": 0.85,
    "low_watermark": 0.7, "policy": "s3fifo", "scan_interval": 0.25, "policy_entries": 7,
    "cold": "dir:///hdd/kv", "shared": "s3://kv/p?region=x&endpoint=http://h:1",
    "write_through": False, "fetch_timeout": 2.5, "tier_cooldown": 0.0, "tier_codec": "none",
    "hot_codec": "planes",
    "metrics": "127.0.0.1:9464", "audit": "/var/log/a b.jsonl", "log": "/var/log/d.log",
    "io_threads": 5, "writeback_cache": True, "passthrough": False, "keep_cache": False,
    "thread_creates": False,
    "wake_here": "keep",
    "debug": True, "encrypt": False, "hot_encrypt": True, "key_file": "/srv/kek",
    "key_command": "vault-kek --x", "key_ttl": 5.0,
}


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def _parse_mount(argv: list[str]) -> dict:
    return settings.resolve(build_parser().parse_args(["mount", *argv]), {})


def test_table_is_whole_and_consistent():
    assert set(OTHER) == set(BY_NAME), "OTHER must give every setting a value"
    assert len({s.flag for s in SETTINGS}) == len(SETTINGS)
    for s in SETTINGS:
        assert s.kind in settings.KINDS and s.key == s.name and s.help
        assert OTHER[s.name] != s.default
        if s.default is not None:
            s.validate(s.default)


def test_daemon_defaults_come_from_the_table():
    from kvfs.daemon.capacity import Budget
    from kvfs.daemon.fs import MountInfo
    from kvfs.daemon.mount import MountOptions

    fields = {f.name: f for f in dataclasses.fields(MountOptions)}
    for s in SETTINGS:
        assert (s.name in fields) == s.daemon, s.name
        if s.daemon and not s.positional:
            assert fields[s.name].default == s.default, s.name
    info = MountInfo(mountpoint="/m", backing="/b", capacity=None)
    for name in ("policy", "high_watermark", "low_watermark", "scan_interval", "policy_entries"):
        assert getattr(info, name) == DEFAULTS[name]
    budget = Budget(None)
    assert (budget.high, budget.low) == (DEFAULTS["high_watermark"], DEFAULTS["low_watermark"])


def test_options_not_given_fall_back_to_the_file_then_the_default():
    args = build_parser().parse_args(["mount", "/b", "/m", "--scan-interval", "5"])
    values = settings.resolve(args, {"scan_interval": 9.0, "policy_entries": 9,
                                     "write_through": False, "debug": True})
    assert values["scan_interval"] == 5.0 and values["policy_entries"] == 9
    assert values["write_through"] is False and values["debug"] is True
    assert values["high_watermark"] == DEFAULTS["high_watermark"] == 0.95
    assert values["backing"] == "/b" and values["capacity"] is None
    defaults = _parse_mount(["/b", "/m"])
    assert {k: v for k, v in defaults.items() if k not in ("backing", "mountpoint")} == {
        s.name: s.default for s in SETTINGS if not s.positional}
    assert _parse_mount(["/b", "/m", "--no-write-through", "--debug", "--capacity", "1.5G",
                         "--io-threads", "4"]) == defaults | {
        "write_through": False, "debug": True, "capacity": 3 << 29, "io_threads": 4}


def test_config_file_round_trips_through_the_daemons_command_line(tmp_path):
    """A setting read from a config file and passed through argv to the background daemon
    arrives with the same value."""
    conf = tmp_path / "kvfs.toml"
    conf.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in OTHER.items()))
    values = settings.resolve(build_parser().parse_args(["mount"]), settings.load(str(conf)))
    assert values == OTHER
    argv = settings.daemon_argv(values)
    assert "--config" not in argv and argv[:2] == ["/srv/b", "/srv/m"]
    assert _parse_mount(argv) == OTHER
    # ... and the defaults too, sizes given as text, odd floats.
    plain = _parse_mount(["/b", "/m"])
    assert _parse_mount(settings.daemon_argv(plain)) == plain
    odd = plain | {"high_watermark": 0.1 + 0.2, "low_watermark": 1e-7, "capacity": 1}
    assert _parse_mount(settings.daemon_argv(odd)) == odd


@pytest.mark.parametrize(("line", "message"), [
    ('capacty = "1G"', "unknown key 'capacty'"),
    ('capacity = "lots"', "capacity not a size: 'lots'"),
    ("capacity = -1", "capacity size must not be negative"),
    ("capacity = 1.5", "capacity must be a size"),
    ('scan_interval = "60"', "scan_interval must be a number"),
    ("scan_interval = 0", "scan_interval must be positive (got 0.0)"),
    ("policy_entries = 0", "policy_entries must be at least 1"),
    ("policy_entries = 1.5", "policy_entries must be an integer"),
    ("io_threads = true", "io_threads must be an integer"),
    ("debug = 1", "debug must be true or false"),
    ('policy = "mru"', "policy must be one of kvfs, lru, chain-lru, s3fifo (got 'mru')"),
    ("high_watermark = 1.5", "high_watermark must be a fraction in (0, 1]"),
    ("tier_cooldown = -1", "tier_cooldown must be 0 or more"),
    ("fetch_timeout = 0", "fetch_timeout must be positive"),
    ("metrics = 9464", "metrics must be a string"),
])
def test_bad_config_values_name_the_file_and_the_key(tmp_path, line, message):
    conf = tmp_path / "kvfs.toml"
    conf.write_text(line + "\n")
    with pytest.raises(ConfigError) as info:
        settings.load(str(conf))
    assert str(info.value).startswith(f"config {conf}: ") and message in str(info.value)


def test_config_file_types_are_normalised(tmp_path):
    conf = tmp_path / "kvfs.toml"
    conf.write_text('capacity = "2G"\nscan_interval = 5\nfetch_timeout = 3\n')
    assert settings.load(str(conf)) == {"capacity": 2 << 30, "scan_interval": 5.0,
                                        "fetch_timeout": 3.0}
    assert isinstance(settings.load(str(conf))["scan_interval"], float)


@pytest.mark.parametrize(("argv", "message"), [
    (["--scan-interval", "0"], "argument --scan-interval: must be positive"),
    (["--policy-entries", "many"], "argument --policy-entries: not an integer: 'many'"),
    (["--capacity", "lots"], "argument --capacity: not a size"),
    (["--high-watermark", "2"], "argument --high-watermark: must be a fraction in (0, 1]"),
    (["--policy", "mru"], "argument --policy: must be one of kvfs, lru, chain-lru, s3fifo"),
])
def test_bad_option_values_name_the_option(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["mount", "/b", "/m", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_watermarks_are_checked_together(capsys, tmp_path):
    code = main(["mount", str(tmp_path), str(tmp_path), "--high-watermark", "0.5",
                 "--low-watermark", "0.6"])
    assert code == 2 and "0 < low <= high <= 1" in capsys.readouterr().err


def test_fstab_options_are_the_mount_options():
    from kvfs.cli.fstab import FLAGS, VALUED, translate

    assert "io_threads" in VALUED and "config" in VALUED and "backing" not in VALUED
    assert FLAGS == {"debug", "no_write_through", "writeback_cache", "no_passthrough",
                     "no_thread_creates", "no_keep_cache", "no_encrypt", "hot_encrypt"}
    cached = _parse_mount(translate("/b", "/m", "writeback_cache,no_keep_cache")[1:])
    assert cached["writeback_cache"] is True and cached["keep_cache"] is False
    argv = translate("/b", "/m", "policy-entries=7,tier_cooldown=0,no_write_through,io_threads=5")
    assert _parse_mount(argv[1:])["policy_entries"] == 7
    assert _parse_mount(argv[1:])["write_through"] is False


def test_docs_configuration_table_is_the_settings_table():
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        docs = f.read()
    assert settings.markdown_table() in docs, (
        "docs/operations.md's configuration table is out of date: replace it with the output "
        "of `python -m kvfs.daemon.settings`")
