"""What a benchmark record holds, and how its parts read as text.

A record is a JSON object with at least `"benchmark"` (its kind). What each kind's table reads
is said by the kind's module (`Kind.table`); what every record may hold:

- `rows`: the figures, a list of objects (every field optional: what is missing is shown as
  "-"); `mount`, `tiers`, `backends` and any other kind with figure rows: `figure`, `kvfs`
  and `baseline` (numbers, with `unit` and `baseline_name`) or `value` and `baseline`
  (text), `ratio`, `target`, `ok`, `note`;
- `conditions`: the machine, in the one schema of :func:`kvfs.bench.harness.conditions`
  (:data:`kvfs.bench.harness.CONDITION_KEYS`; a benchmark may add keys of its own);
- `command` (argv list or text), `params`, `verdicts`, `problems`, `skipped` (text, or a
  list: what was skipped and why), `notes` (markdown); and a file `<record>.notes.md` beside
  the record, rendered below its figures (the analysis of a run).

Keys of older records that the one schema renamed are refused by :func:`check` with their new
name (:data:`RENAMED`), never read as synonyms.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .harness import CONDITION_KEYS


class ReportError(Exception):
    """A record that cannot be rendered; the message names its file. Nothing was written."""


#: Which key of a hitrate row holds its concurrency (sessions interleaved), if any.
CONCURRENCY_KEYS = ("concurrency", "sessions")
PERCENTILES = ("p50", "p90", "p99", "max")


def number(x: Any) -> float | None:
    """`x` as a finite float, or None (missing, text, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's rows (dicts only)."""
    rows = record.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def concurrency_key(rows: list[dict[str, Any]]) -> str | None:
    for key in CONCURRENCY_KEYS:
        if any(number(r.get(key)) is not None for r in rows):
            return key
    return None


def latency(row: dict[str, Any], q: str) -> float | None:
    """A row's percentile `q` ("p99") in ms: its `p99_ms`."""
    return number(row.get(f"{q}_ms"))


# -- conditions ------------------------------------------------------------------------------

VERSION_KEYS = ("python", "torch", "kvikio", "pyfuse3", "trio", "boto3", "botocore", "xxhash",
                "fio", "weed", "kvfs")
VERSION_NAMES = {"python": "Python", "weed": "SeaweedFS"}
#: Condition keys rendered by name in conditions_text (the rest are listed as they are).
KNOWN_CONDITIONS = set(CONDITION_KEYS) - {"root", "cold_cache"}
#: Keys of older records and their names in the one schema (a version at the top level of
#: the conditions belongs in `versions`; rows under `table` or `sizes[].results` in `rows`).
RENAMED = {"loadavg_before": "load_average", "loadavg_after": "load_average_after",
           "other_load_before_cpus": "other_busy_cpus_before", "filesystem": "filesystems",
           **{k: f"versions.{k}" for k in VERSION_KEYS}}
RENAMED_RECORD = {"table": "rows", "sizes": "rows"}


def _load(value: Any) -> str | None:
    if isinstance(value, list | tuple) and value and number(value[0]) is not None:
        return ", ".join(f"{x:.2f}".rstrip("0").rstrip(".") for x in value if number(x) is not None)
    return None


def _filesystems(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Label -> filesystem facts; a label that is a machine's path is shown as "work dir"."""
    fss = c.get("filesystems")
    out: dict[str, dict[str, Any]] = {}
    for i, (label, fs) in enumerate((fss if isinstance(fss, dict) else {}).items()):
        if isinstance(fs, dict):
            name = "work dir" if os.sep in str(label) or label == "." else str(label)
            out[name if name not in out else f"{name} {i + 1}"] = fs
    return out


def filesystem_text(fs: dict[str, Any]) -> str:
    kind = str(fs.get("kind") or "unknown device")
    if kind.startswith("no "):
        text = f"{fs.get('type', '?')} (no block device)"
    else:
        text = f"{fs.get('type', '?')} on {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
    extra = [f"{fs['size_gib']:g} GiB" if number(fs.get("size_gib")) else None,
             f"read-ahead {fs['read_ahead_kb']} KiB" if number(fs.get("read_ahead_kb")) else None,
             f"model {fs['model']}" if fs.get("model") else None,
             "no journal: creates after many removals are slower" if fs.get("journal") is False
             else None]
    extra = [e for e in extra if e]
    return text + (f" ({', '.join(extra)})" if extra else "")



def versions_of(c: dict[str, Any]) -> dict[str, Any]:
    return dict(c["versions"]) if isinstance(c.get("versions"), dict) else {}


def conditions_brief(c: Any) -> str:
    """One short line for a plot's title: CPU, cores, memory, filesystem, load."""
    if not isinstance(c, dict):
        return ""
    parts = []
    if c.get("cpu") or c.get("cores"):
        parts.append(f"{c.get('cpu', '?')}, {c.get('cores', '?')} cores"
                     + (f", {c['memory_gib']:g} GiB" if number(c.get("memory_gib")) else ""))
    if c.get("gpu"):
        parts.append(str(c["gpu"]))
    fss = _filesystems(c)
    if fss:
        kinds = list(dict.fromkeys(
            f"{fs.get('type', '?')}" + ("" if str(fs.get("kind", "")).startswith("no ")
                                        else f" on {fs.get('kind', '?')}")
            for fs in fss.values()))
        parts.append(" / ".join(kinds))
    load = _load(c.get("load_average"))
    if load:
        parts.append(f"load {load.split(',')[0]}")
    return "; ".join(parts)


def conditions_text(c: Any) -> str:
    """Every condition of a record, as one paragraph of prose."""
    if not isinstance(c, dict) or not c:
        return "not recorded."
    parts = []
    cores = f"{c.get('cores', '?')} cores"
    if number(c.get("cores_usable")) and c.get("cores_usable") != c.get("cores"):
        cores += f" ({c['cores_usable']} usable by the run)"
    parts.append(f"{cores} ({c.get('cpu', '?')})"
                 + (f", {c['memory_gib']:g} GiB of memory" if number(c.get("memory_gib"))
                    else ""))
    if "gpu" in c:
        parts.append(f"GPU: {c['gpu']}" if c["gpu"] else "no GPU")
    if c.get("kernel"):
        parts.append(f"Linux {c['kernel']}")
    fss = _filesystems(c)
    if fss:
        texts = {label: filesystem_text(fs) for label, fs in fss.items()}
        if len(set(texts.values())) == 1:
            parts.append(("every directory on " if len(texts) > 1 else "")
                         + next(iter(texts.values())))
        else:
            parts.append("; ".join(f"{label}: {t}" for label, t in texts.items()))
    versions = versions_of(c)
    if versions:
        have = [f"{VERSION_NAMES.get(k, k)} {v}" for k, v in versions.items() if v]
        missing = [k for k, v in versions.items() if not v]
        parts.append(", ".join(have) + (f" ({', '.join(missing)} not installed)" if missing
                                        else ""))
    if c.get("kvfs_commit"):
        changed = c.get("kvfs_local_changes") or []
        parts.append(f"commit {c['kvfs_commit']}"
                     + (f" with local changes in {', '.join(map(str, changed))}" if changed
                        else ""))
    load = []
    before = _load(c.get("load_average"))
    if before:
        load.append(f"load average {before} when it started (1, 5, 15 min)"
                    if before.count(",") == 2 else f"load average {before} when it started")
    busy = c.get("other_busy_cpus_before")
    if number(busy) is not None:
        load.append(f"other processes kept {busy:g} of the CPUs busy before it")
    after = _load(c.get("load_average_after"))
    if after:
        load.append(f"load average {after} after it")
    if number(c.get("other_busy_cpus_after")) is not None:
        load.append(f"{c['other_busy_cpus_after']:g} CPUs busy after it")
    if load:
        parts.append("; ".join(load))
    if c.get("page_reclaim"):
        parts.append(f"proactive reclaim: {c['page_reclaim']} (warm page cache may go cold)")
    rest = {k: v for k, v in c.items() if k not in KNOWN_CONDITIONS}
    if rest:
        parts.append("also " + ", ".join(f"{k} {value_text(v)}" for k, v in rest.items()))
    if c.get("time"):
        parts.append(f"measured {c['time']}")
    return "; ".join(parts) + "."


# -- formatting --------------------------------------------------------------------------------


def value_text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        if not v:
            return "(none)"
        items = ", ".join(f"{k}={x}" for k, x in v.items()
                          if isinstance(x, str | int | float | bool))
        return f"({items})" if items and len(items) <= 500 else "(in the JSON record)"
    if isinstance(v, list):
        text = json.dumps(v, sort_keys=True)
        return f"`{text}`" if len(text) <= 300 else "(in the JSON record)"
    return str(v)


def num_text(v: Any, fmt: str = ".2f", unit: str = "") -> str:
    x = number(v)
    return "-" if x is None else f"{x:{fmt}}{unit}"


def ratio_text(v: Any) -> str:
    x = number(v)
    if x is None:
        return str(v) if isinstance(v, str) and v else "-"
    return f"{x:.2f}x" if x >= 0.1 or x == 0 else f"{x:.3f}x" if x >= 0.01 else f"{x:.2g}x"


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def _arg(a: str) -> str:
    """An argument as the page shows it: an absolute path keeps only its last part, so that no
    machine's directories end up in the document (`--dir /srv/nvme0/kv` -> `--dir .../kv`)."""
    opt, eq, value = a.partition("=")
    if eq and value.startswith("/"):
        return f"{opt}=.../{os.path.basename(value.rstrip('/'))}"
    return f".../{os.path.basename(a.rstrip('/'))}" if a.startswith("/") and len(a) > 1 else a


def command_line(cmd: Any) -> str | None:
    """A record's command as a reader would type it: `kvfs bench ...`, `python tools/X.py`."""
    if isinstance(cmd, str):
        try:
            words = shlex.split(cmd)
        except ValueError:
            return cmd.strip() or None
        if words[:1] == ["python"] and len(words) > 1:
            return " ".join(["python", words[1], *(shlex.quote(_arg(w)) for w in words[2:])])
        return " ".join(shlex.quote(_arg(w)) for w in words) or None
    if not isinstance(cmd, list) or not cmd:
        return None
    argv = [str(a) for a in cmd]
    head = argv[0].replace(os.sep, "/")
    name = head.rsplit("/", 1)[-1]
    if name == "kvfs" or head.endswith(("kvfs/cli.py", "kvfs/cli/__main__.py", "kvfs/__main__.py")):
        prefix = "kvfs"
    elif name.endswith(".py"):
        prefix = f"python {'tools/' if '/tools/' in f'/{head}' else ''}{name}"
    else:
        prefix = shlex.quote(name)
    return " ".join([prefix, *(shlex.quote(_arg(a)) for a in argv[1:])])


# -- tables that several kinds share -------------------------------------------------------------


def figure_table(record: dict[str, Any]) -> list[str]:
    """Rows of figure / kvfs / baseline / ratio / target, numeric (mount) or text (tiers)."""
    rows = rows_of(record)
    if not any("figure" in r for r in rows):
        return generic_table(record)
    notes = any(r.get("note") for r in rows)
    targets = any(r.get("target") for r in rows)
    peer = (record.get("peer") or {}).get("name") if any("peer_ratio" in r for r in rows) else ""
    head = ["figure", "kvfs", "baseline", "ratio", *([f"ratio of {peer}"] if peer else []),
            *(["target"] if targets else []),
            *(["conditions"] if notes else [])]
    out = []
    for r in rows:
        unit = str(r.get("unit", ""))
        value = r["value"] if isinstance(r.get("value"), str) else unit_text(r.get("kvfs"), unit)
        base = r.get("baseline")
        base = base if isinstance(base, str) else unit_text(base, unit)
        if r.get("baseline_name"):
            base += f" ({r['baseline_name']})"
        verdict = "" if r.get("ok") is None else " ok" if r["ok"] else " **missed**"
        out.append([str(r.get("figure", "-")), value, base, ratio_text(r.get("ratio")),
                    *([peer_text(r)] if peer else []),
                    *([f"{r.get('target') or ''}{verdict}".strip()] if targets else []),
                    *([str(r.get("note") or "")] if notes else [])])
    return md_table(head, out)


def peer_text(row: dict[str, Any]) -> str:
    """A row's peer ratio, and whether the peer meets the row's target."""
    if row.get("peer_ratio") is None:
        return "-"
    ok = "" if row.get("peer_ok") is None else " ok" if row["peer_ok"] else " missed"
    return f"{ratio_text(row['peer_ratio'])}{ok}"


def unit_text(v: Any, unit: str) -> str:
    x = number(v)
    if x is None:
        return "-"
    if unit == "s" and x >= 100 or unit in ("us", "MiB"):
        return f"{x:.0f} {unit}"
    return f"{x:.2f} {unit}".rstrip()


def generic_table(record: dict[str, Any]) -> list[str]:
    """Rows as they are; a record without rows: its top-level figures, one a line."""
    rows = rows_of(record)
    if not rows:
        figures = {k: v for k, v in record.items() if k not in NOT_PARAMETERS}
        return md_table(["figure", "value"], [[k, value_text(v)] for k, v in figures.items()]
                        ) if figures else []
    cols = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if isinstance(v, str | int | float | bool) or v is None))
    return md_table(cols, [[value_text(r.get(c)) if r.get(c) is not None else "-" for c in cols]
                           for r in rows])


@dataclass(frozen=True)
class Kind:
    """A kind of record: how `kvfs bench report` introduces, tabulates and draws it."""

    name: str  #: the record's "benchmark"
    title: str
    command: str  #: how to make the record, for the head and when it is missing
    method: str  #: what it measures and how (markdown)
    table: Callable[[dict[str, Any]], list[str]]  #: markdown lines of a record's figures
    numeric: tuple[str, ...] = ()  #: row fields that must be numbers when present
    needs_gpu: bool = False
    shown: tuple[str, ...] = ()  #: record fields the table shows (not repeated as parameters)
    #: "verdicts" in ``shown``: the table shows the record's verdicts too (not listed again)
    #: draws a record into a matplotlib figure: (record, pyplot) -> figure; None: a table
    plot: Callable[[dict[str, Any], Any], Any] | None = None


#: Record fields shown by their kind's table or elsewhere, not as parameters.
NOT_PARAMETERS = {"benchmark", "command", "conditions", "rows", "plot", "params",
                  "verdicts", "problems", "skipped", "notes", "control", "restore", "large",
                  "delays", "outages", "results", "markdown", "conditions_line",
                  "daemon_warnings", "publish", "proxy"}


# -- records ---------------------------------------------------------------------------------


def check(record: Any, path: str, kinds: dict[str, Kind] | None = None) -> dict[str, Any]:
    """The record, or ReportError naming `path` and what is wrong with it (`kinds`: by name,
    whose `numeric` row fields must be numbers)."""
    if not isinstance(record, dict):
        raise ReportError(f"{path}: not a benchmark record (a JSON object was expected)")
    kind = record.get("benchmark")
    if not isinstance(kind, str) or not kind:
        raise ReportError(f"{path}: no \"benchmark\" field naming the record's kind")
    for key in ("rows", "verdicts", "problems"):
        if key in record and not isinstance(record[key], list):
            raise ReportError(f"{path}: \"{key}\" must be a list")
    for key in ("conditions", "params", "control"):
        if key in record and record[key] is not None and not isinstance(record[key], dict):
            raise ReportError(f"{path}: \"{key}\" must be an object")
    for key in ("notes",):
        if key in record and not isinstance(record[key], str | list):
            raise ReportError(f"{path}: \"{key}\" must be text")
    old = [f"\"{k}\" (now \"{new}\")" for k, new in RENAMED_RECORD.items() if k in record]
    old += [f"\"conditions.{k}\" (now \"{new}\")" for k, new in RENAMED.items()
            if k in (record.get("conditions") or {})]
    if old:
        raise ReportError(f"{path}: a record of an older shape: {', '.join(old)}")
    numeric = kinds[kind].numeric if kinds and kind in kinds else ()
    for i, row in enumerate(record.get("rows") or []):
        if not isinstance(row, dict):
            raise ReportError(f"{path}: row {i} is not an object")
        for key in numeric:
            v = row.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ReportError(f"{path}: row {i}: \"{key}\" is {v!r}, not a number")
    return record


def load_records(directory: str, kinds: dict[str, Kind] | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
    """Every `*.json` record of `directory`, checked, sorted by file name."""
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: no such directory of benchmark records")
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, UnicodeDecodeError) as exc:
            raise ReportError(f"{path}: cannot be read: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}: not valid JSON: {exc}") from None
        out.append((path, check(record, path, kinds)))
    return out
